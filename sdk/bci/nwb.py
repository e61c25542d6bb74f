"""FALCON H2 NWB files: write synthetic sessions in its layout, and one loader for these and the real files.

Layout (as the ``falcon_challenge`` package reads it): ``acquisition['binned_spikes']``
(bins x channels threshold-crossing counts with irregular ``timestamps``; consecutive
trials are 10 s apart, and a timestamp gap over 0.021 s ends a trial),
``acquisition['eval_mask']`` (one bool per bin, on the same timestamps) and the
``trials`` table whose ``cue`` column holds each trial's prompted sentence (plus
``block_num``, ``start_time``, ``stop_time``).

The loader cuts trials by timestamp gaps, as FALCON does, and pairs them in order with
the ``cue`` rows. What a file is (held-in or held-out, calibration or evaluation data,
which day) comes from its name, as in DANDI 000950: ``sub-T5-held-in-calib_ses-20220518...``,
``sub-T5-held-in-minival_ses-...`` or ``sub-T5-held-out-calib_ses-...`` (FALCON's local
names ``T5_2022.05.18_held_in_eval.nwb`` work too); files written here also carry it in
``notes``. :func:`load_falcon_h2_dir` merges a day's calibration and evaluation files
into one :class:`~closedloop.sim.handwriting.Session`. See ``docs/handwriting_data.md``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from datetime import date, datetime, timezone
from pathlib import Path

import numpy as np

from closedloop.common.handwriting import BIN_S, CHARSET, Session, Trial
from closedloop.sim.handwriting.config import FALCON_H2_HELD_IN_DATES, FALCON_H2_HELD_OUT_DATES

__all__ = ["write_falcon_h2", "write_falcon_h2_dir", "load_falcon_h2", "load_falcon_h2_dir",
           "parse_falcon_name", "FalconFileInfo", "FalconFileError", "TRIAL_SPACING_S", "TRIAL_GAP_S",
           "BIN_TOLERANCE_S"]

#: Time between the last bin of a trial and the first bin of the next, as in FALCON H2 files.
TRIAL_SPACING_S = 10.0
#: A timestamp step above this ends a trial (FALCON's loader: ``np.diff(time) > 0.021``).
TRIAL_GAP_S = 0.021
#: How far the bins' width (the median timestamp step within trials) may be from 20 ms.
BIN_TOLERANCE_S = 0.001
#: Day 0 of FALCON H2 (its first held-in session); real files get ``day`` relative to it.
FALCON_H2_DAY0 = date.fromisoformat(FALCON_H2_HELD_IN_DATES[0])
_NOTES_KEY = "closedloop_handwriting"


class FalconFileError(ValueError):
    """A file is not a readable FALCON H2 NWB file; the message names the file and what is missing."""


@dataclass(frozen=True)
class FalconFileInfo:
    """What a file's name says: ``split`` (held_in/held_out), ``role`` (calib/eval) and ``date``."""

    split: str | None
    role: str | None
    date: date | None


_SPLIT_RE = re.compile(r"held[-_]?(in|out)(?![a-z])")
_ROLE_RE = re.compile(r"(?:^|[-_.])(calib|minival|eval)(?=$|[-_.])")
_DATE_RES = (re.compile(r"ses-(\d{4})(\d{2})(\d{2})"), re.compile(r"(?<!\d)(\d{4})[.-](\d{2})[.-](\d{2})(?!\d)"),
             re.compile(r"(?<!\d)(20\d{2})(\d{2})(\d{2})(?!\d)"))


def parse_falcon_name(path: str | Path) -> FalconFileInfo:
    """Split, role and date from a FALCON H2 file name (DANDI ``sub-T5-held-out-calib_ses-20230417``
    or local ``T5_2023.04.17_held_out_eval``); ``None`` where the name does not say."""
    stem = Path(path).name.lower()
    m = _SPLIT_RE.search(stem)
    split = f"held_{m.group(1)}" if m else None
    m = _ROLE_RE.search(stem)
    role = None if m is None else ("calib" if m.group(1) == "calib" else "eval")
    day = None
    for rx in _DATE_RES:
        m = rx.search(stem)
        if m:
            with contextlib.suppress(ValueError):
                day = date(int(m.group(1)), int(m.group(2)), int(m.group(3)))
                break
    return FalconFileInfo(split, role, day)


