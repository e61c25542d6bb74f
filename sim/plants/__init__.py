"""Dynamical plants for the plant emulator, registered by name.

``sim://plant?model=msd`` picks a plant from :data:`PLANTS`.  Shipped: ``msd``
(mass-spring-damper), ``dc-motor``, the four X-29A linearized models
(``x29-nd-pa-lon``, ``x29-nd-ua-lon``, ``x29-nd-pa-lat``, ``x29-nd-ua-lat``),
``flexible-joint``, ``van-der-pol`` and the PyBullet ``cartpole``.  Add one with
:func:`register_plant`.
"""

# Registration order is the order plants are listed in errors: the generic ones first.
from .base import PLANTS, Plant, UnknownPlantError, make_plant, plant_class, register_plant, rk4_step
from .dc_motor import DCMotor
from .msd import MassSpringDamper

# isort: split
from .cartpole import CARTPOLE, CartPole, cartpole_linearization, cartpole_model
from .disturbance import DISTURBANCE_KINDS, DisturbanceSignal
from .flexible_joint import FLEXIBLE_JOINT, FlexibleJoint
from .structured import StructuredPlant
from .van_der_pol import VanDerPol, van_der_pol_matrices
from .x29 import X29, X29_MODELS, x29_matrices

__all__ = ["PLANTS", "Plant", "UnknownPlantError", "make_plant", "plant_class", "register_plant", "rk4_step",
           "DCMotor", "MassSpringDamper", "StructuredPlant", "DisturbanceSignal", "DISTURBANCE_KINDS",
           "X29", "X29_MODELS", "x29_matrices", "FlexibleJoint", "FLEXIBLE_JOINT", "VanDerPol",
           "van_der_pol_matrices", "CartPole", "CARTPOLE", "cartpole_model", "cartpole_linearization"]
