"""Weights that survive bit flips: block-wise zero-sum training, exact int8, fault injection.

``protect`` puts a torch model's weights under the block constraints (a parametrization;
fine-tune afterwards), ``finalize`` bakes them in, ``protect_bundle`` records the layout
(and an exact int8 variant) in an exported bundle; ``closedloop.runtime.protect.scrubber`` checks and repairs
the deployed weights. ``inject_faults`` and ``bit_flip_attack`` corrupt bundles for
evaluation. See docs/robustness.md.
"""

from .attack import AttackConfig, AttackResult, bit_flip_attack
from .bundle import protect_bundle
from .faults import BitFlip, apply_flips, inject_faults, random_flips, write_corrupted_copy
from .projection import BlockZeroSum, project_numpy
from .protect import ProtectionPlan, finalize, probe_onnx_layout, protect
from .quantize import int8_weight_only, quantize_blocks

__all__ = [
    "AttackConfig",
    "AttackResult",
    "BitFlip",
    "BlockZeroSum",
    "ProtectionPlan",
    "apply_flips",
    "bit_flip_attack",
    "finalize",
    "inject_faults",
    "int8_weight_only",
    "probe_onnx_layout",
    "project_numpy",
    "protect",
    "protect_bundle",
    "quantize_blocks",
    "random_flips",
    "write_corrupted_copy",
]