# -- writing ---------------------------------------------------------------------------------------------
def _session_date(session: Session) -> date:
    iso = session.meta.get("date") or session.name.replace(".", "-")
    try:
        return date.fromisoformat(iso)
    except ValueError:
        raise ValueError(f"session {session.name!r}: no date (meta['date'] or a YYYY.MM.DD name) to write into "
                         "the NWB file's session_start_time") from None


def _write_file(path: Path, session: Session, indices: list[int], role: str | None, metadata: bool) -> Path:
    from hdmf.backends.hdf5.h5_utils import H5DataIO
    from pynwb import NWBHDF5IO, NWBFile, TimeSeries

    if not indices:
        raise ValueError(f"session {session.name!r}: no trials to write to {path}")
    trials = [session.trials[i] for i in indices]
    evaluation = set(session.evaluation)
    spikes = np.concatenate([t.spikes for t in trials])
    if spikes.dtype.kind not in "ui":
        raise ValueError(f"session {session.name!r}: spikes must be integer counts, got dtype {spikes.dtype}")
    timestamps, mask, starts, stops = [], [], [], []
    t0 = 0.0
    for i, trial in zip(indices, trials, strict=True):
        ts = t0 + BIN_S * np.arange(trial.n_bins)
        timestamps.append(ts)
        mask.append(np.full(trial.n_bins, i in evaluation))
        starts.append(float(ts[0]))
        stops.append(float(ts[-1] + BIN_S))
        t0 = float(ts[-1]) + TRIAL_SPACING_S
    when = _session_date(session)
    notes = {"name": session.name, "day": session.day, "split": session.split, "date": when.isoformat(),
             "role": role, "meta": {k: v for k, v in session.meta.items() if _jsonable(v)}}
    nwb = NWBFile(
        session_description=f"handwriting iBCI session {session.name} ({session.split}) in the FALCON H2 layout",
        identifier=f"{session.name}_{session.split}_{role or 'all'}",
        session_start_time=datetime(when.year, when.month, when.day, tzinfo=timezone.utc),
        notes=json.dumps({_NOTES_KEY: notes}) if metadata else "")
    binned = TimeSeries(name="binned_spikes", data=H5DataIO(spikes, compression="gzip", compression_opts=4),
                        unit="count", timestamps=np.concatenate(timestamps),
                        description="threshold crossings per 20 ms bin; a timestamp gap over 0.021 s ends a trial")
    nwb.add_acquisition(binned)
    nwb.add_acquisition(TimeSeries(name="eval_mask", data=np.concatenate(mask), unit="n/a", timestamps=binned,
                                   description="True on bins of evaluation trials"))
    nwb.add_trial_column(name="cue", description="prompted sentence ('>' space, '~' period)")
    nwb.add_trial_column(name="block_num", description="block of the trial")
    for trial, start, stop in zip(trials, starts, stops, strict=True):
        nwb.add_trial(start_time=start, stop_time=stop, cue=trial.sentence, block_num=int(trial.block))
    path.parent.mkdir(parents=True, exist_ok=True)
    # Hidden temporary sibling (the loader skips dot-files), renamed into place when complete.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp.nwb", dir=path.parent)
    os.close(fd)
    try:
        with NWBHDF5IO(tmp, "w") as io:
            io.write(nwb)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def _jsonable(value: object) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def write_falcon_h2(session: Session, path: str | Path, *, metadata: bool = True) -> Path:
    """Write ``session`` (all trials, ``eval_mask`` True on its evaluation trials) to ``path`` atomically.

    ``metadata=False`` leaves out the ``notes`` this package adds (name, day, split), so
    the file carries only what real FALCON files have.
    """
    return _write_file(Path(path), session, list(range(len(session.trials))), None, metadata)


