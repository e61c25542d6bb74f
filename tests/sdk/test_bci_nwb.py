"""FALCON H2 NWB files: generator -> NWB -> loader round trips, trial cutting, real-file naming, clear errors."""

from __future__ import annotations

import warnings
from datetime import date, datetime, timezone
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pynwb")

from closedloop.sdk.bci.nwb import (  # noqa: E402
    FalconFileError,
    load_falcon_h2,
    load_falcon_h2_dir,
    parse_falcon_name,
    write_falcon_h2,
    write_falcon_h2_dir,
)
from closedloop.sim.handwriting import HandwritingConfig, Session, Trial, generate_recording  # noqa: E402


@pytest.fixture(scope="module")
def recording():
    return generate_recording(HandwritingConfig.tiny(seed=7))


def assert_same_session(a: Session, b: Session) -> None:
    assert (a.name, a.day, a.split) == (b.name, b.day, b.split)
    assert a.calibration == b.calibration and a.evaluation == b.evaluation
    assert len(a.trials) == len(b.trials)
    for x, y in zip(a.trials, b.trials, strict=True):
        assert x.sentence == y.sentence and x.block == y.block
        assert x.spikes.dtype == y.spikes.dtype and np.array_equal(x.spikes, y.spikes)


def test_one_session_round_trip(recording, tmp_path):
    for s in (recording[0], recording[3]):
        path = write_falcon_h2(s, tmp_path / f"{s.name}.nwb")
        assert_same_session(s, load_falcon_h2(path))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp file left behind


def test_dandi_layout_round_trip_through_the_real_data_path(recording, tmp_path):
    # metadata=False: the loader sees only what real FALCON files carry (names, timestamps, cue, eval_mask).
    paths = write_falcon_h2_dir(recording, tmp_path, metadata=False)
    names = {p.parent.name for p in paths}
    assert names == {"sub-SIM-held-in-calib", "sub-SIM-held-in-minival", "sub-SIM-held-out-calib",
                     "sub-SIM-held-out-minival"}
    assert paths[0].name == "sub-SIM-held-in-calib_ses-20220518.nwb"
    loaded = load_falcon_h2_dir(tmp_path)
    assert len(loaded) == len(recording)
    for a, b in zip(recording, loaded, strict=True):
        assert_same_session(a, b)
        assert b.meta["source"] == "falcon" and len(b.meta["files"]) == 2


def test_names_of_real_falcon_files_are_recognised():
    info = parse_falcon_name("000950/sub-T5-held-out-calib/sub-T5-held-out-calib_ses-20230417_behavior+ecephys.nwb")
    assert (info.split, info.role, info.date) == ("held_out", "calib", date(2023, 4, 17))
    info = parse_falcon_name("sub-T5-held-in-minival_ses-20220523.nwb")
    assert (info.split, info.role, info.date) == ("held_in", "eval", date(2022, 5, 23))
    info = parse_falcon_name("T5_2022.12.15_held_in_eval.nwb")
    assert (info.split, info.role, info.date) == ("held_in", "eval", date(2022, 12, 15))
    assert parse_falcon_name("recording.nwb") == parse_falcon_name("other.nwb")


