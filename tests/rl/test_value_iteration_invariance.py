"""On a small deterministic MDP, value iteration (exact) shows when a shaped reward keeps the optimal policy.

The MDP: a 5 x 5 grid, start in one corner, the goal in the opposite one and a trap in the
centre, both *terminal* (the episode ends there: nothing is earned afterwards, so a bonus
cannot be collected at the goal forever), outcome reward 1 for the step that enters the
goal, actions up/down/left/right/stay, deterministic moves, gamma 0.9.  The discriminators
are the exact ones a perfect classifier would learn from rollouts of a noisy behaviour
policy (visitation of successful vs unsuccessful trajectories; the policy's own visitation
for the success-only form), logits clipped to beta.

What the docs (docs/rl.md) state, shown both ways: the ``svm`` and ``gail`` bonuses are
bounded by ``lam * beta`` per step, so they move any Q value by at most
``lam * beta / (1 - gamma)``; when ``2 * lam * beta / (1 - gamma)`` is below the smallest
gap between an optimal and a non-optimal action the optimal policy is kept, and a large
``lam * beta`` does change it (the agent lingers on success-like states instead of
finishing).  The potential form keeps the optimal actions for any scale and any potential
(Ng, Harada and Russell 1999): ``Q' = Q - lam * Phi(s)``.
"""

from __future__ import annotations

import numpy as np
import pytest

N, GOAL, TRAP, START = 5, 24, 12, 0
MOVES = [(-1, 0), (1, 0), (0, -1), (0, 1), (0, 0)]
GAMMA, BETA = 0.9, 5.0
TERMINAL = np.zeros(N * N, bool)
TERMINAL[[GOAL, TRAP]] = True
LIVE = ~TERMINAL


def step(s: int, a: int) -> int:
    if TERMINAL[s]:
        return s
    r, c = divmod(s, N)
    dr, dc = MOVES[a]
    r, c = min(max(r + dr, 0), N - 1), min(max(c + dc, 0), N - 1)
    return r * N + c


NEXT = np.array([[step(s, a) for a in range(5)] for s in range(N * N)])
OUTCOME = ((NEXT == GOAL) & LIVE[:, None]).astype(float)  # 1 for the step that enters the goal
CONT = LIVE[NEXT].astype(float)  # 0 when the next state is terminal: no bootstrap


def value_iteration(reward: np.ndarray, iters: int = 400) -> np.ndarray:
    q = np.zeros_like(reward)
    for _ in range(iters):
        q = reward + GAMMA * CONT * q.max(1)[NEXT]
    return q


def policy_value(reward: np.ndarray, policy: np.ndarray, iters: int = 400) -> np.ndarray:
    v = np.zeros(N * N)
    idx = np.arange(N * N)
    for _ in range(iters):
        v = reward[idx, policy] + GAMMA * CONT[idx, policy] * v[NEXT[idx, policy]]
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
            if TERMINAL[s]:
                break
        target = pos if s == GOAL else neg
        for s_, a_ in rows:
            target[s_, a_] += 1
    return pos, neg


def logit(p: np.ndarray, n: np.ndarray, beta: float = BETA) -> np.ndarray:
    eps = 1e-9  # unvisited pairs: log(0/0) -> 0, one-sided -> +-beta after clipping
    out = np.clip(np.log((p / max(p.sum(), 1) + eps) / (n / max(n.sum(), 1) + eps)), -beta, beta)
    return out * LIVE.reshape((-1,) + (1,) * (out.ndim - 1))  # no bonus from terminal states


def keeps_optimum(shaped_reward: np.ndarray) -> bool:
    """Whether the greedy policy of the shaped values is optimal under the outcome reward in every live state."""
    v_star = value_iteration(OUTCOME).max(1)
    greedy = value_iteration(shaped_reward).argmax(1)
    return bool(np.allclose(policy_value(OUTCOME, greedy)[LIVE], v_star[LIVE], atol=1e-8))


def action_gap() -> float:
    """The smallest gap between the optimal value and the best non-optimal action's, over live states."""
    q = value_iteration(OUTCOME)[LIVE]
    best = q.max(1, keepdims=True)
    worse = np.where(q < best - 1e-9, q, -np.inf).max(1)
    return float((best[:, 0] - worse)[np.isfinite(worse)].min())


def safe_lam(beta: float = BETA) -> float:
    """Just inside the docs' sufficient condition 2 * lam * beta / (1 - gamma) < action gap."""
    return 0.9 * action_gap() * (1 - GAMMA) / (2 * beta)


def test_the_outcome_reward_alone_is_solved_by_going_to_the_goal():
    v = value_iteration(OUTCOME).max(1)
    assert v[START] == pytest.approx(GAMMA ** 7)  # 8 moves, the last one paid, the trap avoided
    assert action_gap() > 0.01


@pytest.mark.parametrize("seed", [0, 1])
def test_success_visitation_keeps_the_optimum_when_lam_beta_is_small_and_changes_it_when_large(seed):
    pos, neg = visitation(seed)
    assert pos.sum() > 0 and neg.sum() > 0
    f = logit(pos, neg)
    assert np.abs(f).max() == BETA  # the clip binds: the bound lam * beta is reached
    assert keeps_optimum(OUTCOME + safe_lam() * f)
    assert not keeps_optimum(OUTCOME + 1.0 * f)  # lam * beta = 5 per step against an outcome of 1


@pytest.mark.parametrize("seed", [0, 1])
def test_success_only_keeps_the_optimum_when_lam_beta_is_small_and_changes_it_when_large(seed):
    pos, neg = visitation(seed)
    f = logit(pos, pos + neg)  # successful against the policy's own visitation
    assert keeps_optimum(OUTCOME + safe_lam() * f)
    assert not keeps_optimum(OUTCOME + 1.0 * f)


@pytest.mark.parametrize("seed", range(3))
def test_potential_based_reward_keeps_the_optimal_policy_for_any_potential_and_scale(seed):
    rng = np.random.default_rng(seed)
    pos, neg = visitation(seed=seed)
    fitted = logit(pos.sum(1), neg.sum(1))  # state-only discriminator, Phi(terminal) = 0
    random_phi = rng.uniform(-5, 5, N * N) * LIVE
    for phi in (fitted, random_phi):
        for lam in (0.01, 1.0, 100.0):
            shaped = OUTCOME + lam * (GAMMA * CONT * phi[NEXT] - phi[:, None])
            assert keeps_optimum(shaped)
            # Stronger: Q' = Q - lam * Phi(s) on live states, so the sets of optimal actions are identical.
            np.testing.assert_allclose(value_iteration(shaped)[LIVE],
                                       (value_iteration(OUTCOME) - lam * phi[:, None])[LIVE], atol=1e-6)


def test_potential_form_with_the_wrong_discount_can_change_the_optimum():
    """Why the potential form needs the algorithm's own gamma: shaping with another discount is not invariant."""
    pos, neg = visitation(0)
    phi = logit(pos.sum(1), neg.sum(1))
    wrong = OUTCOME + 1.0 * (0.5 * CONT * phi[NEXT] - phi[:, None])
    assert not keeps_optimum(wrong)
