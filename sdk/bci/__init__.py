"""The iBCI handwriting decoder family: spike-count bins -> characters -> text.

A GRU backbone trained on pooled held-in sessions, a meta-learned alignment layer that
calibrates a new session from three sentences, FALCON H2 data and metrics, and export to a
streaming bundle. The public names below load on first use (torch only when needed).

- Data: :func:`load_falcon_h2`, :func:`load_falcon_h2_dir`, :func:`write_falcon_h2` (NWB, FALCON H2 layout);
  the ``Session`` / ``Trial`` types and ``CHARSET`` are in :mod:`closedloop.common.handwriting`.
- Train, calibrate, score: :class:`HarnessConfig`, :func:`train_harness`, :func:`train_pooled_bundle`,
  :func:`calibrate_bundle`, :func:`evaluate_bundle`, :func:`run_harness`, :func:`falcon_metrics`.
- Deploy: :func:`export_bci_bundle`, :class:`FalconBundleDecoder` (falcon_challenge's decoder interface).
- Benchmark: :class:`BciBenchConfig`, :func:`run_bci_benchmark`.

Every file of the family, across the layers, is listed in ``docs/families.md``; the user guide
is ``docs/bci.md``.
"""

from closedloop.common.lazy import lazy_exports

_EXPORTS = {
    "load_falcon_h2": ".nwb", "load_falcon_h2_dir": ".nwb", "write_falcon_h2": ".nwb",
    "write_falcon_h2_dir": ".nwb", "FalconFileError": ".nwb",
    "HarnessConfig": ".evaluate", "run_harness": ".evaluate", "available_methods": ".evaluate",
    "TrainConfig": ".train", "BackboneConfig": ".train", "train_backbone": ".train",
    "CalibrationConfig": ".calibrate", "calibrate_session": ".calibrate",
    "MetaConfig": ".meta",
    "CalibrationReport": ".workflow", "calibrate_bundle": ".workflow", "evaluate_bundle": ".workflow",
    "format_evaluation": ".workflow", "compare_evaluations": ".workflow", "format_comparison": ".workflow",
    "load_sessions": ".workflow", "train_harness": ".workflow",
    "train_pooled_bundle": ".workflow",
    "falcon_metrics": ".metrics", "score_session": ".metrics",
    "greedy_decode": ".decoding", "beam_decode": ".decoding", "Lexicon": ".decoding",
    "AlignedDecoder": ".models", "GRUBackbone": ".models", "AffineAlignment": ".models",
    "export_bci_bundle": ".deploy", "decoder_from_state": ".deploy",
    "FalconBundleDecoder": ".falcon_decoder",
    "BciBenchConfig": ".benchmark", "run_bci_benchmark": ".benchmark",
    "encode": ".charset", "decode": ".charset", "CharsetError": ".charset",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