def write_falcon_h2_dir(sessions: list[Session], folder: str | Path, *, layout: str = "dandi",
                        subject: str = "SIM", metadata: bool = True) -> list[Path]:
    """Write sessions under ``folder`` with DANDI-style names; returns the paths.

    ``layout="dandi"`` mirrors DANDI 000950: each session's non-evaluation trials go to
    ``sub-SIM-held-in-calib/sub-SIM-held-in-calib_ses-YYYYMMDD.nwb`` and its evaluation
    trials (the last 40%) to ``sub-SIM-held-in-minival/...`` (``held-out`` likewise).
    ``layout="session"`` writes one file per session, ``sub-SIM-held-in_ses-YYYYMMDD.nwb``.
    """
    if layout not in ("dandi", "session"):
        raise ValueError(f"layout must be 'dandi' or 'session', got {layout!r}")
    folder, paths = Path(folder), []
    for s in sessions:
        tag = f"sub-{subject}-{s.split.replace('_', '-')}"
        ses = f"ses-{_session_date(s).strftime('%Y%m%d')}"
        if layout == "session":
            paths.append(write_falcon_h2(s, folder / f"{tag}_{ses}.nwb", metadata=metadata))
            continue
        n, evaluation = len(s.trials), sorted(s.evaluation)
        if evaluation != list(range(n - len(evaluation), n)):
            raise ValueError(f"session {s.name!r}: the dandi layout needs the evaluation trials at the end "
                             f"(got {evaluation} of {n}); use layout='session'")
        calib = list(range(n - len(evaluation)))
        for role, indices in (("calib", calib), ("minival", evaluation)):
            if indices:
                paths.append(_write_file(folder / f"{tag}-{role}" / f"{tag}-{role}_{ses}.nwb", s, indices,
                                         "calib" if role == "calib" else "eval", metadata))
    return paths


# -- reading ---------------------------------------------------------------------------------------------
def _fail(path: Path, what: str) -> FalconFileError:
    return FalconFileError(f"{path}: {what} (a FALCON H2 file has acquisition 'binned_spikes' with timestamps, "
                           "acquisition 'eval_mask' and a trials table with a 'cue' column)")


def _as_counts(path: Path, spikes: np.ndarray) -> np.ndarray:
    if spikes.ndim != 2:
        raise _fail(path, f"binned_spikes has shape {spikes.shape}, expected (bins, channels)")
    finite = spikes[np.isfinite(spikes)] if spikes.dtype.kind == "f" else spikes
    if spikes.dtype.kind in "uif" and finite.size and finite.max() > 65535:
        raise _fail(path, f"binned_spikes holds a count of {finite.max():g}, over 65535: counts per bin are "
                          "u16 (a NEURAL_FRAME's), so such a value is not a spike count")
    if spikes.dtype.kind == "u" or (spikes.dtype.kind == "i" and spikes.min(initial=0) >= 0):
        return spikes
    if spikes.dtype.kind == "f" and np.all(np.isfinite(spikes)) and np.all(spikes == np.round(spikes)) \
            and spikes.min(initial=0) >= 0:
        return spikes.astype(np.uint8 if spikes.max(initial=0) <= 255 else np.uint16)
    if spikes.dtype.kind not in "uif":
        raise _fail(path, f"binned_spikes holds {spikes.dtype} values, not counts; store non-negative integer "
                          "counts per bin and channel")
    raise FalconFileError(f"{path}: binned_spikes must hold non-negative whole counts, but {_first_bad(spikes)}; "
                          "write each bin's threshold-crossing count per channel (an integer >= 0), with no "
                          "NaN or inf for missing data (leave such bins out of the file)")


def _first_bad(spikes: np.ndarray) -> str:
    """Which values of a float or signed array are not counts, and where the first one is (bin, channel)."""
    values = spikes.astype(float)
    kinds = [("NaN", np.isnan(values)), ("inf", np.isinf(values)), ("negative", values < 0),
             ("fractional", np.isfinite(values) & (values != np.round(values)))]
    parts = []
    for name, bad in kinds:
        if bad.any():
            b, c = (int(i) for i in np.argwhere(bad)[0])
            parts.append(f"{int(bad.sum())} {name} value(s) (the first at bin {b}, channel {c}: {values[b, c]:g})")
    return ", ".join(parts) + f" in its {spikes.dtype} data"


