"""The observer bundle's certificate re-checked at load, the observer family and its Numba kernel."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from closedloop.firmware_bridge import PlantMeasurement
from closedloop.runtime.bundle import load_bundle, sha256_file
from closedloop.runtime.errors import BundleError
from closedloop.runtime.families import get_family
from closedloop.runtime.families.observer.certificate import certify_bundle, check_bundle_certificate
from closedloop.runtime.integrity import seal_manifest
from closedloop.runtime.model import Model


@pytest.fixture(scope="module")
def observer_setup(tmp_path_factory):
    import torch

    from closedloop.sdk.observer.certify import certify
    from closedloop.sdk.observer.neural import NeuralObserver, ObserverModel, export_observer_bundle
    from closedloop.sdk.observer.systems import observer_system
    from closedloop.sdk.observer.train import TrainConfig, _initial_net

    model = ObserverModel.from_system(observer_system("flexible-joint"))
    torch.manual_seed(0)
    net = _initial_net(model, TrainConfig(hidden=(6, 6), init_gain=0.1)).scale_(0.5)
    report = certify(model, net, rho=0.999, local_vbar=None, coverage_eps=0.05, coverage_beta=1e-2)
    assert report.certified
    obs = NeuralObserver(model, net)
    path = export_observer_bundle(obs, report, tmp_path_factory.mktemp("obs") / "fj", report=lambda s: None)
    return model, net, obs, report, path


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rehash(bundle: Path, manifest_edit=None) -> None:
    """Rewrite the manifest's checksums (and optionally edit it): tampering that the SHA-256 check misses."""
    mpath = bundle / "manifest.json"
    m = json.loads(mpath.read_text())
    if manifest_edit:
        manifest_edit(m)
    for rel in m["files"]:
        m["files"][rel]["sha256"] = sha256_file(bundle / rel)
    mpath.write_text(json.dumps(seal_manifest(m)))


def _scale_weights(bundle: Path, weights: list[np.ndarray], factor: float) -> None:
    """Scale every stored weight in the ONNX file's raw bytes (no onnx package needed)."""
    onnx = bundle / "main.onnx"
    data = onnx.read_bytes()
    for w in weights:
        for cand in (w, w.T):
            raw = np.ascontiguousarray(cand, dtype=np.float32).tobytes()
            if raw in data:
                data = data.replace(raw, (np.ascontiguousarray(cand, dtype=np.float32) * np.float32(factor)).tobytes())
                break
        else:
            raise AssertionError("weight bytes not found in the ONNX file")
    onnx.write_bytes(data)


def test_bundle_loads_and_the_certificate_passes_from_its_own_weights(observer_setup):
    model, net, obs, report, path = observer_setup
    bundle = load_bundle(path)
    assert bundle.manifest.family == "observer"
    result = check_bundle_certificate(bundle)
    assert result.passed and result.fingerprint_ok
    assert result.check.max_eig == pytest.approx(report.max_eig, abs=1e-12)
    text = certify_bundle(path)
    assert "PASS" in text and "decay rate rho" in text and "weights             match" in text


@pytest.mark.parametrize("edit, said", [
    (lambda m: m.update(rate_hz=m["rate_hz"] / 2), "discretised at dt = 0.001 s (1000 Hz); export it at rate_hz = 1/dt"),
    (lambda m: m["extra"]["observer"].update(dt=0.002), "the bundle runs at 1000 Hz but its matrices are discretised"),
    (lambda m: m["certificate"].update(dt=0.002), "the certificate holds at dt = 0.002 s but the observer is"),
])
def test_a_bundle_whose_rate_dt_and_certificate_disagree_is_refused(observer_setup, tmp_path, edit, said):
    """The matrices are discretised at dt, the certificate holds at its dt, the session runs at the rate: the
    estimate would step by the wrong time, outside what the certificate covers."""
    _, _, _, _, path = observer_setup
    bad = _copy(path, tmp_path / "dt")
    _rehash(bad, edit)
    with pytest.raises(BundleError, match=said.replace("(", r"\(").replace(")", r"\)")):
        load_bundle(bad)


