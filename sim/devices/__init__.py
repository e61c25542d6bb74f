"""Device emulators: the :class:`Device` interface, its registry, the runner, and the shipped devices.

Shipped: ``headstage`` (NEURAL_FRAME out, DECODER_OUTPUT in), ``plant``
(PLANT_MEASUREMENT out, ACTUATOR_COMMAND in) and ``panda`` (JOINT_STATE out,
JOINT_COMMAND in; needs pybullet, imported only when a panda is built).
"""

from .base import (
           DEVICES,
           Device,
           StatusCode,
           UnknownDeviceError,
           device_class,
           device_params,
           register_device,
)
from .headstage import Headstage
from .panda import PandaDevice
from .panda_scene import TASKS, PandaScene, ReachTask, Task, register_task
from .plant import PlantDevice
from .runner import DeviceRunner, PortGoneError

__all__ = ["DEVICES", "Device", "StatusCode", "UnknownDeviceError", "device_class", "device_params",
           "register_device", "Headstage", "PandaDevice", "PlantDevice", "DeviceRunner", "PortGoneError",
           "TASKS", "PandaScene", "ReachTask", "Task", "register_task"]
