"""TargetFeatureBuffer: the one store of target feature rows of the EAGLE-3 head and the MTP
drafter (their end-to-end behaviour: tests/test_eagle3.py, test_mtp.py, test_head_runtime.py)."""

import numpy as np
import pytest

from localspec.drafters.target_features import TargetFeatureBuffer


def rows(first: int, n: int, width: int = 3) -> np.ndarray:
    """Rows whose every value is their position: [n, width] float64 (the buffer converts)."""
    return np.repeat(np.arange(first, first + n, dtype=np.float64)[:, None], width, axis=1)


def positions(buf: TargetFeatureBuffer) -> list[int]:
    return [int(r[0]) for r in buf.rows]


def test_add_keeps_positions_in_order_and_ignores_rows_already_held():
    buf = TargetFeatureBuffer(3, "the head")
    buf.add(0, rows(0, 4))
    buf.add(2, rows(2, 5))  # positions 2, 3 are held: only 4, 5, 6 are new
    assert buf.end == 7 and buf.first == 0
    assert positions(buf) == list(range(7))
    assert buf.rows.dtype == np.float32 and buf.rows.shape == (7, 3)
    buf.add(3, rows(3, 2))  # nothing new
    assert positions(buf) == list(range(7))


def test_a_gap_is_refused_and_nothing_is_lost():
    buf = TargetFeatureBuffer(3, "the MTP drafter")
    buf.add(0, rows(0, 2))
    with pytest.raises(ValueError, match="from position 3, but the MTP drafter has only 2"):
        buf.add(3, rows(3, 1))
    assert positions(buf) == [0, 1]


def test_restart_after_a_gap_keeps_only_the_new_rows():
    buf = TargetFeatureBuffer(3, "the head")
    buf.add(0, rows(0, 5))
    buf.drop_before(2)
    buf.restart(9)  # positions 5 .. 8 were decoded with the tap paused
    assert buf.first == buf.end == 9 and buf.rows.shape == (0, 3)
    buf.add(9, rows(9, 3))
    assert positions(buf) == [9, 10, 11] and buf.row(10)[0] == 10
    with pytest.raises(ValueError, match="cannot restart .* up to 11"):
        buf.restart(11)  # it has position 11: nothing would be a gap
    assert positions(buf) == [9, 10, 11]


def test_consume_from_the_front_then_truncate_from_the_back():
    buf = TargetFeatureBuffer(3, "the head")
    buf.add(0, rows(0, 6))
    buf.drop_before(4)
    assert (buf.first, buf.end) == (4, 6) and positions(buf) == [4, 5]
    assert buf.row(5)[0] == 5
    with pytest.raises(IndexError):
        buf.row(3)  # consumed
    buf.drop_before(2)  # already consumed: no-op
    assert (buf.first, buf.end) == (4, 6)
    with pytest.raises(ValueError, match="only 6"):
        buf.drop_before(7)
    buf.truncate(9)  # beyond the end: no-op
    assert buf.end == 6
    buf.truncate(5)
    assert positions(buf) == [4]
    buf.truncate(2)  # below the first held row: empty, needed again from 2
    assert (buf.first, buf.end) == (2, 2) and buf.rows.shape == (0, 3)
    buf.add(2, rows(2, 2))
    assert positions(buf) == [2, 3]


def test_adding_a_steps_rows_copies_only_those_rows():
    """The engine adds a step's few rows every step, also while the drafter does not draft
    (``auto`` with a head that does not pay): each ``add`` writes the new rows into room kept
    at the back (doubling when full), so over 2,000 single-row adds after a 700-row prompt
    the held rows move a handful of times, not once per add (a buffer concatenated anew each
    add copied all of them every step: 1-5 ms a step after a 748-token prompt)."""
    buf = TargetFeatureBuffer(3, "the head")
    buf.add(0, rows(0, 700))
    moves = 0
    for p in range(700, 2700):
        before = buf.rows
        buf.add(p, rows(p, 1))
        moves += not np.shares_memory(before, buf.rows)
    assert moves <= 4, moves
    assert positions(buf) == list(range(2700))


def test_rows_survive_any_mix_of_adds_consumes_and_truncations():
    """Random adds (with overlaps), front consumes and back truncations against a list of
    positions: the buffer always holds exactly the positions ``first .. end - 1``, each row
    its own."""
    rng = np.random.default_rng(0)
    buf = TargetFeatureBuffer(3, "the head")
    for _ in range(3000):
        op = rng.integers(0, 10)
        if op < 7:
            start = int(rng.integers(max(buf.first, buf.end - 3), buf.end + 1))
            buf.add(start, rows(start, int(rng.integers(1, 40))))
        elif op < 9:
            buf.drop_before(int(rng.integers(buf.first, buf.end + 1)))
        else:
            buf.truncate(int(rng.integers(max(0, buf.first - 5), buf.end + 2)))
        assert positions(buf) == list(range(buf.first, buf.end))
        assert buf.rows.dtype == np.float32
