"""PyBullet manipulation tasks on the Franka Panda, as gymnasium environments and as emulator tasks.

``tasks`` defines reach, push and pick-and-place (registered as panda tasks, so
``sim://panda?task=push`` runs them over the wire); ``env`` wraps a task in gymnasium's
API (``gymnasium.make("closedloop/PandaPush-v0")`` once this package is imported);
``scripted`` holds a scripted controller per task.  Importing this package needs
pybullet only when a scene is built, and gymnasium only for the environments.
"""

from .scripted import (
    SCRIPTED_CONTROLLERS,
    PickAndPlaceController,
    PushController,
    ReachController,
    ScriptedController,
    rollout_controller,
    scripted_controller,
)
from .tasks import GRIPPER_MAX_M, PickAndPlaceTask, PushTask, ReachTask, TabletopTask

__all__ = ["SCRIPTED_CONTROLLERS", "PickAndPlaceController", "PushController", "ReachController",
           "ScriptedController", "rollout_controller", "scripted_controller", "GRIPPER_MAX_M", "PickAndPlaceTask",
           "PushTask", "ReachTask", "TabletopTask"]

try:  # the environments need gymnasium (the ``sim`` extra); the emulator tasks do not
    from .env import ENV_IDS, PandaTaskEnv, register_envs
except ImportError:  # pragma: no cover - gymnasium missing
    pass
else:
    register_envs()
    __all__ += ["ENV_IDS", "PandaTaskEnv", "register_envs"]
