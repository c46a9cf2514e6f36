"""A standalone GGUF draft model that shares the target's tokenizer.

The draft has its own ``Model``, a draft ``Context`` (shared by the drafters of a batch's
requests: ``level_drafter.DraftHub``) and a ``SequenceCache`` (its sequence ``seq0`` holds
the history the draft has seen, checked after every edit like the target's). Each step it
grows a dynamic tree (``tree_expand``) one batched draft decode per level (with the levels of
the other requests that draft in the step):

* level 0 decodes the tokens the draft has not seen yet (the tokens emitted since its last
  step) and the root in one batch, logits for the root only, and commits them to ``seq0``
  (a gap longer than ``2 * 32 - 1`` tokens, e.g. a new prompt, is prefilled first);
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
from ..backend.model import refuse_head_file
from ..errors import InvalidRequestError
from ..policy import TreeShape
from ..tree import TokenSource, TokenTree, TreeBuilder
from .base import TargetHandle
from .level_drafter import LevelPart, ModelDrafter
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
        self.n_ctx_request = n_ctx
        if not isinstance(model, Model):
            refuse_head_file(model, "a draft model")
        super().__init__(model, n_gpu_layers=n_gpu_layers, max_depth=max_depth, max_width=max_width, shape=shape)

    def attach(self, target: TargetHandle) -> None:
        """Check the vocabulary against the target and join (or create) the draft context."""
        if getattr(self, "_vocab_for", None) is not target.model:
            self.vocab = check_vocab(target.model, self.model)
            self._vocab_for = target.model
        n_ctx = self.n_ctx_request or min(target.n_ctx, self.model.n_ctx_train or target.n_ctx)
        if n_ctx < 2 * self.n_slots + 64:
            raise InvalidRequestError(
                f"a draft context of {n_ctx} tokens is too small for trees of depth {self.max_depth} and "
                f"width {self.max_width}: give it at least {2 * self.n_slots + 64} tokens"
            )
        self.bind(target, n_ctx=n_ctx)
        self.n_ctx = n_ctx
        self.cache = SequenceCache(self.ctx, base=self.seq0, n_scratch=0, n_ctx=n_ctx, max_tree_nodes=32)
        self.offset = 0

    def _init_request_state(self) -> None:
        super()._init_request_state()
        self.offset = 0  # history index at draft position 0
        self._root_dpos = 0  # draft position of the current root
        self.cache = None

    def check_cache(self) -> None:
        self.cache.check()

    # -- levels on the (shared) draft context -------------------------------------------------

    level_entries = 64  # the root's level: up to 2 * 32 - 1 tokens not yet seen, and the root

    def new_level_batch(self) -> Batch:
        return Batch(self.ctx.n_batch, 1)

    def decode_parts(self, batch: Batch, parts) -> None:
        cols = [np.concatenate([p.entries[k] for p in parts]) for k in range(5)]
        batch.set_tree(*cols)
        self.ctx.decode(batch)

    def level_part(self, tree: TreeBuilder, nodes: list[int]) -> LevelPart:
        """Level 0: the tokens the draft has not seen and the root (sequence ``seq0``, logits
        for the root only, committed there); further levels: each frontier node in its own
        scratch sequence forked from its parent's."""
        if nodes == [0]:
            return self._root_part(tree.tokens[0])
        tokens = np.array([tree.tokens[n] for n in nodes], dtype=np.int32)
        pos = np.array([self._root_dpos + tree.depth[n] for n in nodes], dtype=np.int32)
        seqs = np.array([[self.fork(tree.parents[n], n)] for n in nodes], dtype=np.int32)
        ones = np.ones(len(nodes), dtype=np.int32)
        cols = (tokens, pos, seqs, ones, ones.astype(np.int8))
        return LevelPart(cols, len(nodes), lambda logits, _: self._rows(logits))

    def _root_part(self, root: int) -> LevelPart:
        """Bring ``seq0`` up to the root's predecessor (sliding the window if needed; a long
        gap is prefilled in calls of its own) and lay out the rest and the root."""
        cache = self.cache
        n_before_root = len(self.history) - 1  # = the root's absolute position
        room = self.n_ctx - self.n_slots  # cells for history[offset : root + 1]
        if n_before_root + 1 <= room:
            offset = 0
        elif self.offset <= n_before_root and n_before_root + 1 - self.offset <= room:
            offset = self.offset
        else:  # slide: keep the last n_ctx / 2 tokens
            offset = n_before_root + 1 - min(room, self.n_ctx // 2)
        if offset != self.offset:
            cache.truncate(0)
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
        r = cache.rows(t)

        def finish(logits, _):
            rows = self._rows(logits)
            cache.commit(t, r.lay, [])
            self._root_dpos = cache.n_past - 1
            return rows

        return LevelPart((r.tokens, r.pos, r.seq_sets, r.n_seq, r.output), 1, finish, lambda: cache.drop(r.lay))

    def _rows(self, logits: np.ndarray) -> np.ndarray:
        """Draft logits as rows over the target's vocabulary (ids only one side has: -inf)."""
        if logits.shape[1] == self.n_vocab:
            return logits
        out = np.full((logits.shape[0], self.n_vocab), -np.inf, dtype=np.float32)
        n = self.vocab.n_common
        out[:, :n] = logits[:, :n]
        return out
