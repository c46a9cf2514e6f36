"""MTP / NextN drafting: the target's own multi-token-prediction block(s) draft its trees.

Models such as DeepSeek-V3 (Liu et al. 2024, arXiv 2412.19437, "Multi-Token Prediction"),
GLM-4.5 and Qwen3-Next are trained with one or more extra transformer blocks after the
trunk (GGUF: ``blk.{n_layer + i}.nextn.*``, ``{arch}.nextn_predict_layers``). The block at
position ``p`` reads the embedding of token ``x_p`` and the target's hidden state ``h_{p-1}``
(the state from which the target predicted ``x_p``), and predicts ``x_{p+1}``:

    h'_p   = block( eh_proj( [enorm(embed(x_p)); hnorm(h_{p-1})] ) )   (attention over the
                                                                     block's own KV of 0..p)
    logits = lm_head( shared_head_norm(h'_p) )

llama.cpp runs it in a context of type ``LLAMA_CONTEXT_TYPE_MTP`` over a model loaded with
``load_mtp``: its graph (``src/models/<arch>.cpp``, ``graph_mtp``) runs only the NextN block,
with its own KV cache holding only that layer. The conventions below are llama.cpp's own
(``common/speculative.cpp``, ``common_speculative_impl_draft_mtp``, the server's
``draft-mtp``):

* the target context outputs its ``h_nextn`` row for **every** batch token
  (``llama_set_embeddings_nextn(ctx_tgt, true, masked=false)``; ``backend.features.NextnTap``);
* the MTP context's entry at position ``p`` is the token ``x_p`` with ``h_{p-1}`` as its
  embedding row (``llama_batch_ext_set_embd_token``; the ``set_embd_state`` API is an
  unimplemented stub in this llama.cpp, ``src/llama-batch.cpp``), position 0 with a zero row;
  the MTP KV (here: the request's sequence ``seq0``) holds an entry for every committed position;
* drafting a chain: the root's entry ``(root, h_{root_pos-1})`` gives the first draft's
  logits and the block's own output state ``h'`` (``llama_get_embeddings_nextn_ith`` of the
  MTP context, masked = output rows); each further step feeds the drafted token with the
  ``h'`` of its parent at the next position. One NextN block is reused at every depth (as
  llama.cpp's driver does for single-block models).

This drafter grows **trees** from that recursion, one MTP call per level (``expand_tree``):
every frontier node is an entry (its token, the ``h'`` of its parent) at position
``root_pos + depth`` in its own scratch sequence (``SeqSlots``: the committed prefix + its
path), and the top-k / sampled children of each node come from its row exactly as for the
other model drafters (``DraftChildSelector``: greedy, seeded Gumbel, or i.i.d. draws from the
processed MTP distribution recorded as the node's draft distribution for rejection
sampling). Scores are the calibrated acceptance estimates of ``DraftCalibration``.

How the engine and the block work together (mirrors ``drafters.eagle3``)::

    target decode (prefill chunk or verified tree) -> NextnTap: h rows of every batch token
    engine: add_target_features(first_pos, rows of the committed tokens only)
    level 0 (one call): the catch-up entries (x_p, h_{p-1}) of every committed position the
            block has not seen, the last one the root's, with output -> root's children, h'
    level d (one call): the frontier's entries in scratch sequences -> children, h'

In a batch the slots' drafters share the loaded block and one MTP context (``spawn``,
``level_drafter.DraftHub``): each level's call holds the entries of every request drafting in
the step (a catch-up longer than ``CATCH_UP_OUTPUTS`` decodes its head in calls of its own).

Output rows: the MTP graphs take ``t_h_nextn`` *before* selecting the output rows
(``src/models/glm4-moe.cpp``: ``res->t_h_nextn = cur`` then ``ggml_get_rows(.., inp_out_ids)``)
while the masked extraction copies the first ``n_outputs`` rows (``src/llama-context.cpp``,
"extract nextn embeddings"), so a call has every row out or none: a catch-up of at most
``CATCH_UP_OUTPUTS`` entries is one call with every row out, a longer one (after a prompt)
decodes its head without outputs first.

Refused targets (``ModelLoadError`` at ``attach``, one line): no MTP blocks
(``nextn_predict_layers`` absent or 0); a GGUF that declares them but holds no tensor of
block ``n_layer`` (converted without its MTP layers); recurrent / hybrid (linear-attention)
targets such as Qwen3-Next and Qwen3.5, whose recurrent state cannot be rolled back with the
KV cache (see ``refuse_recurrent``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..backend import Model
from ..backend._llama import ext, lib
from ..backend.batch_ext import ExtBatch
from ..backend.features import NEXTN_FEATURES
from ..errors import ModelLoadError
from ..policy import TreeShape
from ..tree import TokenSource, TreeBuilder
from .base import TargetHandle
from ..backend.kv import common_prefix
from .level_drafter import LevelPart, ModelDrafter, StateFedLevels, _Family
from .target_features import TargetFeatureBuffer

CATCH_UP_OUTPUTS = 16
"""Longest catch-up decoded in the same call as the root's entry (every row an output)."""


