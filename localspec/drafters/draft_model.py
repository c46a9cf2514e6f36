"""A standalone GGUF draft model that shares the target's tokenizer.

The draft has its own ``Model``, ``Context`` and ``SequenceCache`` (KV seq 0 holds the
history the draft has seen, checked after every edit like the target's). Each step it grows
a dynamic tree (``tree_expand``) one batched draft decode per level:

* level 0 decodes the tokens the draft has not seen yet (the tokens emitted since its last
  step) and the root in one batch, logits for the root only, and commits them to seq 0;
* every further level decodes the frontier nodes in one multi-sequence batch, each node in
  its own scratch sequence forked from its parent's (``backend.SeqSlots``); all scratch
  sequences are dropped when the tree is done, so the draft's KV never holds rejected
  tokens.

**Small draft contexts.** The draft's context may be smaller than the target's. Its KV holds
``history[offset:]`` at draft positions ``0, 1, ...``; when the history no longer fits (with
room for a tree), the window slides: the cache is emptied and the last ``n_ctx / 2`` tokens
are prefilled again. So the draft sees only the recent tail of a long history, the cost of
a slide is bounded by ``n_ctx / 2`` tokens, and it happens at most once every ``n_ctx / 2``
tokens (one re-prefilled token per generated token on average, at worst). Absolute target
positions (for the per-position random streams) are unaffected.
"""

from __future__ import annotations

import os

import numpy as np

from ..backend import Batch, Model, SequenceCache
from ..backend.kv import common_prefix
from ..errors import InvalidRequestError
from ..policy import TreeShape
from ..tree import TokenSource, TokenTree, TreeBuilder
from .base import TargetHandle
from .level_drafter import ModelDrafter
from .vocab_check import check_vocab


class DraftModelDrafter(ModelDrafter):
    """Drafts dynamic token trees with a small GGUF model (see the module docstring).

    Args:
        model: a GGUF path or a loaded ``Model`` (a loaded one is not closed by the drafter).
        n_ctx: the draft's context in tokens (default: the target's, at most the draft's
            training context). Smaller contexts see only the recent history.
        n_gpu_layers: draft layers to offload on CUDA / Metal builds.
        max_depth / max_width / shape: see ``ModelDrafter``.
    Raises:
        ModelLoadError: the GGUF cannot be loaded.
        VocabMismatchError: (at ``attach``) the vocabularies differ.
        InvalidRequestError: (at ``attach``) a context too small for the tree shapes.
    """

    name = "draft"
    source = TokenSource.DRAFT_MODEL

    def __init__(
        self,
        model: Model | str | os.PathLike,
        *,
        n_ctx: int | None = None,
        n_gpu_layers: int = 0,
        max_depth: int = 8,
        max_width: int = 8,
        shape: TreeShape | None = None,
    ) -> None:
        super().__init__(model, n_gpu_layers=n_gpu_layers, max_depth=max_depth, max_width=max_width, shape=shape)
        self.n_ctx_request = n_ctx
        self.offset = 0  # history index at draft position 0
        self._root_dpos = 0  # draft position of the current root

    def attach(self, target: TargetHandle) -> None:
        """Check the vocabulary against the target and create the draft context."""
        self.vocab = check_vocab(target.model, self.model)
        n_ctx = self.n_ctx_request or min(target.n_ctx, self.model.n_ctx_train or target.n_ctx)
        if n_ctx < 2 * self.n_slots + 64:
            raise InvalidRequestError(
                f"a draft context of {n_ctx} tokens is too small for trees of depth {self.max_depth} and "
                f"width {self.max_width}: give it at least {2 * self.n_slots + 64} tokens"
            )
        self.bind(target, n_ctx=n_ctx)
        self.cache = SequenceCache(self.ctx, max_tree_nodes=32)
        self._level_batch = Batch(self.max_width, 1)
        self.offset = 0

    def check_cache(self) -> None:
        self.cache.check()

    # -- LevelDecoder -------------------------------------------------------------------------

    def decode_level(self, tree: TreeBuilder, nodes: list[int]) -> np.ndarray:
        """Draft logits after ``nodes`` ([len(nodes), n_vocab] float32; see ``tree_expand``)."""
        if nodes == [0]:
            return self._decode_root(tree.tokens[0])
        b = self._level_batch
        tokens = np.array([tree.tokens[n] for n in nodes], dtype=np.int32)
        pos = np.array([self._root_dpos + tree.depth[n] for n in nodes], dtype=np.int32)
        seqs = np.array([[self.fork(tree.parents[n], n)] for n in nodes], dtype=np.int32)
        b.set_tree(tokens, pos, seqs, np.ones(len(nodes), dtype=np.int32))
        self.ctx.decode(b)
        return self._rows(self.ctx.logits())

    def _decode_root(self, root: int) -> np.ndarray:
        """Bring seq 0 up to the root (sliding the window if needed) and decode the root."""
        cache = self.cache
        n_before_root = len(self.history) - 1  # = the root's absolute position
        room = self.ctx.n_ctx - self.n_slots  # cells for history[offset : root + 1]
        if n_before_root + 1 <= room:
            offset = 0
        elif self.offset <= n_before_root and n_before_root + 1 - self.offset <= room:
            offset = self.offset
        else:  # slide: keep the last n_ctx / 2 tokens
            offset = n_before_root + 1 - min(room, self.ctx.n_ctx // 2)
        if offset != self.offset:
            cache.reset()
            self.offset = offset
        view = self.history[self.offset : n_before_root]
        cache.truncate(common_prefix(cache.tokens, view))
        missing = view[cache.n_past :]
        n_tail = 2 * cache.max_tree_nodes - 1  # pending tokens that fit in the root's batch
        if len(missing) > n_tail:
            cache.prefill(missing[: len(missing) - n_tail])
            missing = missing[len(missing) - n_tail :]
        cache.pending = list(missing)
        t = TokenTree.root_only(root)
        lay, logits = cache.decode_tree(t)
        rows = self._rows(logits)
        cache.commit(t, lay, [])
        self._root_dpos = cache.n_past - 1
        return rows

    def _rows(self, logits: np.ndarray) -> np.ndarray:
        """Draft logits as rows over the target's vocabulary (ids only one side has: -inf)."""
        if logits.shape[1] == self.n_vocab:
            return logits
        out = np.full((logits.shape[0], self.n_vocab), -np.inf, dtype=np.float32)
        n = self.vocab.n_common
        out[:, :n] = logits[:, :n]
        return out
