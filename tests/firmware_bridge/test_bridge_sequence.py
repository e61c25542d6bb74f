"""Sequence numbers: gaps counted as lost, duplicates and late frames counted and dropped."""

from __future__ import annotations

from closedloop.firmware_bridge import FrameParser, Heartbeat, Hello, encode_frame


def _feed(seqs: list[int], parser: FrameParser | None = None, hello_at: tuple[int, ...] = ()) -> tuple[list[int],
                                                                                                      FrameParser]:
    parser = parser or FrameParser()
    got = []
    for i, seq in enumerate(seqs):
        msg = Hello("arm") if i in hello_at else Heartbeat()
        got += [f.seq for f in parser.feed(encode_frame(msg, seq, 0))]
    return got, parser


def test_in_order_stream_has_no_events() -> None:
    got, p = _feed(list(range(10)))
    assert got == list(range(10))
    assert (p.stats.lost, p.stats.duplicate, p.stats.out_of_order) == (0, 0, 0)


def test_gap_is_counted_as_lost() -> None:
    got, p = _feed([0, 1, 5, 6, 10])
    assert got == [0, 1, 5, 6, 10] and p.stats.lost == 3 + 3


def test_duplicate_is_dropped_and_counted() -> None:
    got, p = _feed([0, 1, 1, 2, 2, 2])
    assert got == [0, 1, 2] and p.stats.duplicate == 3 and p.stats.accepted == 3


def test_late_frame_is_dropped_counted_and_unlost() -> None:
    got, p = _feed([0, 1, 3, 4, 2, 5])
    assert got == [0, 1, 3, 4, 5]
    assert p.stats.out_of_order == 1 and p.stats.lost == 0  # 2 was missing, then turned up late
    got, p = _feed([10, 9])  # older than the first frame: late, but never counted lost
    assert got == [10] and p.stats.out_of_order == 1 and p.stats.lost == 0


def test_late_duplicate_within_window_is_a_duplicate() -> None:
    got, p = _feed([0, 1, 2, 3, 1])
    assert got == [0, 1, 2, 3] and p.stats.duplicate == 1 and p.stats.out_of_order == 0


def test_wraparound_is_in_order() -> None:
    top = 2**32 - 2
    got, p = _feed([top, top + 1, 0, 1, 3])
    assert got == [top, top + 1, 0, 1, 3] and p.stats.lost == 1 and p.stats.seq_resets == 0


def test_jump_back_by_a_window_or_more_is_a_sender_restart() -> None:
    got, p = _feed([500, 501, 0, 1])
    assert got == [500, 501, 0, 1] and p.stats.seq_resets == 1 and p.stats.out_of_order == 0


def test_hello_starts_a_new_stream() -> None:
    got, p = _feed([40, 41, 3, 4], hello_at=(2,))
    assert got == [40, 41, 3, 4] and p.stats.seq_resets == 1 and p.stats.out_of_order == 0


def test_big_forward_jump_counts_every_missing_frame() -> None:
    got, p = _feed([0, 1000, 999])
    # 1..999 went missing (999), then 999 turned up late: dropped, and no longer lost
    assert got == [0, 1000] and p.stats.lost == 998 and p.stats.out_of_order == 1


def test_reset_forgets_history() -> None:
    _, p = _feed([5, 6])
    p.reset()
    got, p = _feed([5], p)
    assert got == [5] and p.stats.duplicate == 0
