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