def test_tampered_weights_are_refused_naming_the_margin(observer_setup, tmp_path):
    _, net, _, _, path = observer_setup
    bad = _copy(path, tmp_path / "bad")
    _scale_weights(bad, net.weights(), 8.0)
    _rehash(bad)
    with pytest.raises(BundleError) as err:
        load_bundle(bad)
    msg = str(err.value)
    assert "LMI violated" in msg and "margin 0.0001 violated by" in msg
    assert "weights differ from the certified ones" in msg
    assert "FAIL" in certify_bundle(bad)


def test_a_slightly_changed_network_is_refused_by_its_fingerprint(observer_setup, tmp_path):
    _, net, _, _, path = observer_setup
    bad = _copy(path, tmp_path / "tweaked")
    _scale_weights(bad, net.weights(), 1.001)
    _rehash(bad)
    with pytest.raises(BundleError, match="weights differ from the certified ones"):
        load_bundle(bad)


@pytest.mark.parametrize("edit, expected", [
    (lambda m: m["certificate"].update(P=(-np.asarray(m["certificate"]["P"])).tolist()), "not positive definite"),
    (lambda m: m["certificate"].update(rho=0.9), "LMI violated"),
    (lambda m: m["extra"]["observer"].update(L=(np.asarray(m["extra"]["observer"]["L"]) * 3).tolist()), "LMI violated"),
    (lambda m: m.update(certificate=None), "certificate is missing"),
])
def test_a_changed_certificate_or_model_is_refused(observer_setup, tmp_path, edit, expected):
    bad = _copy(observer_setup[4], tmp_path / "edited")
    _rehash(bad, edit)
    with pytest.raises(BundleError, match=expected):
        load_bundle(bad)


def _unchecked(path: Path):
    """The bundle as it stands, read without the checks (to see what a forger would compute)."""
    from closedloop.runtime.bundle import Bundle, _read_manifest

    return Bundle(root=path, manifest=_read_manifest(path, path), source=path)


def test_a_forged_margin_is_refused_naming_both_values(observer_setup, tmp_path):
    """Issue 24, defect 5: with ``margin = -10`` a network whose LMI has a positive largest eigenvalue passed, because
    the check was ``max_eig <= -margin``. The forger here also keeps the fingerprint and ``max_eig`` consistent."""
    from closedloop.runtime.families.observer.certificate import mlp_from_onnx, weights_fingerprint

    _, net, _, _, path = observer_setup
    bad = _copy(path, tmp_path / "forged")
    _scale_weights(bad, net.weights(), 8.0)
    _rehash(bad)
    weights = mlp_from_onnx(_unchecked(bad).onnx()).weights
    max_eig = check_bundle_certificate(_unchecked(bad)).check.max_eig
    assert 0 < max_eig < 10  # not certified: M has a positive eigenvalue

    def forge(m):
        m["certificate"].update(margin=-10.0, max_eig=max_eig, weights_sha256=weights_fingerprint(weights))

    _rehash(bad, forge)
    with pytest.raises(BundleError) as err:
        load_bundle(bad)
    msg = str(err.value)
    assert "certificate margin -10 is not positive" in msg and f"largest eigenvalue {max_eig:.6g}" in msg
    assert f"a margin of {-max_eig:.6g}" in msg
    text = certify_bundle(bad)  # closedloop certify: it printed PASS
    assert "result              FAIL" in text and "margin -10 is not positive" in text


def test_a_stored_largest_eigenvalue_the_weights_do_not_give_is_refused(observer_setup, tmp_path):
    _, _, _, report, path = observer_setup
    bad = _copy(path, tmp_path / "claimed")
    _rehash(bad, lambda m: m["certificate"].update(max_eig=-0.5))
    with pytest.raises(BundleError) as err:
        load_bundle(bad)
    assert f"certificate.max_eig is -0.5, but the LMI rebuilt from the bundle's network and its observer matrices (extra.observer: Ad, Cd, L, Fd, the nonlinearity) has largest eigenvalue " \
           f"{report.max_eig:.6g}" in str(err.value)


