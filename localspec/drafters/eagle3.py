"""EAGLE-3 heads (Li et al. 2025) on llama.cpp's ``eagle3`` architecture.

An EAGLE-3 head is one decoder layer that drafts from the target's own hidden states. Its
GGUF has an encoder ``fc`` that fuses the inputs of three target layers
(``eagle3.target_layers``) into one row ``g_P`` per position, and a decoder whose entry at
position ``P`` reads the token at ``P + 1`` and ``g_P`` and predicts the token at ``P + 2``.
Two writers make such GGUFs, and both load here: the project's (``models/eagle3_gguf.py``:
trained or random heads) and llama.cpp's ``convert_hf_to_gguf.py HEAD_DIR --target-model-dir
TARGET_DIR`` (public EAGLE-repo, SpecForge or speculators checkpoints; it adds
``eagle3.vocab_size``, ``eagle3.norm_before_fc`` and, for some heads, their own
``token_embd``). Without its own token embeddings the head's context borrows the target's
through ``ctx_other``; a reduced draft vocabulary is mapped back to target ids by ``d2t``
(absolute target ids in both writers) inside llama.cpp (logits rows are target-vocabulary
wide, ``-inf`` outside the draft vocabulary). ``check_target`` refuses a head made for another
target (``target_mismatches``) before anything changes.

Two runtimes run the head's layer (``Eagle3Drafter(runtime=...)``): the project's C kernels
(``eagle3_host``: no llama.cpp context, the default where the native library is built) and
llama.cpp's ``eagle3`` graph (``"llama"``, the reference; below). Both keep the same entries
(``CONTEXT_WINDOW``) and give the same draft-vocabulary rows up to rounding.

How the engine and the head work together (the llama.cpp runtime)::

    target decode (prefill chunk or verified tree)
       └─ FeatureTap (cb_eval) captures l_out-(k-1) rows for the 3 layers
    engine: add_target_features(first_pos, rows of the committed tokens only)
    the policy plans the step (before any drafting): a tree shape, or no head call at all
    level 0 (one llama.cpp call): the encoder ``fc`` over the new feature rows -> g (numpy:
                one small matmul, no llama.cpp call), then ONE decode of the entries
                (t[P+1], g_P) of every position not yet in the head's KV ``seq0`` (the
                catch-up, all steps since the head last ran), the last one (P = root_pos - 1,
                token = the root) -> children of the root and its pre-norm state h
                (llama_get_embeddings_nextn_ith)
    level d (one llama.cpp call): the frontier nodes in scratch sequences: entry (node
                token, h of its parent) at position root_pos + depth - 1 -> children, and h

A step whose plan drafts nothing touches the head not at all: its feature rows wait, and
their entries join the next level-0 call.

Unlike llama.cpp's own driver (``common/speculative.cpp``), which keeps the head's entries for
all committed positions, the head's KV holds entries for the last ``context_window`` committed
positions at most (``CONTEXT_WINDOW``: each entry costs a full logits row in the ``eagle3``
graph, so catching up a long prompt cost more than the request's drafts could save); rejected
draft entries live only in scratch sequences and are dropped.
Entries are decoded with logits for all rows or none, because the ``eagle3`` graph does not
select output rows (a mixed batch would return the wrong rows) and positions in a batch may
not decrease: a catch-up of at most ``CATCH_UP_OUTPUTS`` entries is one call with every row
out (the rows are cheap at the draft-vocabulary width); a longer one (the first step after
a prompt) decodes its head without outputs first.

**Draft-vocabulary rows.** A head with a reduced vocabulary (``d2t``) makes llama.cpp scatter
its rows into target-wide rows (``-inf`` elsewhere). ``decode_level`` gathers them back to
the draft width ([n, len(d2t)], a few thousand columns), ``DraftChildSelector`` ranks them there
(top-k in C) and maps only the chosen ids to target ids.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from .. import native
from ..backend import Model
from ..backend.model import check_gguf_file, gguf_tensor
from ..backend._llama import ext, model_target_layer_ids, model_target_layer_ids_n
from ..backend.batch_ext import ExtBatch
from ..errors import ModelLoadError
from ..policy import TreeShape
from ..tree import TokenSource, TreeBuilder
from .base import TargetHandle
from ..backend.kv import common_prefix
from .level_drafter import LevelPart, ModelDrafter, StateFedLevels
from .target_features import TargetFeatureBuffer
from .vocab_check import check_draft_map, check_vocab


def head_target_layers(model: Model) -> tuple[int, ...]:
    """``eagle3.target_layers`` of a loaded head (as llama.cpp read them)."""
    if model_target_layer_ids is None or model_target_layer_ids_n is None:
        raise ModelLoadError("this llama-cpp-python build does not export llama_model_target_layer_ids (need 0.3.36)")
    n = int(model_target_layer_ids_n(model.handle))
    ptr = model_target_layer_ids(model.handle)
    return tuple(int(ptr[i]) for i in range(n))


def _check_head_file(path: str | os.PathLike) -> None:
    """Before llama.cpp loads ``path`` as an EAGLE-3 head: a missing or non-GGUF file
    (``check_gguf_file``), or a GGUF of another kind (a Medusa heads file, a model), named as
    such in one line with the option it belongs to. A GGUF whose header cannot be read is left
    to the loader, which says why.

    Raises:
        ModelLoadError: no such file, not a GGUF, or a GGUF whose architecture is not ``eagle3``.
    """
    from ..models.gguf_index import gguf_architecture

    p = check_gguf_file(path, "EAGLE-3 head file", "--eagle")
    arch = gguf_architecture(p)  # None for a header that cannot be read: the loader names the problem
    if arch is None or arch == "eagle3":
        return
    if arch == "medusa":
        raise ModelLoadError(f"{p} is a Medusa heads file, not an EAGLE-3 head: use it with --drafter medusa --medusa {p} "
                             f"(Python: drafter='medusa', medusa=...)")
    raise ModelLoadError(
        f"{p} is a {arch} model, not an EAGLE-3 head (architecture eagle3): a model drafts with --drafter draft "
        f"--draft-model {p} (Python: drafter='draft', draft_model=...)"
    )


_RECONVERT = (
    "Use the head made for this target, or convert the head's checkpoint for it: python convert_hf_to_gguf.py "
    "HEAD_DIR --target-model-dir TARGET_DIR (docs/drafters.md, 'Use a public head')"
)

CATCH_UP_OUTPUTS = 16
"""Longest catch-up decoded in the same call as the root's entry (every row an output)."""