def _write_raw(path: Path, *, timestamps=None, cues=("ab~", "c?"), skip=(), n_channels=4, ts_dtype=float,
               counts=None, starts=None, started=datetime(2023, 4, 17, tzinfo=timezone.utc)) -> Path:
    """A hand-made NWB file in (or deliberately not quite in) the FALCON H2 layout."""
    from pynwb import NWBHDF5IO, NWBFile, TimeSeries

    if timestamps is None:
        timestamps = np.concatenate([np.arange(5) * 0.02, 10.0 + np.arange(3) * 0.02])
    n = len(timestamps)
    if counts is None:
        counts = np.arange(n * n_channels, dtype=np.uint8).reshape(n, n_channels)
    nwb = NWBFile(session_description="test", identifier="t", session_start_time=started)
    spikes = TimeSeries(name="binned_spikes", data=counts, unit="count",
                        timestamps=np.asarray(timestamps, dtype=ts_dtype))
    if "binned_spikes" not in skip:
        nwb.add_acquisition(spikes)
    if "eval_mask" not in skip:
        nwb.add_acquisition(TimeSeries(name="eval_mask", data=np.ones(n, dtype=bool), unit="n/a",
                                       timestamps=np.asarray(timestamps, dtype=float)))
    if "cue" not in skip:
        nwb.add_trial_column(name="cue", description="sentence")
    for i, cue in enumerate(cues):
        kwargs = {} if "cue" in skip else {"cue": cue}
        start = float(i) if starts is None else float(starts[i])
        nwb.add_trial(start_time=start, stop_time=start + 0.5, **kwargs)
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with NWBHDF5IO(str(path), "w") as io:
            io.write(nwb)
    if np.dtype(ts_dtype) != np.float64 and "binned_spikes" not in skip:  # pynwb stores float64: patch it as h5py would
        import h5py

        with h5py.File(path, "r+") as f:
            old = f["acquisition/binned_spikes/timestamps"]
            attrs = dict(old.attrs)
            del f["acquisition/binned_spikes/timestamps"]
            new = f.create_dataset("acquisition/binned_spikes/timestamps", data=np.asarray(timestamps, dtype=ts_dtype))
            new.attrs.update(attrs)
    return path


def test_trials_are_cut_at_timestamp_gaps(tmp_path):
    ts = np.concatenate([np.arange(4) * 0.02, 10 + np.arange(2) * 0.02, 20 + np.arange(3) * 0.02])
    path = _write_raw(tmp_path / "sub-T5-held-out-calib_ses-20230417.nwb", timestamps=ts, cues=("a~", "b~", "c~"))
    s = load_falcon_h2(path)
    assert [t.n_bins for t in s.trials] == [4, 2, 3] and [t.sentence for t in s.trials] == ["a~", "b~", "c~"]
    assert s.split == "held_out" and s.day == 334.0 and s.name == "2023.04.17"
    assert s.calibration == [0, 1, 2] and s.evaluation == []   # a calib file is never scored
    np.testing.assert_array_equal(s.trials[1].spikes[0], np.arange(16, 20))
    # A step of 0.0205 s does not end a trial (FALCON's threshold is 0.021 s).
    near = np.concatenate([np.arange(3) * 0.02, 0.0605 + np.arange(2) * 0.02])
    one = load_falcon_h2(_write_raw(tmp_path / "near.nwb", timestamps=near, cues=("x~",)))
    assert [t.n_bins for t in one.trials] == [5] and one.evaluation == [0]


def test_a_files_split_says_where_it_came_from_and_a_file_nothing_names_is_held_in(tmp_path):
    named = load_falcon_h2(_write_raw(tmp_path / "sub-X-held-out-calib_ses-20240301.nwb"))
    by_date = load_falcon_h2(_write_raw(tmp_path / "a.nwb"))  # 2023-04-17, a FALCON H2 held-out date
    unnamed = load_falcon_h2(_write_raw(tmp_path / "b.nwb", started=datetime(2024, 3, 1, tzinfo=timezone.utc)))
    assert (named.split, named.meta["split_from"]) == ("held_out", "name")
    assert (by_date.split, by_date.meta["split_from"]) == ("held_out", "date")
    assert (unnamed.split, unnamed.meta["split_from"]) == ("held_in", "default")


def test_trials_table_rows_are_paired_with_trials_by_start_time_or_refused_out_of_order(tmp_path):
    """A table written in another order pairs each cue with the trial its start_time falls in; rows out of time
    order whose times match no trial are refused, not paired with the wrong trials in table order."""
    ts = np.concatenate([np.arange(4) * 0.02, 10 + np.arange(2) * 0.02, 20 + np.arange(3) * 0.02])
    rows = _write_raw(tmp_path / "reversed.nwb", timestamps=ts, cues=("c~", "b~", "a~"), starts=(20.0, 10.0, 0.0))
    s = load_falcon_h2(rows)
    assert [t.sentence for t in s.trials] == ["a~", "b~", "c~"] and [t.n_bins for t in s.trials] == [4, 2, 3]
    other_clock = _write_raw(tmp_path / "clock.nwb", timestamps=ts, cues=("c~", "b~", "a~"), starts=(7.0, 5.0, 3.0))
    with pytest.raises(FalconFileError, match=r"rows are not in time order \(row 1 starts at 5 s, before row 0 at "
                                              r"7 s\).*which cue belongs to which trial is unknown"):
        load_falcon_h2(other_clock)


