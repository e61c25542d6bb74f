"""Dynamical plants for the plant emulator, registered by name.

``sim://plant?model=msd`` picks a plant from :data:`PLANTS`.  Shipped: ``msd``
(mass-spring-damper) and ``dc-motor``.  Add one with :func:`register_plant`.
"""

from .base import PLANTS, Plant, UnknownPlantError, make_plant, plant_class, register_plant, rk4_step
from .dc_motor import DCMotor
from .msd import MassSpringDamper

__all__ = ["PLANTS", "Plant", "UnknownPlantError", "make_plant", "plant_class", "register_plant", "rk4_step",
           "DCMotor", "MassSpringDamper"]