def _read(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str], np.ndarray, dict, date | None,
                               np.ndarray | None]:
    from pynwb import NWBHDF5IO

    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (expected a FALCON H2 .nwb file)")
    try:
        io = NWBHDF5IO(str(path), "r")
        nwb = io.read()
    except Exception as exc:  # h5py/hdmf raise many types for a non-NWB file
        raise _fail(path, f"cannot be read as an NWB file ({type(exc).__name__}: {exc})") from exc
    with io:
        acq = nwb.acquisition
        for name in ("binned_spikes", "eval_mask"):
            if name not in acq:
                raise _fail(path, f"missing acquisition {name!r} (found: {sorted(acq) or 'none'})")
        series = acq["binned_spikes"]
        if series.timestamps is None:
            raise _fail(path, "binned_spikes has no timestamps (trials are cut at timestamp gaps)")
        spikes = _as_counts(path, np.asarray(series.data[()]))
        stored = np.asarray(series.timestamps[()])
        timestamps = stored.astype(float)
        _check_time_resolution(path, stored)
        mask = np.asarray(acq["eval_mask"].data[()]).astype(bool).reshape(-1)
        if nwb.trials is None:
            raise _fail(path, "missing the trials table")
        if "cue" not in nwb.trials.colnames:
            raise _fail(path, f"the trials table has no 'cue' column (columns: {list(nwb.trials.colnames)})")
        cues = [c.decode() if isinstance(c, bytes) else str(c) for c in nwb.trials["cue"].data[:]]
        blocks = (np.asarray(nwb.trials["block_num"].data[:]).astype(int) if "block_num" in nwb.trials.colnames
                  else np.zeros(len(cues), dtype=int))
        row_starts = np.asarray(nwb.trials["start_time"].data[:], dtype=float) if "start_time" in nwb.trials.colnames \
            else None
        notes = {}
        with contextlib.suppress(TypeError, ValueError, AttributeError):
            notes = json.loads(nwb.notes or "{}").get(_NOTES_KEY, {})
        start = nwb.session_start_time.date() if nwb.session_start_time is not None else None
    if spikes.shape[0] != len(timestamps) == spikes.shape[1]:
        raise _fail(path, f"binned_spikes has shape {spikes.shape}: {spikes.shape[1]} columns, one per timestamp, so it "
                          "is stored (channels, bins); store it as (bins, channels), e.g. data=counts.T")
    if not len(timestamps) == spikes.shape[0] == len(mask):
        raise _fail(path, f"binned_spikes has {spikes.shape[0]} bins, its timestamps {len(timestamps)} and "
                          f"eval_mask {len(mask)}; they must match")
    return spikes, timestamps, mask, cues, blocks, notes, start, row_starts


def _check_time_resolution(path: Path, stored: np.ndarray) -> None:
    """Trials are cut at timestamp steps over 0.021 s between 0.020 s bins: a stored type too coarse for that at
    the file's largest time (float32 from 16,384 s on) would cut trials everywhere."""
    if stored.dtype.kind != "f" or not stored.size:
        return
    top = float(np.max(np.abs(stored)))
    resolution = float(np.spacing(stored.dtype.type(top)))
    if resolution > TRIAL_GAP_S - BIN_S:  # a 0.020 s step could then read as over 0.021 s
        raise _fail(path, f"binned_spikes timestamps are {stored.dtype} and reach {top:.0f} s, where that type "
                          f"resolves only {resolution:.3g} s: too coarse to tell a {BIN_S} s bin from a trial gap "
                          f"(> {TRIAL_GAP_S} s); store the timestamps as float64")