@pytest.mark.parametrize("skip, message", [
    (("binned_spikes",), "missing acquisition 'binned_spikes'"),
    (("eval_mask",), "missing acquisition 'eval_mask'"),
    (("cue",), "no 'cue' column"),
])
def test_a_file_missing_a_field_names_the_file_and_the_field(tmp_path, skip, message):
    path = _write_raw(tmp_path / "bad.nwb", skip=skip)
    with pytest.raises(FalconFileError, match=message) as err:
        load_falcon_h2(path)
    assert str(path) in str(err.value)


def test_unreadable_or_inconsistent_files_are_refused_clearly(tmp_path):
    junk = tmp_path / "junk.nwb"
    junk.write_bytes(b"not an hdf5 file at all")
    with pytest.raises(FalconFileError, match="cannot be read as an NWB file") as err:
        load_falcon_h2(junk)
    assert str(junk) in str(err.value)
    mismatch = _write_raw(tmp_path / "mismatch.nwb", cues=("only>one~",))
    with pytest.raises(FalconFileError, match="cut 2 trials but the trials table has 1 cue rows"):
        load_falcon_h2(mismatch)
    with pytest.raises(FileNotFoundError, match="no .nwb files"):
        load_falcon_h2_dir(tmp_path / "empty")
    # counts stored (channels, bins): named as transposed, not as a bin-count mismatch
    import h5py

    transposed = _write_raw(tmp_path / "transposed.nwb")  # 8 bins x 4 channels, then rewritten as h5py would
    with h5py.File(transposed, "r+") as f:
        data = f["acquisition/binned_spikes/data"]
        counts, attrs = data[()], dict(data.attrs)
        del f["acquisition/binned_spikes/data"]
        f.create_dataset("acquisition/binned_spikes/data", data=counts.T).attrs.update(attrs)
    with pytest.raises(FalconFileError, match=r"shape \(4, 8\): 8 columns, one per timestamp, so it is stored "
                                              r"\(channels, bins\); store it as \(bins, channels\)"):
        load_falcon_h2(transposed)


def test_timestamps_too_coarse_to_cut_trials_are_refused_saying_so(tmp_path):
    # float32 resolves 2 ms at 20,000 s: every 20 ms step could read as a trial gap; the file says float32, the
    # error must say precision (not "the trials table has too few cues")
    late = 20000.0 + np.concatenate([np.arange(5) * 0.02, 10.0 + np.arange(3) * 0.02])
    with pytest.raises(FalconFileError, match="timestamps are float32 and reach 20010 s.*store the timestamps as float64"):
        load_falcon_h2(_write_raw(tmp_path / "late32.nwb", timestamps=late, ts_dtype=np.float32))
    # the same values already rounded to float32 but stored as float64 (pynwb's cast): the cut count cannot
    # match, and the error says why it looks that way
    rounded = np.asarray(late, dtype=np.float32).astype(float)
    with pytest.raises(FalconFileError, match="cuts are steps under 0.1 s, which look like bins with imprecise"):
        load_falcon_h2(_write_raw(tmp_path / "rounded.nwb", timestamps=rounded))
    early = load_falcon_h2(_write_raw(tmp_path / "early32.nwb", ts_dtype=np.float32))  # near 0 float32 is fine
    assert [t.n_bins for t in early.trials] == [5, 3]
    assert [t.n_bins for t in load_falcon_h2(_write_raw(tmp_path / "late64.nwb", timestamps=late)).trials] == [5, 3]


def test_cues_outside_the_character_set_are_refused_naming_file_and_trial(tmp_path):
    path = _write_raw(tmp_path / "sub-T5-held-in-calib_ses-20220518.nwb", cues=("ab~", "He>said~"))
    with pytest.raises(FalconFileError, match=r"trial 1's cue 'He>said~' has characters outside FALCON H2's 31 \(\['H'\]\)") as e:
        load_falcon_h2(path)
    assert str(path) in str(e.value)


