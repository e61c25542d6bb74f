"""Robot RL fine-tuning with success-visitation rewards (the third model family).

A sparse outcome reward (1 on success) is made dense by a discriminator between the
state-action pairs of earlier successful and unsuccessful trajectories
(:class:`VisitationReward`, in three forms: success visitation matching, its
potential-based variant, and a success-only GAIL-like one); :class:`SuccessVisitationWrapper`
applies it to any gymnasium environment that reports ``is_success``, and
:mod:`closedloop.sdk.rl.sb3` plugs it into stable-baselines3.  :func:`fine_tune` runs the whole
recipe on a Panda task (behaviour cloning from scripted demonstrations, then SAC), and
:mod:`closedloop.sdk.rl.deploy` exports the policy to a bundle and runs it against the emulator;
:class:`SB3Policy` turns any SB3 policy with continuous actions into a module ``export_bundle`` takes.
The method, formulas and workflow are in ``docs/rl.md``.
"""

from closedloop.common.lazy import lazy_exports

from .config import SHAPING_KINDS, FineTuneConfig, ShapingConfig

# torch, gymnasium, stable-baselines3 and PyBullet load only when these are first used (the CLI imports this
# package to register rl-train: `closedloop --version` must not wait for torch)
_LAZY = {"Discriminator": ".reward", "LabelledReplay": ".reward", "VisitationReward": ".reward",
         "clipped_logit": ".reward", "FixedNormalization": ".wrapper", "SuccessVisitationWrapper": ".wrapper",
         "fine_tune": ".finetune", "export_policy": ".deploy", "compare_deployment": ".deploy",
         "run_deployed": ".deploy", "rl_train": ".workflow", "rl_train_config": ".workflow",
         "ShapedReplayBuffer": ".sb3", "ShapedDictReplayBuffer": ".sb3", "ShapedHerReplayBuffer": ".sb3",
         "SB3Policy": ".sb3_policy"}

__all__ = ["SHAPING_KINDS", "FineTuneConfig", "ShapingConfig", *_LAZY]

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
