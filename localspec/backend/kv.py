"""``SequenceCache``: one request's committed tokens in a KV sequence, edited only through checked steps.

Every edit ends with ``check()``, which reads the cache's position range for the request's
sequence (and for every scratch sequence a tree used) through ``llama_memory_seq_pos_min/max``
and raises ``KVCacheError`` when it is not exactly ``[0, n_past)``. llama.cpp's own return
values are not trusted: ``seq_rm`` returns true even when a window-sized SWA cache has already
dropped the cells a rollback needs.

KV cells are kept in position order. llama.cpp's CPU attention accumulates over cells in
cell order, so a cache whose cells are out of position order computes (slightly) different
numbers than plain decoding. A tree's nodes occupy cells in node order; when the accepted
path is not the first nodes of the tree (another branch came first), only its leading run of
consecutive nodes is committed (``commit_plan``), and the rest of the accepted tokens become
``pending``: they are decoded again, without logits, at the front of the next batch.

Rejected cells are freed in a context of one request (the engine's); in a context shared by
several requests (the batch scheduler's) they are re-tagged to a *junk* sequence instead, so
that llama.cpp, which reuses the lowest free cell, never puts a request's next token before its
own earlier cells (see ``localspec.scheduler``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import ContextOverflowError
from ..tree import TokenTree
from .tree_layout import TreeLayout, layout_tree
from .batch import Batch
from .context import Context


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists (what a KV sequence holding ``a``
    can keep for ``b``)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64)
    i = int(np.argmax(x))
    return n if not x[i] else i


def commit_plan(path: Sequence[int]) -> int:
    """How many accepted nodes of ``path`` (node indices, root excluded, top-down) keep their
    cells: the leading run ``1, 2, ..., n`` that directly follows the root in cell order. The
    rest are decoded again (``pending``)."""
    n = 0
    while n < len(path) and int(path[n]) == n + 1:
        n += 1
    return n


@dataclass
class TreeRows:
    """A request's rows of one batch: its pending tokens (no logits), then its tree.

    Attributes:
        lay: the tree's ``TreeLayout`` (sequence ids relative to the request's: add ``base``).
        tokens / pos: [m + n] int32.
        seq_sets: [m + n, k] int32 absolute sequence ids; ``n_seq`` [m + n] int32.
        output: [m + n] int8, 1 for the tree's nodes.
        n_pending: ``m``.
    """

    lay: TreeLayout
    tokens: np.ndarray
    pos: np.ndarray
    seq_sets: np.ndarray
    n_seq: np.ndarray
    output: np.ndarray
    n_pending: int


class SequenceCache:
    """The committed tokens of one request's KV sequence, and the tree decodes on top of it.

    Args:
        ctx: the target context.
        base: the request's sequence id (committed tokens); its tree's leaves use the
            scratch ids ``base + 1 .. base + n_scratch``.
        n_scratch: scratch sequences (default: every other id of the context).
        junk: where rejected cells go: None frees them (a context of one request), else a
            sequence id that keeps them occupied (a context shared by several requests).
        n_ctx: most cells this sequence may hold (default: the context's size).
        max_tree_nodes: largest tree (root included).

    Attributes:
        tokens: the token ids whose KV cells are in ``base``, in position order
            (``len(tokens) == n_past``).
        pending: accepted tokens (or prompt tokens) decoded at the front of the next batch.
    """

    def __init__(self, ctx: Context, *, base: int = 0, n_scratch: int | None = None, junk: int | None = None,
                 n_ctx: int | None = None, max_tree_nodes: int = 64) -> None:  # fmt: skip
        self.ctx = ctx
        self.base = int(base)
        self.n_scratch = int(ctx.n_seq_max - 1 - base if n_scratch is None else n_scratch)
        self.junk = junk
        self.n_ctx = int(ctx.n_ctx if n_ctx is None else n_ctx)
        self.tokens: list[int] = []
        self.pending: list[int] = []
        self.n_redecoded = 0  # accepted tokens decoded again to keep cells in position order
        self.max_tree_nodes = int(max_tree_nodes)
        self._prefill_batch: Batch | None = None
        self._tree_batch: Batch | None = None
        self._scratch_used: np.ndarray = np.zeros(0, dtype=np.int32)  # absolute ids

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    @property
    def root_pos(self) -> int:
        """Position of the next tree's root (after the committed and pending tokens)."""
        return len(self.tokens) + len(self.pending)

    @property
    def n_free(self) -> int:
        """KV cells left for new tokens (tree nodes included)."""
        return self.n_ctx - self.root_pos

    # -- checks -------------------------------------------------------------------------------

    def check(self) -> None:
        """Raise ``KVCacheError`` unless the request's sequence holds exactly positions
        ``[0, n_past)`` and no scratch sequence it used holds anything."""
        n = self.n_past
        self.ctx.expect_positions(self.base, n, f"the KV cache of sequence {self.base} ({n} tokens committed)")
        for s in self._scratch_used:
            self.ctx.expect_positions(int(s), 0, f"scratch sequence {int(s)} after a commit")

    # -- edits --------------------------------------------------------------------------------

    def reset(self) -> None:
        """Empty the cache (the whole context: a context of one request)."""
        self.ctx.clear()
        self.tokens = []
        self.pending = []
        self._scratch_used = np.zeros(0, dtype=np.int32)
        self.check()

    def truncate(self, n_keep: int) -> None:
        """Keep the first ``n_keep`` committed tokens, drop the rest (checked)."""
        if n_keep < 0 or n_keep > self.n_past:
            raise ValueError(f"truncate({n_keep}) with {self.n_past} tokens committed")
        self.pending = []
        # Also drops the cells of a tree that was decoded but never committed (a step that
        # raised between the decode and the commit, e.g. a GrammarError in verification).
        for s in self._scratch_used:
            self._drop_seq(int(s), 0)
        self._drop_seq(self.base, n_keep)
        del self.tokens[n_keep:]
        self.check()

    def _drop_seq(self, seq: int, p0: int) -> None:
        if self.junk is not None:
            self.ctx.seq_cp(seq, self.junk, p0, -1)
        self.ctx.seq_rm(seq, p0, -1)

    def prefill(self, tokens: Sequence[int], *, on_chunk=None) -> None:
        """Append ``tokens`` to the sequence in chunks of ``n_batch`` (no logits requested).

        Args:
            on_chunk: optional callback ``(n_done, n_total)`` after each chunk.
        Raises:
            ContextOverflowError: the tokens do not fit; nothing is appended.
            DecodeError: a chunk failed; the cache is rolled back to its previous length.
        """
        tokens = list(tokens)
        self.pending = []
        if self.n_past + len(tokens) > self.n_ctx:
            raise ContextOverflowError(f"{self.n_past + len(tokens)} tokens do not fit in the context of {self.n_ctx}")
        if self._prefill_batch is None:
            self._prefill_batch = Batch(self.ctx.n_batch, 1)
        n0 = self.n_past
        step = self._prefill_batch.capacity
        try:
            for i in range(0, len(tokens), step):
                chunk = tokens[i : i + step]
                self._prefill_batch.set_sequence(chunk, self.n_past, output="none", seq_id=self.base)
                with self.ctx.abortable():
                    self.ctx.decode(self._prefill_batch)
                self.tokens.extend(chunk)
                if on_chunk is not None:
                    on_chunk(i + len(chunk), len(tokens))
        except BaseException:
            self._drop_seq(self.base, n0)
            del self.tokens[n0:]
            self.check()
            raise
        self.check()

    def rows(self, tree: TokenTree, n_pending: int | None = None) -> TreeRows:
        """Lay out the next ``n_pending`` pending tokens (default all; no logits) and ``tree``
        (root at ``root_pos``) as rows of a batch, and copy the committed prefix to the
        tree's scratch sequences. Decode them, then ``commit`` (or ``drop`` on failure).

        Raises:
            ValueError / ContextOverflowError: the tree is too large, has more leaves than
                scratch sequences, or does not fit.
        """
        n = tree.n_nodes
        m = len(self.pending) if n_pending is None else n_pending
        if n > self.max_tree_nodes:
            raise ValueError(f"tree of {n} nodes exceeds max_tree_nodes={self.max_tree_nodes}")
        if n + m > self.n_ctx - self.n_past:
            raise ContextOverflowError(f"tree of {n} nodes does not fit: {self.n_free} KV cells free")
        lay = layout_tree(tree, self.n_past + m)
        if not lay.uses_seq0:
            if int(lay.leaf_seq.max()) > self.n_scratch:
                raise ValueError(f"tree has {lay.leaf_seq.size} leaves but the request has {self.n_scratch} scratch sequences")
            for s in lay.leaf_seq:
                self.ctx.seq_cp(self.base, self.base + int(s), -1, -1)
            self._scratch_used = (lay.leaf_seq + self.base).astype(np.int32)
        tokens, pos, seq_sets, n_seq = tree.token_ids.astype(np.int32), lay.pos, lay.seq_sets, lay.n_seq
        output = np.ones(n, dtype=np.int8)
        if m:  # pending tokens: a chain in front of the root, in every sequence the root is in
            tokens = np.concatenate([np.asarray(self.pending[:m], dtype=np.int32), tokens])
            pos = np.concatenate([np.arange(self.n_past, self.n_past + m, dtype=np.int32), pos])
            seq_sets = np.concatenate([np.repeat(seq_sets[:1], m, axis=0), seq_sets])
            n_seq = np.concatenate([np.repeat(n_seq[:1], m), n_seq])
            output = np.concatenate([np.zeros(m, dtype=np.int8), output])
        return TreeRows(lay, tokens, pos, (seq_sets + self.base).astype(np.int32), n_seq.astype(np.int32), output, m)

    def prompt_rows(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """``(tokens, pos)`` [n] int32 of the next ``n`` pending prompt tokens (sequence
        ``base``, no logits), for a batch that prefills them; ``advance(n)`` once decoded."""
        return (np.asarray(self.pending[:n], dtype=np.int32),
                np.arange(self.n_past, self.n_past + n, dtype=np.int32))  # fmt: skip

    def advance(self, n: int) -> None:
        """The next ``n`` pending tokens were decoded into the sequence (checked)."""
        self.tokens.extend(self.pending[:n])
        del self.pending[:n]
        self.check()

    def decode_tree(self, tree: TokenTree) -> tuple[TreeLayout, np.ndarray]:
        """Decode the pending tokens (no logits) and ``tree`` in one batch of their own.

        Returns the layout and the logits view ``[n_nodes, n_vocab] float32`` (row i = node i),
        valid until the next decode. On failure the cache is restored and the error raised.
        """
        r = self.rows(tree)
        if self._tree_batch is None:
            self._tree_batch = Batch(max(2 * self.max_tree_nodes, 1), max(self.ctx.n_seq_max, 1))
        if r.tokens.size > self._tree_batch.capacity:
            self.drop(r.lay)
            raise ValueError(f"tree of {tree.n_nodes} nodes and {r.n_pending} pending tokens exceed the batch")
        self._tree_batch.set_tree(r.tokens, r.pos, r.seq_sets, r.n_seq, r.output)
        try:
            self.ctx.decode(self._tree_batch)
        except BaseException:
            self.drop(r.lay)
            raise
        return r.lay, self.ctx.logits()

    def drop(self, lay: TreeLayout) -> None:
        """Undo a tree's rows that were laid out (and maybe decoded) but not committed."""
        for s in lay.leaf_seq:
            if s != 0:
                self._drop_seq(self.base + int(s), 0)
        self._drop_seq(self.base, self.n_past)
        self.check()

    def commit(self, tree: TokenTree, lay: TreeLayout, path: Sequence[int]) -> None:
        """Keep the KV of the pending tokens, the root and the accepted nodes ``path`` (root
        excluded) in the request's sequence; drop (free or junk) the rest of the step's cells.

        Accepted nodes whose cells do not directly follow the root's (``commit_plan``) become
        ``pending`` and are decoded again at the front of the next batch, so cells stay in
        position order. ``check()`` verifies the cache afterwards.
        """
        path = [int(x) for x in path]
        n_contig = commit_plan(path)
        n_past = self.n_past
        keep_len = n_past + len(self.pending) + 1 + n_contig
        if lay.uses_seq0:
            self._drop_seq(self.base, keep_len)
        else:
            leaf = self.base + int(lay.node_leaf_seq[path[-1] if path else 0])
            self.ctx.seq_cp(leaf, self.base, n_past, keep_len)
            for j in lay.leaf_seq:
                self._drop_seq(self.base + int(j), n_past)
                self.ctx.seq_rm(self.base + int(j), -1, -1)
        self.tokens.extend(self.pending)
        self.tokens.append(int(tree.token_ids[0]))
        self.tokens.extend(int(tree.token_ids[i]) for i in path[:n_contig])
        self.pending = [int(tree.token_ids[i]) for i in path[n_contig:]]
        self.n_redecoded += len(self.pending)
        self.check()
