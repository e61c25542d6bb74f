"""The FALCON H2 adapter: bundles scored by falcon_challenge's own evaluator loop and metric.

Two tiny held-out sessions are written with ``closedloop.sdk.bci.nwb.write_falcon_h2_dir`` in the
DANDI layout (a calibration file with the first three trials, an evaluation file with
the last 40%). Each session gets its own bundle, normalised from its calibration file
only, and the evaluation files are decoded through ``FalconEvaluator.predict_files``
(the package's per-bin loop: ``reset`` per file, ``predict`` per bin, ``on_done`` at
each trial's last bin) and scored with ``FalconEvaluator.compute_metrics_edit_distance``.
The spike code and the decoder are built so that the decoder is perfect: CER and WER
must be exactly 0.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from closedloop.sdk.bci.deploy import export_bci_bundle
from closedloop.sdk.bci.falcon_decoder import FalconBundleDecoder
from closedloop.sdk.models import GRUDecoder
from closedloop.sim.handwriting import CHARSET, Session, Trial, falcon_splits

pytest.importorskip("falcon_challenge")
pytest.importorskip("pynwb")

ROOT = Path(__file__).resolve().parents[2]
N_CH = 192
SESSIONS = {
    "2023.04.17": ["he>was~", "an>ox,>a>cat?", "it's>me~", "the>fox~", "why>not?"],
    "2023.05.31": ["a>dog~", "no>way?", "yes,>sir~", "we>go~", "hi>there~"],
}


def _spikes_for(sentence: str, rng) -> np.ndarray:
    """A code a linear read-out decodes exactly: channel 1+i fires for character i, channel 0 for the blank."""
    rows = []
    for ch in sentence:
        rows += [1 + CHARSET.index(ch)] * 3 + [0] * 2
    counts = rng.poisson(0.1, (len(rows) + 4, N_CH))
    counts[:, :32] = 0  # background firing only on the channels the read-out ignores
    counts[np.arange(len(rows)) + 2, rows] += 15
    counts[:2, 0] += 15
    counts[-2:, 0] += 15
    return counts.astype(np.uint16)


def _session(day: str, sentences: list[str], rng) -> Session:
    calibration, evaluation = falcon_splits(len(sentences), held_out=True)
    trials = [Trial(_spikes_for(s, rng), s) for s in sentences]
    return Session(day, 0.0, "held_out", trials, calibration, evaluation)


class SkipDecoder(nn.Module):
    """A GRU decoder plus a strong direct path from channel k to output k (so it is exact on this code)."""

    def __init__(self):
        super().__init__()
        self.backbone = GRUDecoder(N_CH, 8, 1, 32)
        self.skip = nn.Linear(N_CH, 32, bias=False)
        with torch.no_grad():
            self.skip.weight.zero_()
            self.skip.weight[:, :32] = 20.0 * torch.eye(32)

    def init_state(self, batch: int = 1):
        return self.backbone.init_state(batch)

    def forward(self, seq, h=None):
        y, h = self.backbone.gru(seq, h)
        return torch.log_softmax(self.backbone.readout(y) + self.skip(seq), dim=-1), h

    def step(self, x, h):
        y, h = self.backbone.gru(x.unsqueeze(1), h)
        return torch.log_softmax(self.backbone.readout(y[:, 0]) + self.skip(x), dim=-1), h


@pytest.fixture(scope="module")
def falcon_files(tmp_path_factory):
    from closedloop.sdk.bci.nwb import write_falcon_h2_dir

    root = tmp_path_factory.mktemp("falcon_h2")
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    module = SkipDecoder().eval()
    sessions = [_session(day, sentences, rng) for day, sentences in SESSIONS.items()]
    paths = write_falcon_h2_dir(sessions, root / "data", layout="dandi")
    files, bundles = [], {}
    for s in sessions:
        key = s.name.replace(".", "")  # DANDI names carry the day as ses-YYYYMMDD
        calib = np.concatenate([s.trials[i].spikes for i in s.calibration]).astype(np.float64)
        std = calib.std(0)
        bundles[key] = export_bci_bundle(  # normalised from this session's calibration trials only
            module, root / f"bundle-{key}", n_channels=N_CH, mean=calib.mean(0), std=np.where(std > 0, std, 1.0),
            session_name=s.name, calibration_info={"trials": s.calibration}, variants=(), tensorrt=False,
            report=lambda s: None,
        )
        files += [p for p in paths if key in p.name and "minival" in p.name]
    return files, bundles


def test_bundle_decoder_scores_zero_error_with_falcons_evaluator(falcon_files):
    from falcon_challenge.evaluator import FalconEvaluator

    files, bundles = falcon_files
    decoder = FalconBundleDecoder(bundles, backend="onnxruntime")
    evaluator = FalconEvaluator(eval_remote=False, split="h2", dataloader_workers=0)
    preds, targets, masks, compute_times, _ = evaluator.predict_files(decoder, files)
    assert len(files) == 2 and sorted(preds) == [f"ses-{k}" for k in sorted(bundles)]
    for day, sentences in SESSIONS.items():
        evaluated = [sentences[i] for i in falcon_splits(len(sentences), held_out=True)[1]]
        assert preds[f"ses-{day.replace('.', '')}"] == [evaluated]  # one batch, one string per trial
    assert decoder.trials_done == 4
    assert len(compute_times) == sum(len(m) for m in masks.values())  # predict once per evaluated bin
    keys = sorted(preds)
    metrics = FalconEvaluator.compute_metrics_edit_distance(
        [preds[k] for k in keys], [targets[k] for k in keys], np.concatenate([masks[k] for k in keys])
    )
    assert set(metrics) == {"WER", "CER", "WER Std.", "CER Std."}
    assert metrics["CER"] == 0.0 and metrics["WER"] == 0.0
    # one bundle for every file ("*"): loaded once, reset per file, every trial decoded
    shared = FalconBundleDecoder({"*": bundles["20230417"]}, backend="onnxruntime")
    preds2, _, _, _, _ = evaluator.predict_files(shared, files)
    assert shared.session_key == "*" and len(shared._loaded) == 1 and shared.trials_done == 4
    assert preds2[keys[0]] == preds[keys[0]]


def test_unknown_session_and_batching_are_refused(falcon_files):
    _, bundles = falcon_files
    with pytest.raises(ValueError, match="batch size 1"):
        FalconBundleDecoder(bundles, batch_size=2)
    d = FalconBundleDecoder({"20230417": bundles["20230417"]}, backend="onnxruntime")
    with pytest.raises(ValueError, match="no bundle for data file 'sub-T5_ses-20230816.nwb'"):
        d.reset(["/data/sub-T5_ses-20230816.nwb"])
    d.reset(["/data/sub-T5-held-out-calib_ses-20230417_ecephys.nwb"])
    with pytest.raises(ValueError, match=r"expected \(1, 192\)"):
        d.predict(np.zeros((1, 96)))


def test_session_keys_match_a_day_whichever_way_the_file_names_it(falcon_files):
    # a map keyed by session name (2023.04.17) must pick that day's bundle for DANDI's ses-20230417 files too;
    # before, such a file fell through to "*" and was scored with the wrong calibration
    _, bundles = falcon_files
    d = FalconBundleDecoder({"2023.04.17": bundles["20230417"], "2023-05-31": bundles["20230531"], "*": bundles["20230417"]},
                            backend="onnxruntime")
    d.reset(["/data/sub-T5-held-out-minival_ses-20230417.nwb"])
    assert d.session_key == "2023.04.17"
    d.reset(["/data/T5_2023.05.31_held_out_eval.nwb"])
    assert d.session_key == "2023-05-31"
    d.reset(["/data/sub-T5-held-out-minival_ses-20231009.nwb"])
    assert d.session_key == "*"


def test_adapter_runs_without_torch(falcon_files, tmp_path):
    files, bundles = falcon_files
    rng = np.random.default_rng(5)
    np.save(tmp_path / "trial.npy", _spikes_for("ox>cat~", rng))
    code = textwrap.dedent(
        f"""
        import sys
        class _Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "onnx"):
                    raise ImportError("blocked for this test: " + name)
        sys.meta_path.insert(0, _Block())
        import numpy as np
        from closedloop.sdk.bci.falcon_decoder import FalconBundleDecoder
        d = FalconBundleDecoder({{"*": {str(bundles["20230417"])!r}}}, backend="onnxruntime")
        d.reset([{str(files[0])!r}])
        for row in np.load({str(tmp_path / "trial.npy")!r}):
            d.predict(row[None])
        print(d.on_done(np.array([True])))
        assert "torch" not in sys.modules
        """
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ox>cat~"
