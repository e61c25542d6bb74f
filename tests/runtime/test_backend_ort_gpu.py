"""ONNX Runtime's CUDA and TensorRT providers as backends (``ort-cuda``, ``ort-trt``).

Where the providers are absent (a CPU-only onnxruntime build, no GPU) they are reported
unavailable with what is missing, refused by name and passed over by ``auto``. A provider
that is listed but falls back to the CPU is refused with ONNX Runtime's reason, and so is
a graph with nodes the GPU provider would leave on the CPU. Parity and latency on the GPU
run only where the provider really works (skipped otherwise, with the reason).
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from closedloop.runtime import Model, load_bundle
from closedloop.runtime.backends import BackendOptions, create_backend, time_backend
from closedloop.runtime.backends import ort_gpu_backend as g
from closedloop.runtime.errors import BackendUnavailableError
from closedloop.sdk.cli import main

GPU = {"ort-cuda": g.OrtCudaBackend, "ort-trt": g.OrtTrtBackend}


@pytest.fixture
def fresh_probe(monkeypatch):
    """Each test probes the providers anew (the module caches the probe per process)."""
    monkeypatch.setattr(g, "_PROBED", {})


@pytest.mark.parametrize("name", sorted(GPU))
def test_a_provider_missing_from_the_build_is_unavailable_saying_what_to_install(name, fresh_probe):
    cls = GPU[name]
    if cls.provider in ort.get_available_providers():
        pytest.skip(f"this onnxruntime build has {cls.provider}")
    a = cls.availability()
    assert not a
    assert cls.provider in a.reason and "onnxruntime-gpu" in a.reason, a.reason


def test_a_listed_provider_that_falls_back_to_the_cpu_is_unavailable_with_onnxruntimes_reason(
        monkeypatch, fresh_probe, gru_bundle):
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime build really has the CUDA provider")
    real = ort.get_available_providers
    # What a GPU build with a missing libcudnn looks like from Python: listed, but the session is CPU-only.
    monkeypatch.setattr(ort, "get_available_providers", lambda: [*real(), "CUDAExecutionProvider"])
    a = g.OrtCudaBackend.availability()
    assert not a
    assert "fell back entirely" in a.reason and "CPUExecutionProvider" in a.reason, a.reason
    assert "not in available provider names" in a.reason, a.reason  # ORT's own words are quoted
    # and a session on the bundle's graph is refused, not run on the CPU under the GPU backend's name
    b = load_bundle(gru_bundle)
    with pytest.raises(BackendUnavailableError, match="fell back entirely"):
        g.OrtCudaBackend(b.graph_path(), b.graph())


def test_node_placement_is_read_from_the_first_steps_profile(gru_bundle, tmp_path):
    b = load_bundle(gru_bundle)
    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "p")
    sess = ort.InferenceSession(str(b.graph_path()), sess_options=so, providers=["CPUExecutionProvider"])
    feeds = {t.name: np.zeros(t.concrete_shape(1), dtype=t.dtype) for t in b.graph().inputs}
    sess.run(None, feeds)
    placed = g.node_placements(sess.end_profiling())
    ops = {op for op, _ in placed.values()}
    assert "GRU" in ops, placed
    assert {p for _, p in placed.values()} == {"CPUExecutionProvider"}
    # the same placements under a session that claims the CUDA provider: refused, naming nodes and ops
    problem = g.placement_problem("CUDAExecutionProvider", ["CUDAExecutionProvider", "CPUExecutionProvider"], placed)
    assert problem is not None and f"{len(placed)} of {len(placed)} nodes on the CPU" in problem
    gru_node = next(n for n, (op, _) in placed.items() if op == "GRU")
    assert f"{gru_node} (GRU)" in problem
    on_gpu = {n: (op, "CUDAExecutionProvider") for n, (op, _) in placed.items()}
    assert g.placement_problem("CUDAExecutionProvider", ["CUDAExecutionProvider"], on_gpu) is None


def test_backend_ort_cuda_is_refused_naming_what_is_missing(gru_bundle, capsys, fresh_probe):
    if g.OrtCudaBackend.availability():
        pytest.skip("ort-cuda runs here")
    rc = main(["run", str(gru_bundle), "--backend", "ort-cuda", "--duration", "0.1"])
    err = capsys.readouterr().err
    assert rc != 0
    assert "'ort-cuda'" in err and "CUDAExecutionProvider" in err, err


def test_auto_passes_over_the_gpu_providers_where_they_do_not_run(gru_bundle, fresh_probe):
    unavailable = [n for n, cls in GPU.items() if not cls.availability()]
    if not unavailable:
        pytest.skip("both GPU providers run here")
    m = Model(gru_bundle, backend="auto", variant="fp32")
    try:
        assert m.choice.chosen not in unavailable
        for n in unavailable:
            assert GPU[n].provider in m.choice.skipped[n], m.choice.skipped
    finally:
        m.close()


def test_tensorrt_runs_fp32_unless_the_graph_is_the_fp16_variant_and_caches_engines_where_it_can_write(
        gru_bundle, tmp_path, monkeypatch):
    b = load_bundle(gru_bundle)
    spec = b.graph()
    assert not g.wants_fp16(b.graph_path(), spec)
    assert g.wants_fp16(b.graph_path(variant="fp16"), spec)
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the cache folder should be: not writable as a folder
    monkeypatch.setenv("CLOSEDLOOP_TRT_CACHE", str(tmp_path / "cache"))
    opts = dict(g.OrtTrtBackend._provider_list(BackendOptions(cache_dir=str(blocked / "x")), fp16=False)[0][1])
    assert opts["trt_fp16_enable"] is False and opts["trt_engine_cache_enable"] is True
    assert opts["trt_engine_cache_path"] == str(tmp_path / "cache")


def _working(name: str):
    a = GPU[name].availability()
    if not a:
        pytest.skip(f"{name} does not run here: {a.reason}")


@pytest.mark.parametrize("name", sorted(GPU))
def test_gpu_provider_matches_the_cpu_over_a_rollout_and_meets_the_deadline(name, gru_bundle):
    _working(name)
    xs = np.random.default_rng(0).standard_normal((50, 12)).astype(np.float32)
    outs = {}
    for backend in ("onnxruntime", name):
        m = Model(gru_bundle, backend=backend, variant="fp32")
        outs[backend] = np.stack([m.step(x[None]).copy()[0] for x in xs])
        m.close()
    # fp32 on both (TF32 and TensorRT FP16 are off): the backends' parity tolerance, 1e-4
    np.testing.assert_allclose(outs[name], outs["onnxruntime"], atol=1e-4, rtol=0)
    b = load_bundle(gru_bundle)
    backend, _ = create_backend(name, b.graph_path(), b.graph())
    p99_us = float(np.percentile(time_backend(backend, steps=200), 99)) / 1e3
    backend.close()
    assert p99_us < 1e6 / b.manifest.rate_hz, f"{name} p99 {p99_us:.0f} us misses the {b.manifest.rate_hz} Hz deadline"


def test_a_provider_that_loads_but_leaves_nodes_on_the_cpu_is_refused_naming_them(gru_bundle):
    # ORT's Azure provider is in the CPU build and loads, but takes no node of a local graph: every node
    # lands on the CPU, as a CUDA build's would for ops it has no kernel for.
    if "AzureExecutionProvider" not in ort.get_available_providers():
        pytest.skip("this onnxruntime build has no AzureExecutionProvider to stand for a provider that takes no nodes")

    class Leaves(g._OrtGpuBackend):
        name = "test-leaves-nodes"
        provider = "AzureExecutionProvider"

        @classmethod
        def _provider_list(cls, options, fp16):
            return [cls.provider, "CPUExecutionProvider"]

    b = load_bundle(gru_bundle)
    with pytest.raises(BackendUnavailableError, match=r"nodes on the CPU under AzureExecutionProvider: .*\(GRU\)"):
        Leaves(b.graph_path(), b.graph())


def test_doctor_warns_when_a_listed_gpu_provider_does_not_load(monkeypatch, fresh_probe):
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime build really has the CUDA provider")
    from closedloop.runtime import doctor

    real = ort.get_available_providers
    monkeypatch.setattr(ort, "get_available_providers", lambda: [*real(), "CUDAExecutionProvider"])
    r = doctor._ort(doctor.DoctorConfig())
    assert r.status == doctor.WARN
    assert "backend ort-cuda is unavailable" in r.message and "fell back entirely" in r.message, r.message
    assert "ort-cuda" in r.data["backends"] and "cuDNN" in r.fix
