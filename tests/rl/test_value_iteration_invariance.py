"""On a small deterministic MDP, value iteration finds the same optimal policy under the outcome reward and under
each shaped reward with a fixed discriminator.

The MDP: a 5 x 5 grid, start in one corner, the goal in the opposite one (absorbing,
outcome reward 1 per step spent there), a trap cell (absorbing, reward 0), actions
up/down/left/right/stay, deterministic moves.  The discriminators are the exact ones a
perfect classifier would learn from rollouts of a noisy behaviour policy (visitation
counts of successful vs unsuccessful trajectories, the policy's own visitation for the
success-only form), with the logits clipped to beta.  "Unchanged" is checked as the
statement that matters: the greedy policy of the shaped values is optimal under the
outcome reward in every state.  For the potential-based form any fixed potential works
(Ng, Harada and Russell 1999), so random potentials with a large weight are checked too.
"""

from __future__ import annotations

import numpy as np
import pytest

N, GOAL, TRAP, START = 5, 24, 12, 0
MOVES = [(-1, 0), (1, 0), (0, -1), (0, 1), (0, 0)]
GAMMA = 0.9


def step(s: int, a: int) -> int:
    if s in (GOAL, TRAP):
        return s
    r, c = divmod(s, N)
    dr, dc = MOVES[a]
    r, c = min(max(r + dr, 0), N - 1), min(max(c + dc, 0), N - 1)
    return r * N + c


NEXT = np.array([[step(s, a) for a in range(5)] for s in range(N * N)])
OUTCOME = (NEXT == GOAL).astype(float)  # r(s, a) = 1 when the step ends at the goal


def value_iteration(reward: np.ndarray, iters: int = 2000) -> np.ndarray:
    q = np.zeros_like(reward)
    for _ in range(iters):
        q = reward + GAMMA * q.max(1)[NEXT]
    return q


def policy_value(reward: np.ndarray, policy: np.ndarray, iters: int = 2000) -> np.ndarray:
    v = np.zeros(N * N)
    idx = np.arange(N * N)
    for _ in range(iters):
        v = reward[idx, policy] + GAMMA * v[NEXT[idx, policy]]
    return v


def visitation(seed: int = 0, episodes: int = 4000, horizon: int = 14):
    """Counts of (s, a) in successful and other trajectories of a noisy goal-seeking behaviour policy."""
    rng = np.random.default_rng(seed)
    pos, neg = np.zeros((N * N, 5)), np.zeros((N * N, 5))
    for _ in range(episodes):
        s, rows = START, []
        for _ in range(horizon):
            a = rng.integers(5) if rng.random() < 0.6 else rng.choice([1, 3])
            rows.append((s, a))
            s = NEXT[s, a]
        target = pos if s == GOAL else neg
        for s_, a_ in rows:
            target[s_, a_] += 1
    return pos, neg


def logit(p: np.ndarray, n: np.ndarray, beta: float) -> np.ndarray:
    eps = 1e-9  # unvisited pairs: log(0/0) -> 0, one-sided -> +-beta after clipping
    return np.clip(np.log((p / max(p.sum(), 1) + eps) / (n / max(n.sum(), 1) + eps)), -beta, beta)


def assert_optimal_under_outcome(shaped_reward: np.ndarray) -> None:
    q_star = value_iteration(OUTCOME)
    greedy = value_iteration(shaped_reward).argmax(1)
    np.testing.assert_allclose(policy_value(OUTCOME, greedy), q_star.max(1), atol=1e-8)


@pytest.mark.parametrize("lam", [0.05, 0.1])
def test_success_visitation_reward_keeps_the_optimal_policy(lam):
    pos, neg = visitation()
    assert pos.sum() > 0 and neg.sum() > 0
    assert_optimal_under_outcome(OUTCOME + lam * logit(pos, neg, beta=5.0))


def test_success_only_reward_keeps_the_optimal_policy():
    pos, neg = visitation(seed=1)
    assert_optimal_under_outcome(OUTCOME + 0.1 * logit(pos, pos + neg, beta=5.0))


@pytest.mark.parametrize("seed", range(5))
def test_potential_based_reward_keeps_the_optimal_policy_for_any_potential(seed):
    rng = np.random.default_rng(seed)
    pos, neg = visitation(seed=seed)
    fitted = logit(pos.sum(1), neg.sum(1), beta=5.0)  # state-only discriminator
    for phi, lam in ((fitted, 0.5), (rng.uniform(-5, 5, N * N), 3.0)):
        shaped = OUTCOME + lam * (GAMMA * phi[NEXT] - phi[:, None])
        assert_optimal_under_outcome(shaped)
        # Stronger: Q' = Q - lam * Phi(s), so the sets of optimal actions are identical.
        np.testing.assert_allclose(value_iteration(shaped), value_iteration(OUTCOME) - lam * phi[:, None], atol=1e-6)


def test_an_arbitrary_non_potential_bonus_can_change_the_optimal_policy():
    """Why the guarantee matters: a bonus that is not a fitted success discriminator may move the optimum."""
    bonus = np.zeros_like(OUTCOME)
    bonus[START, 4] = 1.5  # reward staying at the start more than the goal pays
    q_star = value_iteration(OUTCOME)
    greedy = value_iteration(OUTCOME + bonus).argmax(1)
    assert policy_value(OUTCOME, greedy)[START] < q_star.max(1)[START] - 1e-3