def test_numba_observer_step_equals_the_numpy_reference(observer_setup):
    model, net, obs, _, path = observer_setup
    bundle = load_bundle(path)
    fam = get_family("observer")(bundle, Model(bundle, backend="onnxruntime"))
    rng = np.random.default_rng(0)
    obs.reset(np.zeros(5))
    fam.reset()
    for _ in range(300):
        y, u = rng.normal(size=1) * 0.3, rng.normal(size=1)
        want = obs.update(y, u)
        got = fam.step(y, u)
        assert np.allclose(got, want, rtol=1e-10, atol=1e-10)
        assert np.allclose(fam.u_cmd, obs.command(), rtol=1e-10, atol=1e-10)
    # through the session hooks: message in, network output recorded, clipped command out
    fam.reset()
    obs.reset(np.zeros(5))
    msg = PlantMeasurement(np.array([0.4], dtype=np.float32), np.array([1.0], dtype=np.float32))
    fam.on_message(msg)
    fam.model.run()
    cmd = fam.postprocess()
    want = obs.update(msg.y.astype(float), msg.u.astype(float))
    assert np.allclose(fam.z_hat, want, atol=1e-9)
    assert np.allclose(cmd, np.clip(-model.K @ want, -5, 5), atol=1e-5)
    r = fam.r.copy()
    assert np.allclose(fam.model._y.reshape(-1), obs.correction(r), atol=1e-5)
    # every measurement in order (the estimate steps dt per measurement), one command a step from the newest
    assert fam.consume == "all" and not fam.command_each_frame and fam.command_limits()[1][0] == pytest.approx(5.0)
    # a device that does not report what it applied (nu = 0): the last command sent is taken as applied, not the
    # last computed (a step catching up computes one per measurement and sends the newest)
    fam.on_command_sent(cmd)
    fam.on_message(PlantMeasurement(np.array([0.2], dtype=np.float32), np.array([1.0], dtype=np.float32)))
    obs.update(np.array([0.2]), np.array([1.0]))  # computed, not sent
    second = PlantMeasurement(np.array([0.1], dtype=np.float32), np.zeros(0, dtype=np.float32))
    fam.on_message(second)
    want = obs.update(second.y.astype(float), cmd.astype(float))
    assert np.allclose(fam.z_hat, want, atol=1e-6)
    with pytest.raises(ValueError, match=r"carries 1 outputs \(y\) and 2 applied inputs \(u\); this observer takes 1 "
                                         r"outputs and 1 applied inputs, or none \(nu = 0"):
        fam.on_message(PlantMeasurement(np.array([0.1], dtype=np.float32), np.zeros(2, dtype=np.float32)))