def test_empty_cues_and_trials_shorter_than_their_sentence_are_refused_naming_them(tmp_path):
    """A trial with no sentence, or with fewer bins than CTC needs to write its sentence (one per character, one
    more between repeats), cannot be trained on and scores as noise: refused, naming the trial."""
    with pytest.raises(FalconFileError, match=r"trial\(s\) \[1\] have an empty cue"):
        load_falcon_h2(_write_raw(tmp_path / "empty.nwb", cues=("ab~", "")))
    # trial 1 has 3 bins: 'aa' needs 3 (a blank between the two a's), 'abcd' needs 4
    assert load_falcon_h2(_write_raw(tmp_path / "fits.nwb", cues=("ab~", "aa"))).trials[1].sentence == "aa"
    with pytest.raises(FalconFileError, match=r"1 trial\(s\) are shorter than their sentence \(trial 1: 3 bins for "
                                              r"'abcd' \(4 needed\)\)"):
        load_falcon_h2(_write_raw(tmp_path / "short.nwb", cues=("ab~", "abcd")))


def test_negative_counts_are_refused(tmp_path):
    counts = np.zeros((8, 4), dtype=np.int64)
    counts[2, 1] = -1
    with pytest.raises(FalconFileError, match=r"1 negative value\(s\) \(the first at bin 2, channel 1: -1\)"):
        load_falcon_h2(_write_raw(tmp_path / "neg.nwb", counts=counts))
    for dtype in (np.float64, np.int64):  # a count past u16 is not a spike count (it used to wrap: 70000 -> 4464)
        big = np.zeros((8, 4), dtype=dtype)
        big[3, 0] = 70000
        with pytest.raises(FalconFileError, match="count of 70000, over 65535"):
            load_falcon_h2(_write_raw(tmp_path / f"big_{np.dtype(dtype).name}.nwb", counts=big))


def test_trials_without_a_gap_between_them_are_refused_saying_a_gap_cuts_them(tmp_path):
    ts = np.arange(8) * 0.02  # two cue rows, one run of bins
    with pytest.raises(FalconFileError, match=r"cut 1 trials but the trials table has 2 cue rows.*step of more than "
                                              r"0.021 s.*leave a gap between trials"):
        load_falcon_h2(_write_raw(tmp_path / "contiguous.nwb", timestamps=ts))


def test_a_folder_with_one_day_twice_or_mixed_channel_counts_is_refused(tmp_path):
    twice = tmp_path / "twice"
    _write_raw(twice / "sub-T5-held-out-calib" / "sub-T5-held-out-calib_ses-20230417.nwb")
    _write_raw(twice / "T5_2023.04.17_held_out_calib.nwb")  # the same day, FALCON's local name
    with pytest.raises(FalconFileError, match="are both the calib data of held_out session 2023.04.17; keep one"):
        load_falcon_h2_dir(twice)
    subjects = tmp_path / "subjects"
    _write_raw(subjects / "sub-P1-held-out-calib_ses-20230417.nwb")
    _write_raw(subjects / "sub-P2-held-out-calib_ses-20230417.nwb")
    with pytest.raises(FalconFileError, match=r"different subjects \(sub-P1, sub-P2\) on the same date.*its own folder"):
        load_falcon_h2_dir(subjects)
    mixed = tmp_path / "mixed"
    _write_raw(mixed / "T5_2023.04.17_held_out_calib.nwb", n_channels=4)
    _write_raw(mixed / "T5_2023.05.31_held_out_calib.nwb", n_channels=3, counts=np.zeros((8, 3), dtype=np.uint8))
    with pytest.raises(FalconFileError, match="do not all have the same channels .3 channels: T5_2023.05.31"):
        load_falcon_h2_dir(mixed)


def test_writer_refuses_float_spikes(tmp_path):
    s = Session("2022.05.18", 0.0, "held_in", [Trial(np.zeros((3, 2)), "a~")], [0], [])
    with pytest.raises(ValueError, match="integer counts"):
        write_falcon_h2(s, tmp_path / "x.nwb")