def _bin_width(path: Path, timestamps: np.ndarray) -> float:
    """The bins' width: the median step between consecutive timestamps under 1 s (a trial gap is longer).

    closedloop's decoders take FALCON H2's 20 ms bins: any other width (give or take :data:`BIN_TOLERANCE_S`) is
    refused, as the counts would be read at the wrong rate."""
    steps = np.diff(timestamps)
    steps = steps[(steps > 0) & (steps < 1.0)]
    if not steps.size:  # one bin per trial: nothing to measure (the trial checks say what is wrong)
        return BIN_S
    width = float(np.median(steps))
    if abs(width - BIN_S) > BIN_TOLERANCE_S:
        finer = BIN_S / width
        how = (f" (sum each channel's counts over every {finer:.0f} consecutive bins)"
               if width < BIN_S and abs(finer - round(finer)) < 0.05 else
               " (from the spike times or a finer binning: a coarser bin cannot be split)" if width > BIN_S else "")
        raise FalconFileError(f"{path}: binned_spikes timestamps are {width * 1000:.3g} ms apart, so its bins are "
                              f"{width * 1000:.3g} ms wide; closedloop's decoders take {BIN_S * 1000:g} ms bins "
                              f"(FALCON H2's): re-bin the counts into {BIN_S * 1000:g} ms bins{how} and write the "
                              f"file again, with timestamps {BIN_S} s apart within a trial")
    return width


def _check_charset(path: Path, cues: list[str]) -> None:
    allowed = set(CHARSET)
    for i, cue in enumerate(cues):
        bad = sorted(set(cue) - allowed)
        if bad:
            raise _fail(path, f"trial {i}'s cue {cue!r} has characters outside FALCON H2's 31 ({bad}); the set is "
                              f"{CHARSET!r}, with '>' for a space and '~' for a period")


def _check_trials(path: Path, trials: list[Trial]) -> None:
    """Every trial prompts a sentence, and has the bins to write it: CTC needs one bin per character and one more
    between two equal characters (a trial shorter than that cannot be trained on, and scores as noise)."""
    empty = [i for i, t in enumerate(trials) if not t.sentence]
    if empty:
        raise _fail(path, f"trial(s) {empty[:5]} have an empty cue: every trial prompts a sentence; give its cue or "
                          "leave the trial out of the file")
    short = []
    for i, t in enumerate(trials):
        need = len(t.sentence) + sum(a == b for a, b in zip(t.sentence, t.sentence[1:], strict=False))
        if len(t.spikes) < need:
            short.append(f"trial {i}: {len(t.spikes)} bins for {t.sentence!r} ({need} needed)")
    if short:
        raise _fail(path, f"{len(short)} trial(s) are shorter than their sentence ({'; '.join(short[:3])}): a trial "
                          f"needs a {BIN_S * 1000:g} ms bin per character and one between repeated characters; check "
                          "the timestamps (a gap over the trial gap cuts a trial) and the cue rows' order")


def _falcon_split(day: date | None) -> str | None:
    if day is None:
        return None
    iso = day.isoformat()
    return "held_in" if iso in FALCON_H2_HELD_IN_DATES else "held_out" if iso in FALCON_H2_HELD_OUT_DATES else None


def _rows_in_time_order(path: Path, timestamps: np.ndarray, bounds: np.ndarray,
                        row_starts: np.ndarray | None) -> np.ndarray:
    """Which trials-table row each trial cut at the timestamp gaps takes its cue from.

    Where every row's ``start_time`` falls inside the span of exactly one cut trial (give or take a bin), each
    one to a different trial, the rows are paired by time, whatever their order in the table. Otherwise (times on
    another clock, or none) the rows are taken in table order, which needs them in time order: rows whose
    ``start_time`` values go back in time are refused rather than paired with the wrong trials.
    """
    n = len(bounds) - 1
    identity = np.arange(n)
    if row_starts is None or len(row_starts) != n or not n:
        return identity
    first, last = timestamps[bounds[:-1]], timestamps[bounds[1:] - 1]
    inside = (row_starts[:, None] >= first[None, :] - BIN_S) & (row_starts[:, None] <= last[None, :] + BIN_S)
    if (inside.sum(axis=1) == 1).all():
        trial_of_row = inside.argmax(axis=1)
        if len(set(trial_of_row.tolist())) == n:
            order = np.empty(n, dtype=int)
            order[trial_of_row] = identity
            return order
    if np.any(np.diff(row_starts) < 0):
        back = int(np.flatnonzero(np.diff(row_starts) < 0)[0]) + 1
        raise _fail(path, f"the trials table's rows are not in time order (row {back} starts at "
                          f"{row_starts[back]:g} s, before row {back - 1} at {row_starts[back - 1]:g} s) and their "
                          "start_time values do not match the trials found at the timestamp gaps, so which cue "
                          "belongs to which trial is unknown; write the rows in time order, with each row's "
                          "start_time the first bin's timestamp of its trial")
    return identity


