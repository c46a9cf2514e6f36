"""``SequenceCache``: the committed token sequence in KV seq 0, edited only through checked steps.

Every edit ends with ``check()``, which reads the cache's position range for seq 0 (and for
every scratch sequence a tree used) through ``llama_memory_seq_pos_min/max`` and raises
``KVCacheError`` when it is not exactly ``[0, n_past)``. llama.cpp's own return values are not
trusted: ``seq_rm`` returns true even when a window-sized SWA cache has already dropped the
cells a rollback needs.

KV cells are kept in position order. llama.cpp's CPU attention accumulates over cells in
cell order, so a cache whose cells are out of position order computes (slightly) different
numbers than plain decoding. A tree's nodes occupy cells in node order; when the accepted
path is not the first nodes of the tree (another branch came first), only its leading run of
consecutive nodes is committed, and the rest of the accepted tokens become ``pending``: they
are decoded again, without logits, at the front of the next batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import ContextOverflowError, KVCacheError
from ..tree import TokenTree
from .tree_layout import TreeLayout, layout_tree
from .batch import Batch
from .context import Context


class SequenceCache:
    """The committed tokens of one context's sequence 0, and the tree decodes on top of it.

    Attributes:
        tokens: the token ids whose KV cells are in seq 0, in position order
            (``len(tokens) == n_past``).
    """

    def __init__(self, ctx: Context, *, max_tree_nodes: int = 64) -> None:
        self.ctx = ctx
        self.tokens: list[int] = []
        self.pending: list[int] = []  # accepted tokens not in the cache yet (decoded next)
        self.n_redecoded = 0  # accepted tokens decoded again to keep cells in position order
        self.max_tree_nodes = int(max_tree_nodes)
        self._prefill_batch = Batch(ctx.n_batch, 1)
        self._tree_batch = Batch(max(2 * self.max_tree_nodes, 1), max(ctx.n_seq_max, 1))
        self._scratch_seqs: np.ndarray = np.zeros(0, dtype=np.int32)

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
        return self.ctx.n_ctx - self.root_pos

    # -- checks -------------------------------------------------------------------------------

    def check(self) -> None:
        """Raise ``KVCacheError`` unless seq 0 holds exactly positions ``[0, n_past)`` and no
        scratch sequence holds anything."""
        ctx = self.ctx
        n = self.n_past
        lo, hi = ctx.pos_min(0), ctx.pos_max(0)
        want_lo, want_hi = (0, n - 1) if n else (-1, -1)
        if lo != want_lo or hi != want_hi:
            raise KVCacheError(
                f"KV cache of seq 0 holds positions [{lo}, {hi}] but {n} tokens are committed "
                f"(expected [{want_lo}, {want_hi}]); a rollback lost cells. Is the context created "
                "with swa_full=True?"
            )
        for s in self._scratch_seqs:
            if ctx.pos_max(int(s)) != -1:
                raise KVCacheError(f"scratch sequence {int(s)} still holds cells after a commit")

    # -- edits --------------------------------------------------------------------------------

    def reset(self) -> None:
        """Empty the cache."""
        self.ctx.clear()
        self.tokens = []
        self.pending = []
        self._scratch_seqs = np.zeros(0, dtype=np.int32)
        self.check()

    def truncate(self, n_keep: int) -> None:
        """Keep the first ``n_keep`` committed tokens, drop the rest (checked)."""
        if n_keep < 0 or n_keep > self.n_past:
            raise ValueError(f"truncate({n_keep}) with {self.n_past} tokens committed")
        self.pending = []
        # Also drops the cells of a tree that was decoded but never committed (a step that
        # raised between decode_tree and commit, e.g. a GrammarError in verification).
        for s in self._scratch_seqs:
            if s != 0:
                self.ctx.seq_rm(int(s), -1, -1)
        self.ctx.seq_rm(0, n_keep, -1)
        del self.tokens[n_keep:]
        self.check()

    def prefill(self, tokens: Sequence[int], *, on_chunk=None) -> None:
        """Append ``tokens`` to seq 0 in chunks of ``n_batch`` (no logits requested).

        Args:
            on_chunk: optional callback ``(n_done, n_total)`` after each chunk.
        Raises:
            ContextOverflowError: the tokens do not fit; nothing is appended.
            DecodeError: a chunk failed; the cache is rolled back to its previous length.
        """
        tokens = list(tokens)
        self.pending = []
        if self.n_past + len(tokens) > self.ctx.n_ctx:
            raise ContextOverflowError(
                f"{self.n_past + len(tokens)} tokens do not fit in the context of {self.ctx.n_ctx}"
            )
        n0 = self.n_past
        step = self._prefill_batch.capacity
        try:
            for i in range(0, len(tokens), step):
                chunk = tokens[i : i + step]
                self._prefill_batch.set_sequence(chunk, self.n_past, output="none")
                with self.ctx.abortable():
                    self.ctx.decode(self._prefill_batch)
                self.tokens.extend(chunk)
                if on_chunk is not None:
                    on_chunk(i + len(chunk), len(tokens))
        except BaseException:
            self.ctx.seq_rm(0, n0, -1)
            del self.tokens[n0:]
            self.check()
            raise
        self.check()

    def decode_tree(self, tree: TokenTree) -> tuple[TreeLayout, np.ndarray]:
        """Decode the pending tokens (no logits) and ``tree`` (root at ``root_pos``) in one batch.

        Returns the layout and the logits view ``[n_nodes, n_vocab] float32`` (row i = node i),
        valid until the next decode. On failure the cache is restored and the error raised.
        """
        n = tree.n_nodes
        m = len(self.pending)
        if n + m > self._tree_batch.capacity or n > self.max_tree_nodes:
            raise ValueError(f"tree of {n} nodes exceeds max_tree_nodes={self.max_tree_nodes}")
        if n + m > self.ctx.n_ctx - self.n_past:
            raise ContextOverflowError(f"tree of {n} nodes does not fit: {self.n_free} KV cells free")
        lay = layout_tree(tree, self.root_pos)
        if not lay.uses_seq0:
            if int(lay.leaf_seq.max()) >= self.ctx.n_seq_max:
                raise ValueError(
                    f"tree has {lay.leaf_seq.size} leaves but the context has n_seq_max={self.ctx.n_seq_max}"
                )
            for s in lay.leaf_seq:
                self.ctx.seq_cp(0, int(s), -1, -1)
            self._scratch_seqs = lay.leaf_seq
        if m:
            # pending tokens: a chain in front of the root, in every sequence the root is in
            tokens = np.concatenate([np.asarray(self.pending, dtype=np.int32), tree.token_ids])
            pos = np.concatenate([np.arange(self.n_past, self.n_past + m, dtype=np.int32), lay.pos])
            k = lay.seq_sets.shape[1]
            seq_sets = np.concatenate([np.repeat(lay.seq_sets[:1], m, axis=0), lay.seq_sets]).reshape(-1, k)
            n_seq = np.concatenate([np.repeat(lay.n_seq[:1], m), lay.n_seq])
            output = np.concatenate([np.zeros(m, dtype=np.int8), np.ones(n, dtype=np.int8)])
            self._tree_batch.set_tree(tokens, pos, seq_sets, n_seq, output)
        else:
            self._tree_batch.set_tree(tree.token_ids, lay.pos, lay.seq_sets, lay.n_seq)
        try:
            self.ctx.decode(self._tree_batch)
        except BaseException:
            self._drop_tree(lay)
            raise
        return lay, self.ctx.logits()

    def _drop_tree(self, lay: TreeLayout) -> None:
        for s in lay.leaf_seq:
            if s != 0:
                self.ctx.seq_rm(int(s), -1, -1)
        self.ctx.seq_rm(0, self.n_past, -1)
        self.check()

    def commit(self, tree: TokenTree, lay: TreeLayout, path: Sequence[int]) -> None:
        """Keep the KV of the pending tokens, the root and the accepted nodes ``path`` (root
        excluded); drop the rest.

        Accepted nodes whose cells do not directly follow the root's (an earlier branch sits
        between them) are not kept: they become ``pending`` and are decoded again at the
        front of the next batch, so cells stay in position order. ``check()`` verifies the
        cache afterwards.
        """
        path = [int(x) for x in path]
        n_contig = 0
        while n_contig < len(path) and path[n_contig] == n_contig + 1:
            n_contig += 1
        m = len(self.pending)
        keep_len = self.n_past + m + 1 + n_contig
        last = path[-1] if path else 0
        if lay.uses_seq0:
            self.ctx.seq_rm(0, keep_len, -1)
        else:
            seq = int(lay.node_leaf_seq[last])
            self.ctx.seq_keep(seq)  # only the prefix + the leaf's path survive, tagged `seq`
            self.ctx.seq_rm(seq, keep_len, -1)  # cut after the last kept node
            self.ctx.seq_cp(seq, 0, -1, -1)
            self.ctx.seq_rm(seq, -1, -1)
        self.tokens.extend(self.pending)
        self.tokens.append(int(tree.token_ids[0]))
        self.tokens.extend(int(tree.token_ids[i]) for i in path[:n_contig])
        self.pending = [int(tree.token_ids[i]) for i in path[n_contig:]]
        self.n_redecoded += len(self.pending)
        self.check()
