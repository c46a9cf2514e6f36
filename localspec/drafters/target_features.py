"""``TargetFeatureBuffer``: the target's feature rows that a feature-reading drafter (EAGLE-3
head, MTP block) has received but not yet consumed, one row per history position.

The engine's step hands each drafter the rows of the positions it committed
(``add_target_features``); the drafter consumes them from the front as it writes its own KV
entries (``drop_before``) and forgets them from the back when a new history diverges
(``truncate``).
"""

from __future__ import annotations

import numpy as np


class TargetFeatureBuffer:
    """Feature rows of the consecutive history positions ``first .. end - 1``.

    Args:
        width: the row width (EAGLE-3: ``3 * n_embd`` of the target; MTP: ``n_embd``).
        owner: what the rows belong to, for error messages ("the EAGLE-3 head").

    Attributes:
        first: the position of ``rows[0]``.
        rows: [end - first, width] float32.
    """

    def __init__(self, width: int, owner: str) -> None:
        self.owner = owner
        self.first = 0
        self.rows = np.zeros((0, width), dtype=np.float32)

    @property
    def end(self) -> int:
        """Positions ``0 .. end - 1`` of the history whose features the drafter has (or has
        consumed): the drafter's ``n_target_features``."""
        return self.first + self.rows.shape[0]

    def row(self, pos: int) -> np.ndarray:
        """The row of position ``pos`` (``first <= pos < end``): [width] float32, a view."""
        if not self.first <= pos < self.end:
            raise IndexError(f"{self.owner} has target features of positions {self.first} .. {self.end - 1}, not {pos}")
        return self.rows[pos - self.first]

    def add(self, first_pos: int, rows: np.ndarray) -> None:
        """Rows of positions ``first_pos, first_pos + 1, ...`` ([n, width], converted to
        float32); rows of positions already held are ignored.

        Raises:
            ValueError: a gap (positions between ``end`` and ``first_pos``).
        """
        have = self.end
        if first_pos > have:
            raise ValueError(f"target features from position {first_pos}, but {self.owner} has only {have}")
        new = rows[have - first_pos :]
        if new.shape[0]:
            self.rows = np.concatenate([self.rows, new.astype(np.float32, copy=False)])

    def truncate(self, n: int) -> None:
        """Keep the rows of positions ``< n`` (no-op when ``n >= end``). With ``n <= first``
        the buffer is empty and starts at ``n``: the features from ``n`` on are needed again."""
        if n <= self.first:
            self.first, self.rows = n, self.rows[:0]
        else:
            self.rows = self.rows[: n - self.first]

    def drop_before(self, pos: int) -> None:
        """Forget the rows of positions ``< pos`` (consumed); ``pos <= end``. No-op when
        ``pos <= first``."""
        if pos > self.end:
            raise ValueError(f"cannot consume target features up to {pos}: {self.owner} has only {self.end}")
        if pos > self.first:
            self.rows = self.rows[pos - self.first :]
            self.first = pos