def test_certificate_module_needs_neither_torch_nor_cvxpy():
    code = ("import sys, closedloop.runtime.families.observer.certificate, closedloop.runtime.families.observer; "
            "bad = [m for m in ('torch', 'cvxpy', 'scipy') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


@pytest.mark.parametrize("plant", ["van-der-pol", "x29-nd-pa-lon", "cartpole"])
def test_kernel_nonlinearities_match_the_reference(plant):
    """Each runtime nonlinearity (output-scaled, none) in the kernel against the numpy observer."""
    import torch

    from closedloop.runtime.families.observer.plugin import ObserverArrays, _kernel, pack_network
    from closedloop.sdk.observer.neural import NeuralObserver, ObserverModel
    from closedloop.sdk.observer.systems import observer_system
    from closedloop.sdk.observer.train import TrainConfig, _initial_net

    model = ObserverModel.from_system(observer_system(plant))
    torch.manual_seed(1)
    net = _initial_net(model, TrainConfig(hidden=(5, 4), activation="relu" if plant == "cartpole" else "tanh"))
    obs = NeuralObserver(model, net)
    a = ObserverArrays(model.manifest_block())
    w, dims, acts = pack_network(net.weights(), list(net.activations))
    buf_a, buf_b = np.zeros(dims.max()), np.zeros(dims.max())
    z, r, f, zn, ucmd = np.zeros(a.nz), np.zeros(a.ny), np.zeros(a.Fd.shape[1]), np.zeros(a.nz), np.zeros(a.nu)
    rng = np.random.default_rng(2)
    obs.reset(z)
    for _ in range(100):
        y, u = rng.normal(size=a.ny), rng.normal(size=a.nu)
        _kernel()(z, y, u, a.Ad, a.Bd, a.Cd, a.L, a.Fd, a.nl_code, a.nl_E, a.nl_H, a.nl_index, a.nl_a, a.nl_b,
                  w, dims, acts, buf_a, buf_b, r, f, zn, a.K, a.u_low, a.u_high, ucmd)
        want = obs.update(y, u)
        assert np.allclose(z, want, rtol=1e-9, atol=1e-9 * (1 + np.abs(want).max()))
        assert np.allclose(ucmd, obs.command(), rtol=1e-9, atol=1e-6)


def test_certify_of_a_bundle_that_does_not_verify_ends_refused_and_exits_2(observer_setup, tmp_path, capsys):
    """The certificate may hold for the weights while a file of the bundle changed: the report's last line says the
    bundle is refused, and the command fails with exit 2 (a bundle that does not verify is bad input, docs/cli.md),
    so a script reading either is not told PASS; --json gives the verdicts as fields."""
    from closedloop.sdk.cli import main

    _, _, _, _, path = observer_setup
    bad = _copy(path, tmp_path / "changed")
    size = (bad / "main.onnx").stat().st_size
    _rehash(bad, lambda m: m["files"]["main.onnx"].update(bytes=size + 1))  # the graph as certified, its size not
    assert (bad / "main.onnx").stat().st_size == size
    text = certify_bundle(bad)
    assert "result              PASS" in text and text.rstrip().splitlines()[-1].strip().startswith("bundle")
    assert "REFUSED" in text.rstrip().splitlines()[-1]
    assert main(["certify", str(bad), "--json"]) == 2
    import json

    rec = json.loads(capsys.readouterr().out)
    assert rec["passed"] is False and rec["certificate_holds"] is True and rec["bundle_verifies"] is False
    assert rec["rho"] > 0 and rec["max_eig"] <= -rec["margin"] and rec["fingerprint_ok"] is True
    assert rec["bundle_problems"] and rec["report"].rstrip().endswith("it does not verify (above), whatever its "
                                                                       "certificate says")
    assert main(["certify", str(path), "--json"]) == 0 and json.loads(capsys.readouterr().out)["passed"] is True
    # a model file changed in place (its bytes, not only the size the manifest states): the weights the check reads
    # are not the bundle's, so whatever the certificate check gives there, the exit is 2, not 1
    flipped = _copy(path, tmp_path / "flipped")
    data = bytearray((flipped / "main.onnx").read_bytes())
    data[-20] ^= 0xFF
    (flipped / "main.onnx").write_bytes(bytes(data))
    assert main(["certify", str(flipped), "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["bundle_verifies"] is False


def test_certify_of_a_bundle_of_another_family_is_bad_input(tmp_path, capsys):
    import torch

    from closedloop.export import export_bundle
    from closedloop.sdk.cli import main
    from closedloop.sdk.models import MLPPolicy

    other = export_bundle(MLPPolicy(1, 1, (4,)).eval(), tmp_path / "plain", kind="feedforward",
                          example_input=torch.zeros(1, 1), rate_hz=50.0, variants=(), tensorrt=False,
                          report=lambda s: None)
    assert main(["certify", str(other), "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "is a 'generic' bundle: certify re-checks an observer bundle" in err