CONTEXT_WINDOW = 16
"""Default ``context_window``: the head's entries for the last 16 positions at most. The
``eagle3`` graph computes a full logits row for every entry (it ignores the output
selection), so an entry costs about as much as a drafting level (~1.6 ms on the development
CPU): catching up a 634-token prompt took 990 ms of a 2.4 s, 128-token request (measured
2026-12-02, Spec-Bench rag). The head's features ``g`` come from target layers that
attended the whole context; only the head's own attention is windowed."""


RUNTIMES = ("auto", "host", "llama")
"""Where the head's decoder layer runs (``Eagle3Drafter(runtime=...)``)."""


class Eagle3Drafter(StateFedLevels, ModelDrafter):
    """Drafts dynamic token trees with an EAGLE-3 head (see the module docstring).

    Args:
        head: the head's GGUF path (architecture ``eagle3``) or a loaded ``Model``.
        n_gpu_layers: offload on CUDA / Metal builds.
        max_depth / max_width / shape / n_threads: see ``ModelDrafter``.
        context_window: most entries the head's KV keeps before the root (``CONTEXT_WINDOW``;
            None: every position, as llama.cpp's driver does). A catch-up longer than it
            (the first step after a prompt, a step after a long run without the head) writes
            only the last ``context_window`` entries and drops the older ones. Drafts only:
            the target verifies every token either way.
        runtime: where the head's layer runs: ``"host"`` (the project's C kernels,
            ``eagle3_host``: no llama.cpp context), ``"llama"`` (llama.cpp's ``eagle3`` graph,
            the reference) or ``"auto"`` (default; ``LOCALSPEC_EAGLE3_RUNTIME`` overrides):
            host when the native library is loaded and the head is one it runs
            (``eagle3_host.HeadUnsupported``), else llama. Chosen at ``attach``
            (``runtime``; ``runtime_reason``: why auto took llama).
    Raises:
        ValueError: ``context_window`` < 1, or an unknown ``runtime``.
        HeadUnsupported: (at ``attach``) ``runtime="host"`` for a head it cannot run, or
            without the native library.
        ModelLoadError: not an EAGLE-3 head, or (at ``check_target`` / ``attach``) made for
            another target: hidden size, feature layers, vocabulary size.
        VocabMismatchError: (at ``check_target`` / ``attach``) its tokenizer is not the target's.
    """

    name = "eagle3"
    source = TokenSource.EAGLE3

    def __init__(
        self,
        head: Model | str | os.PathLike,
        *,
        n_gpu_layers: int = 0,
        max_depth: int = 8,
        max_width: int = 8,
        shape: TreeShape | None = None,
        n_threads: int | None = None,
        context_window: int | None = CONTEXT_WINDOW,
        runtime: str | None = None,
    ) -> None:
        runtime = (runtime or os.environ.get("LOCALSPEC_EAGLE3_RUNTIME") or "auto").strip().lower()
        if runtime not in RUNTIMES:
            raise ValueError(f"runtime must be one of {', '.join(RUNTIMES)}, got {runtime!r}")
        self.runtime_asked = runtime
        self.runtime = "llama"  # what attach chose (``runtime_reason`` says why when it is not the one asked)
        self.runtime_reason: str | None = None
        if context_window is not None and context_window < 1:
            raise ValueError(f"context_window must be at least 1 (or None: the whole context), got {context_window}")
        self.context_window = context_window
        if not isinstance(head, Model):
            _check_head_file(head)
        super().__init__(
            head, n_gpu_layers=n_gpu_layers, max_depth=max_depth, max_width=max_width, shape=shape, n_threads=n_threads
        )
        try:  # a head that cannot draft is refused here, in one line, and closed
            if self.model.architecture != "eagle3":
                raise ModelLoadError(f"{head} is a {self.model.architecture} model, not an EAGLE-3 head (architecture eagle3)")
            self.target_feature_layers = head_target_layers(self.model)
            if len(set(self.target_feature_layers)) != len(self.target_feature_layers):
                raise ModelLoadError(
                    f"the EAGLE-3 head {head} reads target layers {list(self.target_feature_layers)}: a layer twice "
                    f"(EAGLE-3 reads three distinct layers). {_RECONVERT}"
                )
            from ..models.gguf_index import GGUFIndex

            index = GGUFIndex(self.model.path)  # one walk of the header (it may carry a 262k-token vocabulary: ~65 ms)
            d2t = gguf_tensor(index, "d2t")
            self.d2t = None if d2t is None else np.ascontiguousarray(d2t, dtype=np.int64).reshape(-1)
            if self.d2t is not None:
                check_draft_map(self.d2t, f"the EAGLE-3 head {head}", _RECONVERT)
        except ModelLoadError:
            self.close()
            raise
        self.n_embd_target = int(self.model.meta("eagle3.target_hidden_size") or self.model.n_embd)
        self.n_embd = self.model.n_embd
        # llama.cpp's converter writes the head's config vocab_size (the target's); the
        # project's writer does not
        vocab = self.model.meta("eagle3.vocab_size")
        self.target_vocab_size = int(vocab) if vocab is not None else None
        self._index = index  # the host runtime's weights read from it too (``_host_weights``)
        tensors = index.tensors
        self.own_token_embd = "token_embd.weight" in tensors  # else it borrows the target's
        self.own_output = "output.weight" in tensors  # else it borrows the target's lm_head
        self.fc = self._host_fc(index)
        self._checked_for: Model | None = None  # the target check_target passed for
        self._reset_state()

    def _host_fc(self, index) -> np.ndarray | None:
        """The encoder's ``fc`` as float32 when the host can apply it exactly as the graph
        does (an unquantised matrix and no norm before it); else None (the encoder then runs
        in llama.cpp: one more call per level 0). Kept transposed, [3 * n_embd_target,
        n_embd], the layout of the C kernel ``gemm_t``. ``index``: the head's ``GGUFIndex``."""
        norm = (self.model.meta("eagle3.norm_before_fc") or "false").lower()
        if norm not in ("false", "0"):
            return None
        w = gguf_tensor(index, "fc.weight", float_only=True)
        if w is None or w.shape != (self.n_embd, 3 * self.n_embd_target):
            return None
        return np.ascontiguousarray(w.T, dtype=np.float32)  # [3 * n_embd_target, n_embd]

    def _reset_state(self) -> None:
        self.kv_first = 0  # head KV seq0 holds entries for positions kv_first .. kv_len - 1
        self.kv_len = 0
        self.feat = TargetFeatureBuffer(3 * self.n_embd_target, "the EAGLE-3 head")  # from kv_len on
        self.g_last: np.ndarray | None = None  # g of entry kv_len - 1 (to redo it)
        self._state: dict[int, np.ndarray] = {}  # node -> its pre-norm output row
        # host runtime: keys / values of the committed entries kv_first .. kv_len - 1 and of tree nodes
        n_kv = getattr(self, "_n_kv", 0)
        self.kv_k = np.zeros((0, n_kv), dtype=np.float32)
        self.kv_v = np.zeros((0, n_kv), dtype=np.float32)
        self._drop_tree_rows()

    def _drop_tree_rows(self) -> None:
        """Forget the growing tree's host entries: ``_tree_k`` / ``_tree_v`` [rows, n_kv] hold the
        committed entries (rows ``0 .. c - 1``, a copy of ``kv_k`` / ``kv_v``) and then one row per
        decoded node (``_node_row``: node -> row; ``_tree_used`` rows written), so that a level's
        key pool is a view, not a concatenation per level."""
        self._tree_k = self._tree_v = None
        self._tree_used = 0
        self._node_row: dict[int, int] = {}

    def target_mismatches(self, model: Model) -> list[str]:
        """What of the head does not fit the target ``model`` (empty when all fits): the
        hidden size of the features it reads (``eagle3.target_hidden_size``), its feature
        layers (``eagle3.target_layers``: inputs of layers ``1 .. n_layer - 1``, what
        ``FeatureTap`` captures), its vocabulary (``eagle3.vocab_size`` when present, and the
        ``d2t`` target ids), and, when it borrows the target's token embeddings or lm_head,
        its own hidden size. Each entry reads "<what the head expects> (the target has <...>)"."""
        out = []
        if self.n_embd_target != model.n_embd:
            out.append(f"features of hidden size {self.n_embd_target} (the target has {model.n_embd})")
        elif (not self.own_token_embd or not self.own_output) and self.n_embd != model.n_embd:
            borrowed = "token embeddings" if not self.own_token_embd else "lm_head"
            out.append(f"the target's {borrowed} at hidden size {self.n_embd} (the target has {model.n_embd})")
        bad = [k for k in self.target_feature_layers if not 1 <= k < model.n_layer]
        if bad:
            n = model.n_layer
            out.append(
                f"target layer{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))} of "
                f"{list(self.target_feature_layers)} (the target has {n} layers; 1..{n - 1} can be read)"
            )
        if self.target_vocab_size is not None and self.target_vocab_size != model.n_vocab:
            out.append(f"a vocabulary of {self.target_vocab_size} tokens (the target has {model.n_vocab})")
        elif self.d2t is not None and self.d2t.size and int(self.d2t.max()) >= model.n_vocab:
            out.append(f"draft tokens up to id {int(self.d2t.max())} (the target has {model.n_vocab} tokens)")
        return out

    def check_target(self, model: Model) -> None:
        """Check the head against the target ``model`` (``target_mismatches``, then its
        tokenizer against the target's, id by id). The engine calls this before it changes
        anything, so a refused head loses nothing. Checked once per target model.

        Raises:
            ModelLoadError: the head was made for another target (one line naming every
                mismatch: hidden size, feature layers, vocabulary).
            VocabMismatchError: the head's tokenizer is not the target's.
        """
        if self._checked_for is model:
            return
        bad = self.target_mismatches(model)
        if bad:
            raise ModelLoadError(
                f"the EAGLE-3 head {self.model.path} was made for another target: it expects {'; '.join(bad)}. "
                f"{_RECONVERT}"
            )
        advice = f"The EAGLE-3 head {self.model.path} carries another tokenizer. {_RECONVERT}"
        check_vocab(model, self.model, advice=advice)
        self._checked_for = model

    def attach(self, target: TargetHandle) -> None:
        """Check the head against the target (``check_target``) and create its context
        (sharing the target's)."""
        self.check_target(target.model)
        if target.features is None or tuple(target.features.layers) != self.target_feature_layers:
            raise RuntimeError("the engine must capture the head's target layers (target_feature_layers)")
        if self._host_weights(target) is not None:
            self._bind_host(target)
            return
        self.bind(target, n_ctx=target.n_ctx, ctx_other=target.tensor_source)
        ext.llama_set_embeddings_nextn(self.ctx.handle, True, True)  # pre-norm rows of the outputs
        if getattr(self, "batch", None) is not None:
            self.batch.close()
        self.batch = ExtBatch(self.ctx.handle)  # this request's own calls (a long catch-up, the encoder)
        self._reset_state()

    def _host_weights(self, target: TargetHandle):
        """The head's ``HeadWeights`` for this target when the host runtime runs it (shared
        by the family), else None (``runtime``, ``runtime_reason`` say which and why).

        Raises:
            HeadUnsupported: ``runtime="host"`` and the host cannot run this head.
        """
        from .eagle3_host import HeadUnsupported, HeadWeights

        self.runtime, self.runtime_reason = "llama", None
        if self.runtime_asked == "llama":
            return None
        embd_path = str(self.model.path if self.own_token_embd else target.model.path)
        fam = self._family
        cached = getattr(fam, "host_weights", None)
        if cached is not None and cached[0] == embd_path:
            weights = cached[1]
        else:
            try:
                if not native.enabled():
                    raise HeadUnsupported(f"the native library is not in use ({native.LOAD_ERROR or 'switched off'})")
                weights = HeadWeights(self._index, embd_path, self.d2t)
            except HeadUnsupported as e:
                weights = e
            fam.host_weights = (embd_path, weights)
        if isinstance(weights, HeadUnsupported):
            if self.runtime_asked == "host":
                raise HeadUnsupported(f"the host runtime cannot run the EAGLE-3 head {self.model.path}: {weights}")
            self.runtime_reason = str(weights)
            return None
        self.runtime = "host"
        return weights

    def _bind_host(self, target: TargetHandle) -> None:
        """Join (or make) the family's ``HostHub``: no llama.cpp context."""
        from .eagle3_host import HostHub

        weights = self._family.host_weights[1]
        self._leave_hub()
        if getattr(self, "batch", None) is not None:
            self.batch.close()
            self.batch = None
        self.n_vocab = target.model.n_vocab
        self.suppress_ids = target.model.suppress_tokens
        n_req = max(1, int(getattr(target, "n_requests", 1)))
        key = ("host", id(target.model), n_req)
        fam = self._family
        hub = fam.hub
        if hub is None or hub.key != key or hub.full:
            hub = fam.hub = HostHub(weights, n_requests=n_req, seqs_each=self.n_slots + 1, key=key,
                                    n_threads=self.n_threads or target.n_threads)  # fmt: skip
        self.hub = hub
        self.seq0 = hub.join()
        self.ctx = None
        self.slots = None
        self.sampler = None
        self._n_kv = weights.n_kv
        self._reset_state()

    def release_tree(self) -> None:
        super().release_tree()
        self._drop_tree_rows()

    @property
    def host(self) -> bool:
        """True while the head runs on the host runtime (``eagle3_host``)."""
        return self.runtime == "host" and self.hub is not None

    def spawn(self) -> "Eagle3Drafter":
        """A drafter for another request sharing the head (``ModelDrafter.spawn``) and its
        host encoder matrix."""
        new = super().spawn()
        new.batch = None
        new._reset_state()
        return new

    # -- protocol (besides ModelDrafter's) ------------------------------------------------------

    def begin(self, history: Sequence[int], context: Sequence[Sequence[int]] = ()) -> None:
        """Keep the head's entries and features that the new history shares."""
        common = common_prefix(self.history, history)
        keep_kv = min(self.kv_len, max(0, common - 1))  # entry P also needs token P + 1
        if keep_kv < self.kv_len:
            self._truncate_kv(keep_kv)
            self.feat.truncate(keep_kv)  # features of the dropped entries are gone: re-prefill them
        else:
            self.feat.truncate(common)
        super().begin(history, context)

    feature_gaps = True
    """The head drafts on after positions whose features it never received (``Step`` pauses
    the tap while an ``auto`` policy expects no model step, ``SpeculationPolicy.needs_features``):
    its own context restarts after the gap (``_catch_up_rows``)."""

    def add_target_features(self, first_pos: int, rows: np.ndarray) -> None:
        """Target features of positions ``first_pos, first_pos + 1, ...`` ([n, 3 * n_embd]
        float32); rows of positions the head already has are ignored. After a gap (positions
        between what the head has and ``first_pos`` without features) the rows restart at
        ``first_pos``."""
        if first_pos > self.feat.end:
            self.feat.restart(first_pos)
        self.feat.add(first_pos, rows)

    @property
    def n_target_features(self) -> int:
        """Positions ``0 .. n - 1`` whose target features the head needs no more: those it has
        (or consumed), and, with a ``context_window``, every position older than the window
        before the current root (never read again: a prefill need not re-decode them)."""
        end = self.feat.end
        if self.context_window is not None:
            end = max(end, len(self.history) - 1 - self.context_window)
        return end

    def ready(self) -> bool:
        root_pos = len(self.history) - 1
        attached = self.host or self.ctx is not None
        # the rows up to the root's predecessor, at least its own (or its entry, asked again)
        rows = self.feat.end >= root_pos and (self.feat.first < root_pos or self.kv_len >= root_pos)
        return attached and root_pos >= 1 and rows

    def check_cache(self) -> None:
        n = max(0, self.kv_len - self.kv_first)
        if self.host:
            if self.kv_k.shape[0] != n or self.kv_v.shape[0] != n:
                raise RuntimeError(f"the EAGLE-3 head's keys hold {self.kv_k.shape[0]} entries, expected {n}")
            self._drop_tree_rows()  # a tree's entries live until its drafting ends
            return
        self.ctx.expect_positions(self.seq0, n, "the EAGLE-3 head's KV", lo=self.kv_first if n else 0)

    def close(self) -> None:
        if getattr(self, "batch", None) is not None:
            self.batch.close()
            self.batch = None
        super().close()

    # -- levels on the (shared) head context (``StateFedLevels``) ------------------------------

    state_pos_offset = -1  # entry P reads the token at P + 1: a node at depth d is entry root_pos + d - 1

    def level_part(self, tree: TreeBuilder, nodes: list[int]) -> LevelPart:
        """Level 0: the catch-up (``_catch_up_part``); level d: each frontier node's entry
        (its token, its parent's pre-norm state h) at position ``root_pos + depth - 1``.
        Rows are draft-vocabulary rows, ``[n, len(d2t)]`` (``DraftChildSelector`` maps them
        back), or ``n_vocab`` wide without a ``d2t``. On the host runtime: a ``HostPart``."""
        if self.host:
            return self._host_root_part(tree.tokens[0]) if nodes == [0] else self._host_frontier_part(tree, nodes)
        if nodes == [0]:
            return self._catch_up_part(tree.tokens[0])
        return self._frontier_part(tree, nodes)

    def _level_rows(self, logits: np.ndarray) -> np.ndarray:
        """[n, n_vocab] target-wide rows of the last decode -> [n, width] draft-vocabulary rows."""
        if self.d2t is None:
            return logits
        return np.take(logits, self.d2t, axis=1)

    def target_rows(self, rows: np.ndarray) -> np.ndarray:
        """Draft-vocabulary rows ([n, width]) as target-wide rows ([n, n_vocab], ``-inf``
        outside the draft vocabulary): what llama.cpp returned (tests, inspection)."""
        if self.d2t is None:
            return rows
        out = np.full((rows.shape[0], self.n_vocab), -np.inf, dtype=np.float32)
        out[:, self.d2t] = rows
        return out

    def _catch_up_rows(self, root_pos: int) -> np.ndarray:
        """[n, n_embd] encoded rows ``g`` of the positions whose entries level 0 adds, from
        ``kv_len`` (after this call) to ``root_pos - 1``: the last ``context_window`` of them at
        most (older keys and values dropped), or the root's predecessor again when it is asked
        twice for the same root (its entry redone)."""
        if self.kv_len >= root_pos:  # asked twice for the same root: redo its entry
            assert self.kv_len == root_pos and self.g_last is not None
            self._truncate_kv(root_pos - 1)
            self.feat.truncate(root_pos)  # drop what follows the root; kv_len is root_pos again below
            return self.g_last[None, :]
        if self.feat.first > self.kv_len:  # positions without features (the tap paused): restart after them
            self._restart_kv(self.feat.first)
        n_new = root_pos - self.kv_len
        w = self.context_window
        if w is not None and n_new > w:  # keep only the last w entries (CONTEXT_WINDOW)
            self._restart_kv(root_pos - w)
            self.feat.drop_before(root_pos - w)
            n_new = w
        g_new = self._encode(self.feat.rows[:n_new])
        self.feat.drop_before(root_pos)
        return g_new

    def _catch_up_part(self, root: int) -> LevelPart:
        """The entries of every position up to the root's predecessor, the last one (token =
        the root) with output: the last ``CATCH_UP_OUTPUTS`` of them (every row out, the last
        one used) go into the level decode, a longer catch-up's head into calls of its own
        before it. The part's rows: the root's ([1, width]); it keeps the root's pre-norm state."""
        root_pos = len(self.history) - 1
        g_new = self._catch_up_rows(root_pos)
        first = self.kv_len
        n = g_new.shape[0]
        b = self.batch
        n_batch = self.ctx.n_batch
        tail = min(n, CATCH_UP_OUTPUTS, n_batch)
        for i0 in range(0, n - tail, n_batch):  # a long catch-up: its head without outputs
            b.clear()
            for i in range(i0, min(i0 + n_batch, n - tail)):
                p = first + i
                b.add(token=self.history[p + 1], pos=p, seq_id=self.seq0, output=False, embd=g_new[i])
            self.ctx.process(b)
        entries = []
        for i in range(n - tail, n):  # the rest and the root's entry: every row out
            p = first + i
            entries.append(dict(token=self.history[p + 1] if p + 1 < root_pos else root, pos=p, seq_id=self.seq0,
                                output=True, embd=g_new[i]))  # fmt: skip

        def finish(logits, out0):
            self.kv_len = root_pos
            self.g_last = g_new[-1].copy()
            self._state = {0: self._out_state(out0 + tail - 1)}
            return self._level_rows(logits[tail - 1 : tail])

        return LevelPart(entries, tail, finish)

    def _encode(self, feats: np.ndarray) -> np.ndarray:
        """The encoder (``fc``) over target feature rows: [n, 3 * n_embd_target] -> [n, n_embd]
        float32; on the host when it is a plain matrix product (``_host_fc``): the C kernel
        ``gemm_t``, or numpy without the native library. (numpy's BLAS would start a thread
        pool whose spinning threads then compete with llama.cpp's for the cores: measured on 2
        cores, it doubled the time of the head's next llama.cpp call.)"""
        if self.host:
            return self.hub.weights.encode(feats, self.hub.n_threads)
        if self.fc is not None:
            if native.enabled():
                from ..native import rows as native_rows

                return native_rows.gemm_t(self.fc, feats)
            return np.ascontiguousarray(feats @ self.fc, dtype=np.float32)
        out = np.empty((feats.shape[0], self.n_embd), dtype=np.float32)
        b = self.batch
        n_batch = self.ctx.n_batch
        for i0 in range(0, feats.shape[0], n_batch):
            rows = feats[i0 : i0 + n_batch]
            b.clear()
            for j, row in enumerate(rows):
                b.add(token=None, pos=self.kv_len + i0 + j, seq_id=self.seq0, output=True, embd=row)
            self.ctx.process(b, encode=True)
            ptr = ext.llama_get_embeddings_nextn(self.ctx.handle)
            out[i0 : i0 + rows.shape[0]] = np.ctypeslib.as_array(ptr, shape=(rows.shape[0], self.n_embd))
        return out

    def _restart_kv(self, pos: int) -> None:
        """Drop every entry of the head's KV; the next catch-up writes entries from ``pos``."""
        self._truncate_kv(0)
        self.kv_first = self.kv_len = pos

    def _truncate_kv(self, n: int) -> None:
        if self.host:
            keep = max(0, n - self.kv_first)
            self.kv_k, self.kv_v = self.kv_k[:keep], self.kv_v[:keep]
        else:
            self.ctx.seq_rm(self.seq0, n, -1)
        self.kv_len = n
        self.kv_first = min(self.kv_first, n)  # nothing left below kv_first: empty from n
        self.check_cache()

    # -- the host runtime's levels (``eagle3_host.run_level``) ---------------------------------

    def _host_root_part(self, root: int):
        """Level 0 on the host: the entries of every position up to the root's predecessor
        (window ``context_window``) add their keys and values; only the last one (token = the
        root) goes through the whole layer and gives the root's row and pre-norm state."""
        from .eagle3_host import HostPart

        root_pos = len(self.history) - 1
        g_new = self._catch_up_rows(root_pos)
        first = self.kv_len
        n = g_new.shape[0]
        tokens = [self.history[first + i + 1] if first + i + 1 < root_pos else root for i in range(n)]
        self._drop_tree_rows()
        c = self.kv_k.shape[0]

        def finish(rows, h, k, v):
            self.kv_k = np.concatenate([self.kv_k, k])
            self.kv_v = np.concatenate([self.kv_v, v])
            self.kv_len = root_pos
            self.g_last = g_new[-1].copy()
            self._state = {0: h[0].copy()}
            return rows

        return HostPart(tokens, np.arange(first, first + n), g_new, self.kv_k, self.kv_v, [n - 1],
                        [(range(c), range(n))], finish)  # fmt: skip

    def _host_frontier_part(self, tree: TreeBuilder, nodes: list[int]):
        """Level d on the host: each frontier node's entry attends to the committed entries,
        its ancestors' entries (below the root) and itself."""
        from .eagle3_host import HostPart

        root_pos = len(self.history) - 1
        c = self.kv_k.shape[0]
        if self._tree_k is None:  # the first level after the root: committed rows, room for nodes
            room = c + 8 * len(nodes) + 8
            self._tree_k = np.empty((room, self.kv_k.shape[1]), dtype=np.float32)
            self._tree_v = np.empty_like(self._tree_k)
            self._tree_k[:c], self._tree_v[:c] = self.kv_k, self.kv_v
            self._tree_used = c
        used, rows_of = self._tree_used, self._node_row
        keys = [(list(range(c)) + [rows_of[a] for a in reversed(_ancestors(tree, n))], [i]) for i, n in enumerate(nodes)]
        g = np.stack([self._state[tree.parents[n]] for n in nodes])

        def finish(rows, h, k, v):
            m = len(nodes)
            if used + m > self._tree_k.shape[0]:  # grow (keeps the rows written so far)
                extra = np.empty((max(m, self._tree_k.shape[0]), self._tree_k.shape[1]), dtype=np.float32)
                self._tree_k = np.concatenate([self._tree_k, extra])
                self._tree_v = np.concatenate([self._tree_v, extra])
            self._tree_k[used : used + m] = k
            self._tree_v[used : used + m] = v
            for i, n in enumerate(nodes):
                self._state[n] = h[i]
                rows_of[n] = used + i
            self._tree_used = used + m
            return rows

        return HostPart([tree.tokens[n] for n in nodes], [root_pos - 1 + tree.depth[n] for n in nodes], g,
                        self._tree_k[:used], self._tree_v[:used], list(range(len(nodes))), keys, finish)  # fmt: skip


def _ancestors(tree: TreeBuilder, node: int) -> list[int]:
    """The node's ancestors below the root, nearest first."""
    out = []
    p = tree.parents[node]
    while p > 0:
        out.append(p)
        p = tree.parents[p]
    return out