def load_falcon_h2(path: str | Path, *, n_calibration: int = 3) -> Session:
    """One FALCON H2 NWB file (real or written here) as a :class:`~closedloop.sim.handwriting.Session`.

    Trials are cut where a timestamp step exceeds 0.021 s and take their sentence from
    the ``cue`` rows in order. Splits follow FALCON: a calibration file (``calib`` in its
    name) is never scored, and provides all its trials (held-in) or its first
    ``n_calibration`` (held-out) for calibration; an evaluation file (``minival`` or
    ``eval``) is scored on every trial; a file with neither (one whole session) is
    scored on trials whose ``eval_mask`` is set, the others are calibration data.
    """
    path = Path(path)
    spikes, timestamps, mask, cues, blocks, notes, start, row_starts = _read(path)
    _check_charset(path, cues)
    bin_s = _bin_width(path, timestamps)
    ends = np.flatnonzero(np.diff(timestamps) > TRIAL_GAP_S) + 1
    bounds = np.concatenate([[0], ends, [len(timestamps)]]) if len(timestamps) else np.zeros(1, dtype=int)
    if len(bounds) - 1 != len(cues):
        steps = np.diff(timestamps)[ends - 1] if len(ends) else np.zeros(0)
        short = int(np.sum(steps < 0.1))
        hint = (f"; {short} of the cuts are steps under 0.1 s, which look like bins with imprecise timestamps "
                "(stored at too low a precision for their size?) rather than trial gaps" if short else "")
        if len(bounds) - 1 < len(cues):
            hint += (". Trials are told apart by a step of more than 0.021 s between consecutive bin timestamps "
                     "(FALCON H2 places them 10 s apart); the table's start_time and stop_time do not cut them, so "
                     "leave a gap between trials")
        raise _fail(path, f"timestamp gaps over {TRIAL_GAP_S} s cut {len(bounds) - 1} trials but the trials table "
                          f"has {len(cues)} cue rows{hint}")
    order = _rows_in_time_order(path, timestamps, bounds, row_starts)
    cues, blocks = [cues[i] for i in order], blocks[order]
    trials = [Trial(spikes=spikes[a:b], sentence=cue, block=int(blk))
              for a, b, cue, blk in zip(bounds[:-1], bounds[1:], cues, blocks, strict=True)]
    _check_trials(path, trials)
    scored = [i for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)) if mask[a:b].any()]
    partly = [(i, int(mask[a:b].sum()), int(b - a)) for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True))
              if mask[a:b].any() and not mask[a:b].all()]

    info = parse_falcon_name(path)
    when = info.date or (date.fromisoformat(notes["date"]) if "date" in notes else start)
    role = info.role or notes.get("role")
    # the first source that gives the split; "default": nothing says it, taken as held-in
    split_from, split = next(((where, value) for where, value in (("name", info.split), ("notes", notes.get("split")),
                                                                  ("date", _falcon_split(when))) if value),
                             ("default", "held_in"))
    name = notes.get("name") or (when.strftime("%Y.%m.%d") if when else path.stem)
    day = float(notes["day"]) if "day" in notes else float((when - FALCON_H2_DAY0).days) if when else 0.0
    n = len(trials)
    if role == "calib":
        evaluation, candidates = [], list(range(n))
    elif role == "eval":
        evaluation, candidates = list(range(n)), []
    else:
        evaluation = scored
        candidates = [i for i in range(n) if i not in set(scored)]
    calibration = candidates[:n_calibration] if split == "held_out" else candidates
    meta = dict(notes.get("meta", {}))
    meta.update({"date": when.isoformat() if when else None, "role": role, "files": [str(path)], "split_from": split_from,
                 "bin_s": round(bin_s, 6)})
    if partly and role is None:  # a calib or eval file's role decides, not its mask
        meta["warnings"] = [
            f"{path}: eval_mask is set on only some bins of {len(partly)} trial(s) ("
            + "; ".join(f"trial {i}: {k} of {n} bins" for i, k, n in partly[:3]) + (" ..." if len(partly) > 3 else "")
            + "): each such trial is scored whole, as an evaluation trial; set eval_mask on all of a trial's bins "
            "or none of them"]
    meta.setdefault("source", "falcon")
    return Session(name=name, day=day, split=split, trials=trials, calibration=calibration,
                   evaluation=evaluation, meta=meta)