def test_falcons_own_loader_reads_our_files(recording, tmp_path):
    pytest.importorskip("falcon_challenge")
    from falcon_challenge.config import FalconTask
    from falcon_challenge.dataloaders import load_nwb

    s = recording[3]
    spikes, targets, trial_change, eval_mask = load_nwb(write_falcon_h2(s, tmp_path / "x.nwb"), FalconTask.h2)
    assert np.array_equal(spikes, np.concatenate([t.spikes for t in s.trials]))
    assert ["".join(map(chr, t)) for t in targets] == [t.sentence for t in s.trials]
    ends = np.flatnonzero(trial_change)
    assert list(ends + 1) == list(np.cumsum([t.n_bins for t in s.trials]))
    assert eval_mask.sum() == sum(s.trials[i].n_bins for i in s.evaluation)


def test_bins_other_than_20_ms_are_refused_saying_the_width_found_and_to_rebin(tmp_path):
    # 10 ms bins used to load silently (a decoder trained on them runs at the wrong rate); 50 ms ones were refused
    # as "bins with imprecise timestamps"
    for ms, how in ((10, "sum each channel's counts over every 2 consecutive bins"), (50, "from the spike times or a finer binning: a coarser bin cannot")):
        step = ms / 1000
        ts = np.concatenate([np.arange(5) * step, 10.0 + np.arange(3) * step])
        with pytest.raises(FalconFileError, match=rf"timestamps are {ms} ms apart, so its bins are {ms} ms wide; "
                                                  r"closedloop's decoders take 20 ms bins \(FALCON H2's\): re-bin the "
                                                  rf"counts into 20 ms bins \({how}"):
            load_falcon_h2(_write_raw(tmp_path / f"b{ms}.nwb", timestamps=ts))
    # FALCON's timestamps wander a little around 20 ms: within the tolerance, and the width is kept
    jitter = np.concatenate([np.arange(5) * 0.0203, 10.0 + np.arange(3) * 0.0203])
    assert load_falcon_h2(_write_raw(tmp_path / "j.nwb", timestamps=jitter)).meta["bin_s"] == pytest.approx(0.0203)
    assert load_falcon_h2(_write_raw(tmp_path / "ok.nwb")).meta["bin_s"] == pytest.approx(0.02)


@pytest.mark.parametrize("value, what", [(np.nan, r"1 NaN value\(s\) \(the first at bin 5, channel 3: nan\)"),
                                         (np.inf, r"1 inf value\(s\) \(the first at bin 5, channel 3: inf\)"),
                                         (0.5, r"1 fractional value\(s\) \(the first at bin 5, channel 3: 0.5\)"),
                                         (-2.0, r"1 negative value\(s\) \(the first at bin 5, channel 3: -2\)")])
def test_values_that_are_not_counts_are_named_with_their_first_bin_and_channel(tmp_path, value, what):
    counts = np.ones((8, 4), dtype=np.float32)
    counts[5, 3] = value
    with pytest.raises(FalconFileError, match=rf"binned_spikes must hold non-negative whole counts, but {what} in its "
                                              "float32 data"):
        load_falcon_h2(_write_raw(tmp_path / "bad.nwb", counts=counts))


def test_an_eval_mask_set_on_part_of_a_trial_is_scored_whole_with_a_warning_naming_file_and_trial(tmp_path):
    from pynwb import NWBHDF5IO

    path = _write_raw(tmp_path / "sub-T5-held-in_ses-20220518.nwb")
    with NWBHDF5IO(str(path), "a") as io:  # trial 0's five bins: the mask set on two of them; trial 1's on none
        io.read().acquisition["eval_mask"].data[:] = np.array([0, 0, 0, 1, 1, 0, 0, 0], dtype=bool)
    s = load_falcon_h2(path)
    assert s.evaluation == [0] and s.calibration == [1]
    (w,) = s.meta["warnings"]
    assert w.startswith(f"{path}: eval_mask is set on only some bins of 1 trial(s) (trial 0: 2 of 5 bins)")
    assert "scored whole" in w
    assert "warnings" not in load_falcon_h2(_write_raw(tmp_path / "sub-T5-held-in_ses-20220523.nwb")).meta
