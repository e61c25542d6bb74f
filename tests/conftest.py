"""Shared fixtures: real small artefacts (tiny exported bundles) built once per session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def autograd_nodes():
    """``names(out)``: the class names of the autograd nodes behind tensor ``out`` (which code a pass ran)."""

    def names(out) -> set[str]:
        seen, todo = set(), [out.grad_fn]
        while todo:
            fn = todo.pop()
            if fn is not None and fn not in seen:
                seen.add(fn)
                todo += [f for f, _ in fn.next_functions]
        return {type(fn).__name__ for fn in seen}

    return names


@pytest.fixture(scope="session")
def tiny_models():
    import torch

    from sdk.models import GRUDecoder, MLPPolicy

    torch.manual_seed(0)
    return {
        "gru": GRUDecoder(n_inputs=12, n_hidden=16, n_layers=2, n_outputs=5).eval(),
        "mlp": MLPPolicy(n_obs=6, n_actions=3, hidden=(16, 16)).eval(),
    }


@pytest.fixture(scope="session")
def gru_bundle(tmp_path_factory, tiny_models):
    import torch

    from export import export_bundle

    return export_bundle(
        tiny_models["gru"],
        tmp_path_factory.mktemp("bundles") / "gru",
        kind="recurrent",
        example_input=torch.zeros(1, 12),
        rate_hz=50.0,
        name="tiny-gru",
        variants=("fp16", "int8"),
        report=lambda s: None,
    )


@pytest.fixture(scope="session")
def mlp_bundle(tmp_path_factory, tiny_models):
    import torch

    from export import export_bundle

    return export_bundle(
        tiny_models["mlp"],
        tmp_path_factory.mktemp("bundles") / "mlp",
        kind="feedforward",
        example_input=torch.zeros(1, 6),
        rate_hz=1000.0,
        name="tiny-mlp",
        postprocess={"low": [-0.5, -0.5, -0.5], "high": [0.5, 0.5, 0.5]},
        variants=(),
        report=lambda s: None,
    )