def load_falcon_h2_dir(folder: str | Path, *, n_calibration: int = 3) -> list[Session]:
    """Every ``*.nwb`` under ``folder`` (recursively), one :class:`Session` per day and split, by day.

    A day's calibration and evaluation files (DANDI's ``-calib`` and ``-minival``
    folders) are merged: calibration trials first, then the evaluation trials.
    """
    folder = Path(folder)
    files = sorted(f for f in folder.rglob("*.nwb") if not f.name.startswith("."))
    if not files:
        raise FileNotFoundError(f"{folder}: no .nwb files found (point at the folder holding DANDI 000950's "
                                "sub-T5-held-in-calib, sub-T5-held-in-minival and sub-T5-held-out-calib)")
    order = {"calib": 0, None: 1, "eval": 2}
    groups: dict[tuple[str, str], list[Session]] = {}
    channels: dict[int, list[str]] = {}
    for f in files:
        s = load_falcon_h2(f, n_calibration=n_calibration)
        same = [p.meta["files"][0] for p in groups.get((s.name, s.split), []) if p.meta.get("role") == s.meta.get("role")]
        if same:
            subjects = {m.group(1) for p in (f, Path(same[0])) if (m := re.match(r"(sub-[A-Za-z0-9]+)", p.name))}
            if len(subjects) > 1:
                raise FalconFileError(f"{f} and {same[0]} are recordings of different subjects "
                                      f"({', '.join(sorted(subjects))}) on the same date; a decoder is trained and "
                                      "scored on one subject's sessions: give each subject its own folder")
            raise FalconFileError(f"{f} and {same[0]} are both the {s.meta.get('role') or 'whole-session'} data of "
                                  f"{s.split} session {s.name}; keep one of them under {folder} (a copy under another "
                                  "name would train or score its trials twice)")
        groups.setdefault((s.name, s.split), []).append(s)
        if s.trials:
            channels.setdefault(s.trials[0].spikes.shape[1], []).append(f.name)
    if len(channels) > 1:
        counts = "; ".join(f"{n} channels: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
                           for n, names in sorted(channels.items()))
        raise FalconFileError(f"{folder}: the files do not all have the same channels ({counts}); one decoder reads "
                              "one channel layout: keep the files of one array layout in a folder")
    sessions = []
    for parts in groups.values():
        parts.sort(key=lambda s: (order.get(s.meta.get("role"), 1), s.meta["files"][0]))
        merged = parts[0]
        for extra in parts[1:]:
            offset = len(merged.trials)
            merged.trials.extend(extra.trials)
            merged.calibration.extend(i + offset for i in extra.calibration)
            merged.evaluation.extend(i + offset for i in extra.evaluation)
            merged.meta["files"].extend(extra.meta["files"])
            if extra.meta.get("warnings"):
                merged.meta.setdefault("warnings", []).extend(extra.meta["warnings"])
        if merged.split == "held_out":
            merged.calibration = merged.calibration[:n_calibration]
        merged.meta["role"] = None if len(parts) > 1 else merged.meta.get("role")
        sessions.append(merged)
    return sorted(sessions, key=lambda s: (s.day, s.name, s.split))