def nextn_key(model: Model) -> str:
    """The metadata key that declares MTP blocks: ``{arch}.nextn_predict_layers``."""
    return f"{model.architecture}.nextn_predict_layers"


def check_mtp_target(model: Model) -> None:
    """Raise ``ModelLoadError`` (one line) unless ``model`` can draft with its MTP blocks here.

    Raises:
        ModelLoadError: no MTP blocks; MTP blocks declared but absent from the file; or a
            recurrent / hybrid target (``refuse_recurrent``).
    """
    name = Path(model.path).name
    key = nextn_key(model)
    if model.n_layer_nextn <= 0:
        value = model.meta(key)
        raise ModelLoadError(
            f"the mtp drafter: {name} has no MTP / NextN blocks ({key} is {value if value is not None else 'absent'}); "
            "use a model converted with its MTP layers (e.g. GLM-4.5, DeepSeek-V3, Qwen3-Next) or another drafter"
        )
    refuse_recurrent(model)
    _check_nextn_tensors(model)


def mtp_capable(model: Model) -> bool:
    """True when ``check_mtp_target(model)`` passes (``--drafter auto`` then uses the block)."""
    if getattr(model, "n_layer_nextn", 0) <= 0:
        return False
    try:
        check_mtp_target(model)
    except ModelLoadError:
        return False
    return True


def refuse_recurrent(model: Model) -> None:
    """Refuse targets with recurrent or linear-attention layers (Mamba, RWKV, and hybrids such
    as Qwen3-Next / Qwen3.5's Gated DeltaNet layers).

    Why refused, not rolled back: a token tree is verified as sibling sequences over a shared
    prefix and a rejected branch is dropped with ``llama_memory_seq_rm`` / ``seq_keep``
    (``backend.kv.SequenceCache.commit``). llama.cpp's recurrent memory keeps one state per
    sequence, not one per position: it cannot erase the tail of a state
    (``src/llama-memory-recurrent.cpp``, ``seq_rm``: "models like Mamba or RWKV can't have a
    state partially erased") except through ``n_rs_seq`` per-sequence snapshots of a single
    chain, and a tree needs the state of every node. The target's own plain-decoding cache
    checks would fail the same way, so such targets are refused for every tree drafter here.

    Raises:
        ModelLoadError: the model is recurrent or hybrid.
    """
    if lib.llama_model_is_recurrent(model.handle) or lib.llama_model_is_hybrid(model.handle):
        raise ModelLoadError(
            f"the mtp drafter: {Path(model.path).name} ({model.architecture}) has recurrent / linear-attention layers, "
            "whose state llama.cpp cannot roll back per tree node (src/llama-memory-recurrent.cpp seq_rm); "
            "such targets are not supported"
        )


def _check_nextn_tensors(model: Model) -> None:
    """A GGUF converted without its MTP layers keeps the metadata but not the tensors; llama.cpp
    would then assert (abort) in the MTP graph. Single-file GGUFs only (shards are not read)."""
    from ..models.gguf_index import GGUFIndex

    try:
        idx = GGUFIndex(model.path)
    except (OSError, ValueError):
        return
    if int(idx.values.get("split.count", 1) or 1) > 1:
        return
    prefix = f"blk.{model.n_layer}."
    if not any(n.startswith(prefix) for n in idx.tensors):
        raise ModelLoadError(
            f"the mtp drafter: {Path(model.path).name} declares {model.n_layer_nextn} MTP block(s) ({nextn_key(model)}) "
            f"but holds no {prefix}* tensors (converted without its MTP layers?)"
        )


