"""Weights that survive bit flips: block-wise zero-sum training, exact int8, fault injection.

``protect`` puts a torch model's weights under the block constraints (a parametrization;
fine-tune afterwards), ``finalize`` bakes them in, ``protect_bundle`` records the layout
(and an exact int8 variant) in an exported bundle; ``closedloop.runtime.protect.scrubber`` checks and repairs
the deployed weights. ``inject_faults`` and ``bit_flip_attack`` corrupt bundles for
evaluation. See docs/robustness.md.
"""

from closedloop.common.lazy import lazy_exports

# torch and Numba load only when these are first used (the CLI imports this package to register its commands)
_EXPORTS = {
    "AttackConfig": ".attack", "AttackResult": ".attack", "bit_flip_attack": ".attack",
    "protect_bundle": ".bundle",
    "BitFlip": ".faults", "apply_flips": ".faults", "inject_faults": ".faults", "random_flips": ".faults",
    "write_corrupted_copy": ".faults",
    "BlockZeroSum": ".projection", "project_numpy": ".projection",
    "ProtectionPlan": ".protection", "finalize": ".protection", "probe_onnx_layout": ".protection", "protect": ".protection",
    "int8_weight_only": ".quantize", "quantize_blocks": ".quantize",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
