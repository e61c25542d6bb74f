"""closedloop package: a folder that installs offline on a board and runs a session there.

The host-target package is built with --from-installed (wheels rebuilt from this venv, no
network), installed with its own install.sh into a fresh venv from wheelhouse/ alone, and
that venv's closedloop inspects the bundle and runs a 1 s session against sim://. The
install is --ort-only (no Numba: compiling Numba's kernels in a fresh venv takes minutes on
this VM; bench/bench_package.py times the full install and its warmed first start). The
targets' constraints are resolved against the index for their platform where it can be reached.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from closedloop.sdk.cli import main
from closedloop.sdk.package import PackageError, PackageOptions, get_target, package, target_names
from closedloop.sdk.package.wheels import check_tags, wheel_requirements

DEVICE = "sim://headstage?channels=12&seed=2"
_no_raise = contextlib.nullcontext


@pytest.fixture(scope="module")
def decoder(tmp_path_factory) -> Path:
    torch = pytest.importorskip("torch")
    from closedloop.export import export_bundle
    from closedloop.sdk.models import GRUDecoder

    torch.manual_seed(0)
    return export_bundle(
        GRUDecoder(12, 16, 1, 5).eval(), tmp_path_factory.mktemp("bundle") / "decoder", kind="recurrent",
        example_input=torch.zeros(1, 12), rate_hz=50.0,
        extra={"session": {"input": "neural_frame", "command": "decoder_output"}},
        variants=(), tensorrt=False, report=lambda s: None,
    )


@pytest.fixture(scope="module")
def installed(decoder, tmp_path_factory):
    """The --ort-only host package, installed by its install.sh into a fresh venv, offline."""
    root = tmp_path_factory.mktemp("pkg")
    prefix, out = root / "opt", root / "out"
    code = main(["package", str(decoder), "--target", "host", "--out", str(out), "--from-installed", "--ort-only",
                 "--prefix", str(prefix), "--device", DEVICE, "--cpu", "0"])
    assert code == 0
    env = {"PATH": "/usr/bin:/bin", "HOME": str(root), "CLOSEDLOOP_PREFIX": str(prefix), "PYTHON": sys.executable,
           "NUMBA_CACHE_DIR": str(root / "cache"), "PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull}
    r = subprocess.run([str(out / "install.sh")], capture_output=True, text=True, timeout=300, env=env, cwd=root)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return out, prefix, r.stdout + r.stderr


def _venv_run(prefix: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(prefix / "venv" / "bin" / "closedloop"), *args], capture_output=True, text=True,
                          timeout=120, cwd="/", env={"PATH": "/usr/bin:/bin", "HOME": str(prefix)})


def test_the_package_folder_holds_what_a_board_needs(installed):
    out, prefix, _log = installed
    names = {p.name for p in out.iterdir()}
    assert {"bundles", "wheelhouse", "constraints.txt", "install.sh", "closedloop.service", "README.md",
            "manifest.json", "requirements.lock", "SHA256SUMS"} <= names
    # every wheel pinned with its own sha256 (what pip --require-hashes checks on the board)
    lock = (out / "requirements.lock").read_text()
    for w in json.loads((out / "manifest.json").read_text())["wheels"]:
        assert f"--hash=sha256:{w['sha256']}" in lock
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["target"] == "host" and manifest["ort_only"] is True
    wheels = {w["file"].split("-")[0].lower() for w in manifest["wheels"]}
    assert {"closedloop", "numpy", "onnxruntime", "pyserial", "cryptography"} <= wheels
    assert not wheels & {"numba", "llvmlite"}  # --ort-only: the smallest install
    for w in manifest["wheels"]:
        assert len(w["sha256"]) == 64 and (out / "wheelhouse" / w["file"]).stat().st_size == w["bytes"]
    assert manifest["footprint"]["installed_bytes"] >= manifest["footprint"]["wheelhouse_bytes"] > 0
    unit = (out / "closedloop.service").read_text()
    assert "\nCPUSchedulingPolicy=" not in unit  # --rt puts the loop's thread alone under SCHED_FIFO
    for line in ("LimitRTPRIO=80", "LimitMEMLOCK=infinity", "CPUAffinity=0",
                 "Environment=NUMBA_CACHE_DIR=/var/cache/closedloop",
                 "Environment=CLOSEDLOOP_CACHE_DIR=/var/cache/closedloop", "Restart=on-failure",
                 "SupplementaryGroups=dialout", "StartLimitIntervalSec=0"):
        assert line in unit, line
    # a session a safety rule stopped (exit 1: docs/cli.md) is not started again by systemd: a person looks first
    assert "\nRestartPreventExitStatus=1\n" in unit
    assert f"ExecStart={prefix}/venv/bin/closedloop run {prefix}/bundles/decoder --device {DEVICE} --rt" in unit
    # which closedloop the wheel holds, and a README whose commands run as written (the bundle's own emulator)
    assert manifest["closedloop"]["version"] and manifest["closedloop"]["source"] in ("checkout", "installed")
    if manifest["closedloop"]["source"] == "checkout":
        assert len(manifest["closedloop"]["git_commit"] or "") == 40 and manifest["closedloop"]["dirty"] in (True, False)
    readme = (out / "README.md").read_text()
    assert "{" not in readme and "--device 'sim://headstage?channels=12&rate=50'" in readme
    assert "NUMBA_CACHE_DIR=/var/cache/closedloop CLOSEDLOOP_CACHE_DIR=/var/cache/closedloop" in readme


def test_packaging_again_gives_the_same_bytes(decoder, installed, tmp_path):
    """The same checkout, bundles and options pack the same files (no clock in the wheels' zip members), so the
    digest of SHA256SUMS identifies a package: a lab can build it again to check what a board holds."""
    out, prefix, _log = installed
    again = tmp_path / "again"
    assert main(["package", str(decoder), "--target", "host", "--out", str(again), "--from-installed", "--ort-only",
                 "--prefix", str(prefix), "--device", DEVICE, "--cpu", "0"]) == 0
    assert (again / "SHA256SUMS").read_text() == (out / "SHA256SUMS").read_text()


def test_the_install_builds_the_c_frame_scanner_where_the_service_looks(installed):
    # the service's first session against a device must neither compile it nor fall back to the Python parser
    out, prefix, log = installed
    assert "C scanner library: built" in log, log[-2000:]
    assert list((prefix.parent / "cache").glob("libclosedloop_scan-*.so")), log[-2000:]


def test_the_offline_install_inspects_and_runs_a_session(installed):
    out, prefix, _log = installed
    bundle = prefix / "bundles" / "decoder"
    r = _venv_run(prefix, "inspect", str(bundle), "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["problems"] == [] and "main" in report["manifest"]["graphs"]
    r = _venv_run(prefix, "run", str(bundle), "--device", DEVICE, "--duration", "1", "--quiet", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout)
    assert summary["backend"] == "onnxruntime" and summary["commands_sent"] > 10
    # the fresh venv is the package's alone: closedloop from wheelhouse/, not this checkout, and no Numba
    r = subprocess.run([str(prefix / "venv" / "bin" / "python"), "-c",
                        "import closedloop, importlib.util as u; print(closedloop.__file__, u.find_spec('numba'))"],
                       capture_output=True, text=True, timeout=60, cwd="/", env={"PATH": "/usr/bin:/bin"})
    where, numba = r.stdout.split()
    assert where.startswith(str(prefix)) and numba == "None"


def test_the_unit_verifies(installed):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed here: the unit's syntax is not checked")
    out, _prefix, _log = installed
    r = subprocess.run(["systemd-analyze", "verify", str(out / "closedloop.service")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_install_sh_refuses_a_package_changed_since_it_was_built(installed, tmp_path):
    """A wheel or a bundle file changed after packaging (a tampered wheel's code would run on the board): install.sh
    checks SHA256SUMS first and installs nothing."""
    out, _prefix, _log = installed
    for victim in ("wheelhouse", "bundles"):
        copy = tmp_path / victim
        shutil.copytree(out, copy)
        target = next(p for p in sorted((copy / victim).rglob("*")) if p.is_file())
        target.write_bytes(target.read_bytes() + b"\0")
        r = subprocess.run([str(copy / "install.sh")], capture_output=True, text=True, timeout=60,
                           env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable,
                                "CLOSEDLOOP_PREFIX": str(tmp_path / f"p-{victim}")})
        assert r.returncode == 2 and "do not match SHA256SUMS" in r.stderr, r.stdout + r.stderr
        assert target.name in r.stdout + r.stderr and not (tmp_path / f"p-{victim}").exists()


def _resum(folder: Path) -> None:
    """Write ``folder``'s SHA256SUMS again for what it holds now (a package changed and re-summed consistently)."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name not in ("SHA256SUMS", "SHA256SUMS.sig"))
    (folder / "SHA256SUMS").write_text("".join(
        f"{hashlib.sha256(p.read_bytes()).hexdigest()}  ./{p.relative_to(folder).as_posix()}\n" for p in files))


def test_install_sh_refuses_a_file_added_to_the_package(installed, tmp_path):
    """A public key dropped into trust/ (or any file SHA256SUMS does not list) would be installed, and a key
    trusted: install.sh refuses a package holding a file it was not built with, naming it, and installs nothing."""
    out, _prefix, _log = installed
    copy = tmp_path / "pkg"
    shutil.copytree(out, copy)
    (copy / "trust").mkdir(exist_ok=True)
    (copy / "trust" / "zz-other.pub").write_text("-----BEGIN PUBLIC KEY-----\n")
    r = subprocess.run([str(copy / "install.sh")], capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "CLOSEDLOOP_PREFIX": str(tmp_path / "p")})
    assert r.returncode == 2 and "files that SHA256SUMS does not list" in r.stderr, r.stdout + r.stderr
    assert "./trust/zz-other.pub" in r.stderr and not (tmp_path / "p").exists()


def test_a_failed_reinstall_leaves_the_install_it_replaced(installed, tmp_path):
    """A newer package whose bundle does not verify (changed, its SHA256SUMS written again): install.sh makes the
    new venv, finds the bundle bad and puts back what the prefix held, which still runs; no traceback."""
    out, prefix, _log = installed
    before = {p.relative_to(prefix): p.read_bytes() for p in (prefix / "bundles").rglob("*") if p.is_file()}
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    manifest = bad / "bundles" / "decoder" / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"rate_hz": 50.0', '"rate_hz": 100.0'))
    _resum(bad)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "CLOSEDLOOP_PREFIX": str(prefix), "PYTHON": sys.executable,
           "NUMBA_CACHE_DIR": str(prefix.parent / "cache"), "PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull}
    r = subprocess.run([str(bad / "install.sh")], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "does not verify" in r.stderr or "changed" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and f"{prefix} holds what it held before" in r.stderr
    after = {p.relative_to(prefix): p.read_bytes() for p in (prefix / "bundles").rglob("*") if p.is_file()}
    assert after == before and not (prefix / ".replaced").exists()
    r = _venv_run(prefix, "inspect", str(prefix / "bundles" / "decoder"), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["problems"] == [], r.stderr


def test_service_options_that_would_break_the_unit_are_refused(decoder, tmp_path, capsys):
    """A device with a space became extra arguments of the service's command (it ran 1 s and exited 0); a relative
    prefix, a negative CPU, a user name with a space, an unknown emulator model and a private key given as a
    trusted key are each refused before anything is built, saying what to give."""
    base = ["package", str(decoder), "--target", "host", "--out", str(tmp_path / "o"), "--from-installed",
            "--ort-only"]
    for extra, said in ((["--device", "/dev/ttyACM0 --duration 1"], "without spaces or quotes"),
                        (["--device", "ttyACM0"], "absolute path"),
                        (["--device", "sim://plant?model=nosuch"], "--device sim://plant?model=nosuch"),
                        (["--device", "sim://nothing"], "no device emulator named 'nothing'"),
                        (["--device", "bogus://x"], "no transport for scheme 'bogus'"),
                        (["--prefix", "relative/dir"], "absolute folder"),
                        (["--cpu", "-1"], "--cpu -1"),
                        (["--cpu", str((os.cpu_count() or 1) + 3)], "this machine's"),
                        (["--user", "bad user"], "plain user name"),
                        (["--overrun", "never"], "invalid choice")):
        with pytest.raises(SystemExit) if extra[0] == "--overrun" else _no_raise():
            assert main(base + extra) == 2, extra
        assert said in capsys.readouterr().err, extra
        assert not (tmp_path / "o").exists()
    from closedloop.runtime.signing import generate_key_pair

    key, _pub, _ = generate_key_pair(tmp_path / "lab")
    assert main(base + ["--trust", str(key)]) == 2
    err = capsys.readouterr().err
    assert "--trust" in err and "is a private key" in err and "does not verify" not in err, err


def test_the_services_safety_options_and_device_url_reach_its_command(decoder, installed, tmp_path):
    out, prefix = tmp_path / "o", installed[1]  # an installed prefix: systemd-analyze checks the command exists
    assert main(["package", str(decoder), "--target", "host", "--out", str(out), "--from-installed", "--ort-only",
                 "--prefix", str(prefix), "--device", "sim://headstage?channels=12&rate=50&seed=1", "--cpu", "0",
                 "--overrun", "stop",
                 "--watchdog-limit", "2"]) == 0
    line = next(x for x in (out / "closedloop.service").read_text().splitlines() if x.startswith("ExecStart="))
    assert line.endswith(" --overrun stop --watchdog-limit 2.0") and "--device sim://headstage?channels=12&rate=50&seed=1 " in line
    if shutil.which("systemd-analyze"):
        r = subprocess.run(["systemd-analyze", "verify", str(out / "closedloop.service")], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr


def test_a_package_with_trust_verifies_each_signature_and_its_service_checks_them(decoder, tmp_path, capsys):
    from closedloop.runtime.signing import generate_key_pair, sign_bundle

    key, pub, _ = generate_key_pair(tmp_path / "lab")
    signed = tmp_path / "signed"
    shutil.copytree(decoder, signed)
    sign_bundle(signed, key)
    out, prefix = tmp_path / "pkg", "/opt/cl"
    assert main(["package", str(signed), "--target", "host", "--out", str(out), "--from-installed", "--ort-only",
                 "--prefix", prefix, "--trust", str(pub)]) == 0
    err = capsys.readouterr().err
    assert "each signed by one of the 1 trusted keys" in err and "SHA256SUMS sha256 " in err
    assert (out / "trust" / pub.name).read_bytes() == pub.read_bytes()
    assert f"--trust {prefix}/trust" in (out / "closedloop.service").read_text()
    assert 'cp "$HERE"/trust/*.pub "$PREFIX/trust/"' in (out / "install.sh").read_text()
    assert json.loads((out / "manifest.json").read_text())["trusted_keys"] == [pub.name]
    # an unsigned bundle, or one whose signature no longer holds, is not packaged for a board that trusts keys
    other_key, other_pub, _ = generate_key_pair(tmp_path / "other")
    assert main(["package", str(decoder), "--target", "host", "--out", str(tmp_path / "x"), "--from-installed",
                 "--ort-only", "--trust", str(pub)]) == 2
    assert "does not verify" in capsys.readouterr().err and not (tmp_path / "x").exists()
    assert main(["package", str(signed), "--target", "host", "--out", str(tmp_path / "y"), "--from-installed",
                 "--ort-only", "--trust", str(other_pub)]) == 2
    # a key file named otherwise travels as NAME.pub: the board reads trust/*.pub
    pem = tmp_path / "lab-key.pem"
    shutil.copy(pub, pem)
    assert main(["package", str(signed), "--target", "host", "--out", str(tmp_path / "w"), "--from-installed",
                 "--ort-only", "--trust", str(pem)]) == 0
    assert (tmp_path / "w" / "trust" / "lab-key.pub").read_bytes() == pub.read_bytes()
    capsys.readouterr()
    # without --trust the package says plainly that nothing will check signatures
    assert main(["package", str(signed), "--target", "host", "--out", str(tmp_path / "z"), "--from-installed",
                 "--ort-only"]) == 0
    assert "signatures not checked" in capsys.readouterr().err
    assert "--trust" not in (tmp_path / "z" / "closedloop.service").read_text()
    assert "Signatures: none checked" in (tmp_path / "z" / "README.md").read_text()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="install.sh checks a package's signature with openssl")
def test_a_board_that_trusts_keys_installs_only_a_package_one_of_them_signed(decoder, tmp_path, capsys):
    """--sign KEY signs SHA256SUMS; install.sh on a board whose install trusts keys (PREFIX/trust) refuses a package
    not signed, or signed by another key, or whose SHA256SUMS changed after signing, and goes on with one its key
    signed. A board with no key yet says the signature was not checked."""
    from closedloop.runtime.signing import generate_key_pair, sign_bundle

    key, pub, kid = generate_key_pair(tmp_path / "lab")
    other_key, _other_pub, _ = generate_key_pair(tmp_path / "other")
    signed = tmp_path / "signed"
    shutil.copytree(decoder, signed)
    sign_bundle(signed, key)
    base = ["package", str(signed), "--target", "host", "--from-installed", "--ort-only", "--cpu", "0", "--trust",
            str(pub)]
    assert main(base + ["--out", str(tmp_path / "good"), "--sign", str(key)]) == 0
    err = capsys.readouterr().err
    assert f"SHA256SUMS signed with key {kid} (trust/lab.pub" in err
    from closedloop.runtime.signing import read_private_key

    shutil.copytree(tmp_path / "good", tmp_path / "unsigned")
    (tmp_path / "unsigned" / "SHA256SUMS.sig").unlink()  # the same package without --sign
    keyless = tmp_path / "keyless"  # signed by the lab's key, but built without --trust
    shutil.copytree(tmp_path / "good", keyless)
    shutil.rmtree(keyless / "trust")
    _resum(keyless)
    (keyless / "SHA256SUMS.sig").write_bytes(read_private_key(key).sign((keyless / "SHA256SUMS").read_bytes()))
    assert main(base + ["--out", str(tmp_path / "theirs"), "--sign", str(other_key)]) == 0
    assert "its public key is not among --trust" in capsys.readouterr().err
    assert main(base + ["--out", str(tmp_path / "x"), "--sign", str(pub)]) == 2  # a public key cannot sign
    assert "--sign" in capsys.readouterr().err
    changed = tmp_path / "changed"
    shutil.copytree(tmp_path / "good", changed)
    (changed / "README.md").write_text("changed\n")
    _resum(changed)  # SHA256SUMS written again: its signature no longer holds
    board = tmp_path / "board"
    (board / "trust").mkdir(parents=True)
    shutil.copy(pub, board / "trust" / "lab.pub")  # what an earlier install of a --trust package left
    fake = tmp_path / "python3"  # past the signature check, install.sh stops at the interpreter's version
    fake.write_text("#!/bin/sh\necho 2.7\n")
    fake.chmod(0o755)

    def install(pkg, prefix=board):
        return subprocess.run([str(tmp_path / pkg / "install.sh")], capture_output=True, text=True, timeout=60,
                              env={"PATH": "/usr/bin:/bin", "PYTHON": str(fake), "CLOSEDLOOP_PREFIX": str(prefix)})

    for pkg, said in (("unsigned", "this package is not signed"), ("theirs", "is not a signature"),
                      ("changed", "is not a signature"), ("keyless", "this package has none (built without --trust)")):
        r = install(pkg)
        assert r.returncode == 2 and said in r.stderr, (pkg, r.stdout + r.stderr)
    r = install("good")
    assert f"package signed by {board}/trust/lab.pub" in r.stdout and "this package is for Python" in r.stderr, r
    r = install("good", tmp_path / "new-board")
    assert "the signature is not checked" in r.stdout and "this package is for Python" in r.stderr, r


def test_install_sh_refuses_another_python(installed, tmp_path):
    out, _prefix, _log = installed
    fake = tmp_path / "python3"
    fake.write_text("#!/bin/sh\necho 2.7\n")
    fake.chmod(0o755)
    r = subprocess.run([str(out / "install.sh")], capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "PYTHON": str(fake), "CLOSEDLOOP_PREFIX": str(tmp_path / "p")})
    assert r.returncode == 2 and "this package is for Python" in r.stderr and not (tmp_path / "p").exists()


def test_install_sh_refuses_another_architecture(installed, tmp_path):
    out, _prefix, _log = installed
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "uname").write_text("#!/bin/sh\necho riscv64\n")
    (bin_ / "uname").chmod(0o755)
    r = subprocess.run(["/bin/sh", str(out / "install.sh")], capture_output=True, text=True, timeout=60,
                       env={"PATH": f"{bin_}:/usr/bin:/bin", "PYTHON": sys.executable,
                            "CLOSEDLOOP_PREFIX": str(tmp_path / "p")})
    assert r.returncode == 2 and "this machine is riscv64" in r.stderr and not (tmp_path / "p").exists()


def test_the_emulator_a_bundle_runs_against_as_it_is(decoder):
    from closedloop.sdk.package.build import emulator_url
    from closedloop.sim.devices import device_params

    url = emulator_url(decoder)
    assert url == "sim://headstage?channels=12&rate=50"
    from closedloop.firmware_bridge.transports import split_device_url

    _, name, raw = split_device_url(url)
    device_params(name, raw)  # parameters the emulator takes


def test_the_full_install_warms_numba_for_each_bundle(decoder, tmp_path, capsys):
    """The warm step install.sh runs: every graph on Numba, then a short session (here on this venv's cache)."""
    pytest.importorskip("numba")
    from closedloop.sdk.package.warm import main as warm_main

    assert warm_main([str(decoder)]) == 0
    assert f"warmed {decoder} on Numba" in capsys.readouterr().out


def test_refusals(decoder, tmp_path, capsys):
    with pytest.raises(PackageError, match="unknown target 'pi5'.*host, jetson-jp6"):
        get_target("pi5")
    assert main(["package", str(decoder), "--target", "pi5", "--out", str(tmp_path / "a")]) == 2
    assert "known targets are host, jetson-jp6" in capsys.readouterr().err
    broken = tmp_path / "broken"
    shutil.copytree(decoder, broken)
    graph = next(p for p in broken.iterdir() if p.suffix == ".onnx")
    graph.write_bytes(graph.read_bytes()[:-8])
    with pytest.raises(PackageError, match="does not verify"):
        package([str(broken)], tmp_path / "b", PackageOptions(target="host", from_installed=True))
    assert not (tmp_path / "b").exists() and not list(tmp_path.glob(".b.*"))  # a refusal leaves nothing to clear
    with pytest.raises(PackageError, match="--from-installed.*jetson-jp6"):
        package([str(decoder)], tmp_path / "c", PackageOptions(target="jetson-jp6", from_installed=True))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x").write_text("")
    with pytest.raises(PackageError, match="not empty"):
        package([str(decoder)], tmp_path / "d", PackageOptions(target="host", from_installed=True))


def test_a_wheel_without_a_build_for_the_target_is_named(tmp_path):
    jp6 = get_target("jetson-jp6")
    x86 = tmp_path / "numpy-2.2.6-cp310-cp310-manylinux_2_17_x86_64.whl"
    arm = tmp_path / "numpy-2.2.6-cp310-cp310-manylinux_2_17_aarch64.manylinux2014_aarch64.whl"
    check_tags([arm], jp6)
    with pytest.raises(PackageError, match="numpy 2.2.6 has no build for target jetson-jp6.*manylinux_2_17_x86_64"):
        check_tags([x86], jp6)
    too_new = tmp_path / "numba-0.68.1-cp311-cp311-manylinux_2_28_aarch64.whl"
    with pytest.raises(PackageError, match="numba 0.68.1.*cp310"):
        check_tags([too_new], jp6)


def test_ort_only_leaves_numba_out_and_extras_are_checked(installed):
    out, _prefix, _log = installed
    own = next((out / "wheelhouse").glob("closedloop-*.whl"))
    full = {r.split(">")[0].split("=")[0] for r in wheel_requirements(own, [], ort_only=False)}
    assert {"numpy", "numba", "onnxruntime", "pyserial", "cryptography"} <= full
    assert "numba" not in {r.split(">")[0] for r in wheel_requirements(own, [], ort_only=True)}
    assert any(r.startswith("aiohttp") for r in wheel_requirements(own, ["monitor"], ort_only=False))
    with pytest.raises(PackageError, match="unknown extra.*gpu.*monitor"):
        wheel_requirements(own, ["gpu"], ort_only=False)


def _index_reachable() -> bool:
    try:
        urllib.request.urlopen("https://pypi.org/simple/pyserial/", timeout=5).close()
        return True
    except OSError:
        return False


@pytest.mark.parametrize("name", target_names())
def test_each_targets_constraints_resolve(name, tmp_path):
    """The target's pins hold a wheel for its platform and Python for the runtime and its extras."""
    if not _index_reachable():
        pytest.skip("the PyPI index cannot be reached from here: the targets' constraints are not resolved")
    target = get_target(name)
    constraints = tmp_path / "c.txt"
    constraints.write_text(target.constraints_text())
    deps = ["numpy", "numba", "llvmlite", "onnxruntime", "pyserial", "cryptography", "aiohttp", "pylsl"]
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--only-binary=:all:",
           "--quiet", "--report", str(tmp_path / "r.json"), "-c", str(constraints), *target.pip_args()]
    if target.foreign:
        cmd += ["--target", str(tmp_path / "t")]
    r = subprocess.run(cmd + deps, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = {i["metadata"]["name"].lower() for i in json.loads((tmp_path / "r.json").read_text())["install"]}
    assert set(deps) <= got


def test_a_bundle_with_an_input_the_device_does_not_stream_is_packaged_only_with_its_value(tmp_path, capsys):
    """The service runs closedloop run with no way to give a goal: without --input it could never start (and
    systemd would restart it in a loop), so package refuses it; with it, the unit passes the value on."""
    torch = pytest.importorskip("torch")
    from closedloop.export import export_bundle

    class GoalPolicy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 1)

        def forward(self, obs, goal):
            return self.lin(torch.cat([obs, goal], dim=-1))

    torch.manual_seed(0)
    bundle = export_bundle(GoalPolicy().eval(), tmp_path / "goal", kind="feedforward",
                           example_input={"obs": torch.zeros(1, 1), "goal": torch.zeros(1, 1)}, rate_hz=200.0,
                           postprocess={"low": [-2.0], "high": [2.0]}, variants=(), tensorrt=False,
                           report=lambda s: None)
    base = ["package", str(bundle), "--target", "host", "--from-installed", "--ort-only"]
    assert main(base + ["--out", str(tmp_path / "a")]) == 2
    assert "holds input(s) ['goal'] that the device does not stream" in capsys.readouterr().err
    assert main(base + ["--out", str(tmp_path / "b"), "--input", "speed=1"]) == 2  # not one of its inputs
    assert "--input speed: not an input" in capsys.readouterr().err
    assert main(base + ["--out", str(tmp_path / "c"), "--input", "goal=0.5"]) == 0
    assert " --input goal=0.5" in (tmp_path / "c" / "closedloop.service").read_text()