class MtpDrafter(StateFedLevels, ModelDrafter):
    """Drafts token trees with the target's own MTP / NextN block (module docstring).

    The drafter is made without a model: ``attach`` checks the target (``check_mtp_target``)
    and loads its GGUF a second time with ``load_mtp`` (or uses the target's ``Model`` when it
    was loaded with ``load_mtp``) to create the MTP context. On the CPU both loads map the
    same file pages.

    Args:
        n_gpu_layers: for the MTP context's model on CUDA / Metal builds (llama.cpp offloads
            the last layers: 2 = the NextN block and the output layer; untested here).
        max_depth / max_width / shape: see ``ModelDrafter``.
    Raises:
        ModelLoadError: (at ``attach``) the target cannot draft with MTP blocks.
    """

    name = "mtp"
    source = TokenSource.DRAFT_MODEL  # the target's own draft block (no source of its own yet)
    target_feature_layers = (NEXTN_FEATURES,)
    state_pos_offset = 0  # a node at depth d is the entry at root_pos + d

    def __init__(
        self,
        *,
        n_gpu_layers: int = 0,
        max_depth: int = 8,
        max_width: int = 8,
        shape: TreeShape | None = None,
    ) -> None:
        # ModelDrafter's state, without a model until attach (then shared with its spawn)
        self.model: Model | None = None
        self._family = _Family(None, False)
        self.n_gpu_layers = n_gpu_layers
        self.max_depth = max_depth
        self.max_width = max_width
        self.fixed_shape = shape
        self.batch: ExtBatch | None = None
        self.n_embd = 0
        self._init_request_state()

    def _init_request_state(self) -> None:
        super()._init_request_state()
        self.batch = None
        self._reset_state()

    def _reset_state(self) -> None:
        self.kv_len = 0  # MTP KV seq0 holds entries of positions 0 .. kv_len - 1
        self.h = TargetFeatureBuffer(self.n_embd, "the MTP drafter")  # the target's h rows
        self._state: dict[int, np.ndarray] = {}  # tree node -> the block's output state h'

    @property
    def n_target_features(self) -> int:
        """Positions ``0 .. n - 1`` of the history whose target h rows the drafter has (or
        has used): the engine re-decodes from there when a new prompt reuses the cache."""
        return self.h.end

    # -- attach --------------------------------------------------------------------------------

    def check_target(self, model: Model) -> None:
        """Called by the engine before it changes anything: ``check_mtp_target``."""
        check_mtp_target(model)

    def attach(self, target: TargetHandle) -> None:
        """Check the target, load its MTP block and create the MTP context."""
        tm = target.model
        check_mtp_target(tm)
        if target.features is None or tuple(target.features.layers) != self.target_feature_layers:
            raise RuntimeError("the engine must capture the target's nextn hidden states (target_feature_layers)")
        self._leave_hub()
        fam = self._family
        if getattr(tm, "load_mtp", False):
            self.model = tm
        else:  # loaded again by a drafter alone (a reconnect), once for a drafter and its spawn
            if fam.n_users <= 1 or fam.model is None or fam.model.path != tm.path:
                if fam.owns_model and fam.model is not None and fam.n_users <= 1:
                    fam.model.close()
                fam.model = Model(tm.path, n_gpu_layers=self.n_gpu_layers, load_mtp=True)
                fam.owns_model = True
            self.model = fam.model
        self.n_embd = self.model.n_embd_out
        if self.n_embd != tm.n_embd_out:  # pragma: no cover - same file
            raise ModelLoadError("the MTP model's hidden size differs from the target's")
        self.bind(target, n_ctx=target.n_ctx, mtp=True)
        ext.llama_set_embeddings_nextn(self.ctx.handle, True, True)  # h' of the output rows
        if self.batch is not None:
            self.batch.close()
        self.batch = ExtBatch(self.ctx.handle)  # this request's own calls (a long catch-up)
        self._reset_state()

    # -- protocol (besides ModelDrafter's) ------------------------------------------------------

    def begin(self, history: Sequence[int], context: Sequence[Sequence[int]] = ()) -> None:
        """Keep the entries and h rows that the new history shares with the old one."""
        common = common_prefix(self.history, history)
        # entries p < keep_kv stay; the root's entry (p = len(history) - 1) is always rewritten
        keep_kv = min(self.kv_len, common, max(0, len(history) - 1))
        if self.ctx is not None and keep_kv < self.kv_len:
            self._truncate_kv(keep_kv)
        n_h = min(self.n_target_features, common)
        if keep_kv >= 1 and keep_kv - 1 < self.h.first:
            # the h row the next entry needs was dropped: have the engine decode it again
            n_h = min(n_h, keep_kv - 1)
        self.h.truncate(n_h)
        super().begin(history, context)

    def add_target_features(self, first_pos: int, rows: np.ndarray) -> None:
        """The target's h rows of positions ``first_pos, first_pos + 1, ...`` ([n, n_embd]
        float32); rows of positions the drafter already has are ignored.

        Raises:
            ValueError: a gap (positions between what the drafter has and ``first_pos``).
        """
        self.h.add(first_pos, rows)

    def ready(self) -> bool:
        root_pos = len(self.history) - 1
        return self.ctx is not None and root_pos >= 0 and self.n_target_features >= root_pos

    def check_cache(self) -> None:
        """Raise ``KVCacheError`` unless the MTP KV ``seq0`` holds exactly ``[0, kv_len)``."""
        self.ctx.expect_positions(self.seq0, self.kv_len, "the MTP block's KV")

    def close(self) -> None:
        if getattr(self, "batch", None) is not None:
            self.batch.close()
            self.batch = None
        super().close()
        self.model = None

    # -- levels on the (shared) MTP context (``StateFedLevels``) -------------------------------

    def level_part(self, tree: TreeBuilder, nodes: list[int]) -> LevelPart:
        """Level 0: the catch-up (``_catch_up_part``); level d: each frontier node's entry (its
        token, the block's output state h' of its parent) at position ``root_pos + depth``.
        Rows: [len(nodes), n_vocab] float32."""
        if nodes == [0]:
            return self._catch_up_part(tree.tokens[0])
        return self._frontier_part(tree, nodes)

    def _level_rows(self, logits: np.ndarray) -> np.ndarray:
        return logits

    def _h_row(self, p: int) -> np.ndarray:
        """The input state of entry ``p``: the target's ``h_{p-1}`` (zeros at position 0)."""
        if p == 0:
            return np.zeros(self.n_embd, dtype=np.float32)
        return self.h.row(p - 1)

    def _catch_up_part(self, root: int) -> LevelPart:
        """The entries of every committed position up to the root's, the last one with output:
        the last ``CATCH_UP_OUTPUTS`` of them (every row out) go into the level decode, a
        longer catch-up's head into calls of its own before it. The part's rows: the root's
        ([1, n_vocab]); it keeps the block's state h'."""
        root_pos = len(self.history) - 1
        if self.kv_len > root_pos:  # asked twice for the same root: redo its entry
            self._truncate_kv(root_pos)
        first = self.kv_len
        n = root_pos + 1 - first
        b = self.batch
        n_batch = self.ctx.n_batch
        tail = min(n, CATCH_UP_OUTPUTS, n_batch)
        for i0 in range(first, root_pos + 1 - tail, n_batch):  # a long catch-up: no outputs
            b.clear()
            for p in range(i0, min(i0 + n_batch, root_pos + 1 - tail)):
                b.add(token=self.history[p], pos=p, seq_id=self.seq0, output=False, embd=self._h_row(p))
            self.ctx.process(b)
        entries = [dict(token=self.history[p] if p < root_pos else root, pos=p, seq_id=self.seq0, output=True,
                        embd=self._h_row(p)) for p in range(root_pos + 1 - tail, root_pos + 1)]  # fmt: skip

        def finish(logits, out0):
            self.kv_len = root_pos + 1
            self.h.drop_before(max(0, root_pos - 1))  # keep h_{root_pos-1}: to redo the root's entry
            self._state = {0: self._out_state(out0 + tail - 1)}
            return logits[tail - 1 : tail]

        return LevelPart(entries, tail, finish)

    def _truncate_kv(self, n: int) -> None:
        self.ctx.seq_rm(self.seq0, n, -1)
        self.kv_len = n
        self.check_cache()


__all__ = ["MtpDrafter", "check_mtp_target", "mtp_capable", "nextn_key", "refuse_recurrent", "CATCH_UP_OUTPUTS"]
