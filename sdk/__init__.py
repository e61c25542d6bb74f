"""closedloop SDK: model families, training, calibration, evaluation, the CLI.

The user-facing layer. It may import every other package (runtime, export, sim,
firmware_bridge) and torch.
"""
