"""``SeqSlots``: scratch sequence ids for growing a token tree level by level in a draft context.

A drafter that expands a tree one level per decode (EAGLE-2 style) needs each decoded node
to attend to the committed prefix (seq 0) and to its own ancestors only. Every decoded node
gets its own sequence id (a *slot*); before a node is decoded its parent's slot is copied to
the node's slot with ``llama_memory_seq_cp`` (which only tags cells, no data moves), so the
slot holds exactly prefix + path::

    seq 0:   p p p p r              (committed prefix and the root r)
    slot 1:  p p p p r a            a = child of r   (fork(0) then decode a in slot 1)
    slot 2:  p p p p r b            b = child of r
    slot 3:  p p p p r a c          c = child of a   (fork(1) then decode c in slot 3)

``release()`` drops every slot's cells (cells only tagged by slots are freed; seq 0 keeps
its own) and checks through ``llama_memory_seq_pos_max`` that nothing is left.
"""

from __future__ import annotations

from .context import Context


class SeqSlots:
    """Allocates sequence ids ``first .. first + capacity - 1`` of ``ctx`` for one tree
    expansion (default: ``1 .. n_seq_max - 1``, sequence 0 holding the committed prefix; a
    draft context shared by several requests gives each its own range).

    Args:
        ctx: the draft context (created with ``n_seq_max`` >= slots needed + 1, ``kv_unified``).
        first: the first scratch id.
        capacity: scratch ids (default: every id from ``first`` on).
    """

    def __init__(self, ctx: Context, first: int = 1, capacity: int | None = None) -> None:
        self.ctx = ctx
        self.first = int(first)
        self._capacity = ctx.n_seq_max - self.first if capacity is None else int(capacity)
        self._used: list[int] = []

    @property
    def capacity(self) -> int:
        """Slots available per expansion."""
        return self._capacity

    @property
    def n_free(self) -> int:
        return self.capacity - len(self._used)

    def fork(self, parent_seq: int) -> int:
        """A new slot holding every cell of ``parent_seq`` (prefix + the parent's path).

        Raises:
            ValueError: no slot is left (the tree is wider/deeper than ``n_seq_max`` allows).
        """
        if not self.n_free:
            raise ValueError(f"no free sequence id: the draft context has n_seq_max={self.ctx.n_seq_max}")
        seq = self.first + len(self._used)
        self.ctx.seq_cp(int(parent_seq), seq, -1, -1)
        self._used.append(seq)
        return seq

    def release(self) -> None:
        """Drop every slot's cells; raise ``KVCacheError`` if one still holds any."""
        for seq in self._used:
            self.ctx.seq_rm(seq, -1, -1)
        for seq in self._used:
            self.ctx.expect_positions(seq, 0, f"draft slot {seq} after release")
        self._used = []
