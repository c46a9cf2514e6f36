"""Medusa heads (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with
Multiple Decoding Heads", arXiv 2401.10774).

K small heads on the target's final hidden state ``h`` (the output of its final norm, the row
the lm_head reads). Head ``k`` (k = 1 .. K) predicts the token ``k + 1`` places after the
position of ``h``::

    r_k = h + SiLU(W_k h + b_k)          # one residual block, W_k: [E, E]
    logits_k = U_k r_k                   # readout over the draft vocabulary, U_k: [V, E]

**Departure from Medusa-1.** The paper's heads read out over the target's whole vocabulary
(the lm_head, 262,144 x 640 on the default model: 168 M multiply-adds and 336 MB of float16
per head, more than the target's own layers). Here each head has a readout over a reduced
draft vocabulary (``d2t``: draft id -> target id, like the EAGLE-3 heads), initialised from the
lm_head's rows of those tokens; tokens outside it are never drafted (verification stays
exact: they are simply not proposed). The size is chosen by measurement (docs/drafters.md).

**Where h comes from.** The verification decode's ``result_norm`` rows (``FinalNormTap`` on
the target context, ``target_final_norm = True``): the engine passes the row of the node whose
logits produced the step's last emitted token (``set_final_hidden``). That row predicts the
next root; head k drafts depth k below it. No extra target call. The prefill requests no
logits, so the first step of a request has no ``h`` and is a plain decode.

**What a head's draft distribution is conditioned on.** Only ``h``, the hidden state at the
last accepted position -- not on the tokens drafted between it and the node (the heads never
see them; that is what makes them cheap, and why acceptance falls with depth). Every node at
depth ``d`` therefore has the same draft distribution ``q_d = softmax(logits_d)`` (after the
request's sampling transforms), and that is exactly the distribution its children are taken
from, so each verification rule sees a correct draft distribution:

* temperature 0: the top-k of ``q_d`` (deterministic children);
* seeded Gumbel: the top-k of ``q_d``'s logits plus the target's own Gumbel noise at the
  children's position (deterministic children; the same at every node of a depth);
* rejection sampling: k i.i.d. draws of ``q_d`` per node (``DraftChildSelector``; draw
  counters differ per node), tried in draw order; ``q_d`` is the node's ``draft_dists``
  entry. Node scores (hence pruning) depend only on the depth there, never on the sampled
  tokens (the invariants ``verify.check_sampled_siblings`` relies on).

**Trees** are products of the heads' top-k candidates (the paper's sparse trees): level d
adds the children of the best ``width`` nodes of level d - 1, each node's score the product
of per-node acceptance estimates along its path, and the tree is pruned to the node budget
by score (``expand_tree``); the engine's policy then verifies its best ``n`` nodes. The
estimates are P(target accepts the node | it reached the parent) learned online per (head,
confidence bucket) (``MedusaCalibration``), so scores are on the policy's scale.

The heads run in the C kernels (``native.rows.gemm_t``), numpy when the kernels are not built.
Their weights are loaded once (``MedusaHeads``) and shared by the drafters of a batch's
requests (``spawn``); a step runs each head matrix once over the hidden states of every
request that drafts (``MedusaHeads.extend_many``: 2K products per step, K + 1 with a shared
readout, whatever the number of requests; each row's sums are the same bits as alone).

**The step, in two phases** (the model drafters' protocol, ``level_drafter``): ``propose`` is
the cheap phase and drafts nothing; the engine's policy plans the step from the drafter's
``model_stats`` (its measured drafting time and accepted length) and only when it expects a
tree to pay does ``extend`` run the heads and build the tree, in the shape the policy chose.
A step the policy does not draft costs no head computation and no tree (on a 2-core CPU,
where a tree of 4 nodes costs 2.5 plain decodes, that is most steps: measured 11-12 ms of
host work per step before, when every step ran the heads and built a tree the policy then
declined). The heads' hidden state is still captured on every verification decode, so any
step can draft.
"""

from __future__ import annotations

import bisect
import os
import time
from collections.abc import Sequence

import numpy as np

from .. import native
from ..errors import InvalidRequestError, ModelLoadError, VocabMismatchError
from ..policy import AcceptanceTracker, ModelDraftStats, TreeShape
from ..sampling import SamplingParams
from ..tree import TokenSource, TokenTree
from .base import TargetHandle
from .level_drafter import ModelDrafter
from .vocab_check import check_draft_map
from .tree_expand import _N_CONF, _N_STOCH_DEPTH, CONF_EDGES, DraftChildSelector, DraftMode, _conf_prior, expand_tree

DEFAULT_WIDTH = 6
"""Top-k per head and nodes expanded per level (the paper's sparse trees use 10 at depth 1)."""


class MedusaCalibration:
    """P(the target accepts a Medusa node | it reached the parent), learned online.

    Buckets: deterministic children by (head, mode, confidence bucket), prior the bucket's
    midpoint (a head's probability of its token); stochastic children by head (prior 0.5)."""

    def __init__(self, n_heads: int) -> None:
        self.n_heads = int(n_heads)
        det = np.tile(_conf_prior(), 2 * self.n_heads)
        self.tracker = AcceptanceTracker(np.concatenate([det, np.full(_N_STOCH_DEPTH, 0.5)]), prior_weight=4.0)
        self._edges = [float(x) for x in CONF_EDGES]
        self._est: list[float] | None = None  # the estimates of this step (they change in observe)

    def bucket(self, mode: DraftMode, confidence: float, depth: int) -> int:
        if mode == DraftMode.SAMPLE:
            return 2 * _N_CONF * self.n_heads + min(depth, _N_STOCH_DEPTH) - 1
        b = max(0, min(bisect.bisect_right(self._edges, confidence) - 1, _N_CONF - 1))
        head = max(0, min(depth, self.n_heads) - 1)
        return (head * 2 + int(mode)) * _N_CONF + b

    def estimate(self, bucket: int) -> float:
        if self._est is None:
            self._est = self.tracker.estimates()
        return self._est[bucket]

    def observe(self, tree: TokenTree, emitted) -> None:
        self.tracker.learn(tree, emitted)
        self._est = None

    def reset_request(self) -> None:
        self.tracker.reset_request()
        self._est = None


class _LevelRows:
    """``LevelDecoder`` over precomputed head rows: every node at depth d gets head d+1's row."""

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows  # [K, V] float32

    def decode_level(self, tree, nodes):
        d = int(tree.depth[nodes[0]])
        return np.broadcast_to(self.rows[d], (len(nodes), self.rows.shape[1]))


class _SameDepthChildren:
    """A ``DraftChildSelector`` whose deterministic children are computed once per depth:
    greedy and Gumbel children depend only on the row and the position, the same for every
    node of a depth (stochastic draws differ per node and are not shared)."""

    def __init__(self, inner: DraftChildSelector) -> None:
        self.inner = inner
        self.mode = inner.mode
        self._memo: dict[tuple[int, int], object] = {}

    def children(self, row, pos, k, counter=0):
        if self.mode == DraftMode.SAMPLE:
            return self.inner.children(row, pos, k, counter)
        key = (int(pos), int(k))
        ch = self._memo.get(key)
        if ch is None:
            ch = self._memo[key] = self.inner.children(row, pos, k, counter)
        return ch


class MedusaHeads:
    """The heads' weights in the layout the C kernels read, loaded once and shared by the
    drafters of every request (``MedusaDrafter.spawn``), and the heads' logits for the
    hidden states of all the requests that draft in a step (``logits``).

    Args:
        weights: the ``MedusaWeights`` read from the GGUF.
        max_depth: heads used (default: all).
        where: the file, for messages (None: weights given in memory).
    Raises:
        ModelLoadError: ``d2t`` does not hold distinct non-negative target ids.
    """

    def __init__(self, weights, max_depth: int | None = None, *, where: str | None = None) -> None:
        self.weights = weights
        self.n_heads = weights.n_heads if max_depth is None else max(1, min(int(max_depth), weights.n_heads))
        self.n_embd = weights.n_embd
        self.d2t = np.ascontiguousarray(weights.d2t, dtype=np.int64)
        check_draft_map(self.d2t, str(where), "Write the heads again (localspec train-medusa).")
        # transposed, float32, C-contiguous: what the gemm kernel reads ([n_in, n_out])
        self.w_t = [np.ascontiguousarray(weights.w[k].T, dtype=np.float32) for k in range(self.n_heads)]
        self.b = [np.ascontiguousarray(weights.b[k], dtype=np.float32) for k in range(self.n_heads)]
        self.shared = weights.shared_readout
        n_out = 1 if self.shared else self.n_heads
        self.out_t = [np.ascontiguousarray(weights.out[k].T, dtype=np.float32) for k in range(n_out)]
        self.softcap = float(weights.softcap)

    def logits(self, h: np.ndarray) -> np.ndarray:
        """Every head's draft-vocabulary logits for the hidden states ``h`` of ``R`` requests
        ([R, n_embd] float32) -> [R, K, V] float32. One C call per matrix over all ``R`` rows
        (``native.rows.gemm_t``: each row's sums in row order, the same bits whatever ``R``;
        numpy when the kernels are not built): ``K`` block products and ``K`` readouts (one
        over all ``R * K`` rows when the heads share their readout)."""
        h = np.ascontiguousarray(h, dtype=np.float32)
        n_req = h.shape[0]
        use_c = native.enabled()
        if use_c:
            from ..native import rows as native_rows

            def mm(wt, x):
                return native_rows.gemm_t(wt, x)
        else:

            def mm(wt, x):
                return np.ascontiguousarray(x @ wt, dtype=np.float32)

        r = np.empty((n_req, self.n_heads, self.n_embd), dtype=np.float32)
        for k in range(self.n_heads):
            u = mm(self.w_t[k], h) + self.b[k]
            r[:, k] = h + u / (1.0 + np.exp(-u))  # h + SiLU(W h + b)
        v = self.d2t.size
        if self.shared:  # one readout: read once for every head of every request
            out = mm(self.out_t[0], r.reshape(n_req * self.n_heads, self.n_embd)).reshape(n_req, self.n_heads, v)
        else:
            out = np.empty((n_req, self.n_heads, v), dtype=np.float32)
            for k in range(self.n_heads):
                out[:, k] = mm(self.out_t[k], r[:, k])
        if self.softcap:
            out = np.tanh(out / self.softcap) * self.softcap
        return out

    def extend_many(self, drafters: Sequence["MedusaDrafter"], shapes: Sequence[TreeShape]) -> list[TokenTree]:
        """``extend`` of several requests' drafters (sharing these heads) in one step: the
        heads run once over the hidden states of all that can draft (``logits``), then each
        request's tree is built from its rows. Each drafter's statistics get an equal share
        of the time.

        Requires: ``propose`` was called on each drafter for this step.
        """
        t0 = time.perf_counter()
        go = [(i, d, d._step_shape(s, self.n_heads, d.width)) for i, (d, s) in enumerate(zip(drafters, shapes))]
        trees = [TokenTree.root_only(d.history[-1]) for d in drafters]
        go = [(i, d, s) for i, d, s in go if s is not None]
        if not go:
            return trees
        rows = self.logits(np.stack([d._h for _, d, _ in go]))
        for j, (i, d, s) in enumerate(go):
            trees[i] = expand_tree(d.history[-1], len(d.history) - 1, s, _LevelRows(rows[j]),
                                   _SameDepthChildren(d.sampler), d.calib, d.source)  # fmt: skip
        t_us = (time.perf_counter() - t0) * 1e6 / len(go)
        for i, d, _ in go:
            # no per-level model calls: the whole time is the drafter's own (``t_host_us``)
            d.stats.observe_draft(t_us, trees[i].n_nodes)
            d.n_drafted_steps += 1
        return trees


class MedusaDrafter:
    """Drafts sparse token trees with Medusa heads (see the module docstring).

    Args:
        heads: the heads' GGUF (``models/medusa_gguf.py``) or loaded ``MedusaWeights``.
        width: top-k per head and nodes expanded per level (the widest tree the policy may ask for).
        max_depth: heads used (default: all).
        shape: a fixed ``TreeShape`` for every step (tests, experiments: the engine's plan then
            drafts every step with it); default: the shape the engine's policy plans.
    Raises:
        ModelLoadError: the file is missing, corrupt or not Medusa heads (one line).
        VocabMismatchError / ModelLoadError: (at ``attach``) made for another target.
    """

    name = "medusa"
    source = TokenSource.MEDUSA
    target_final_norm = True
    """Ask the engine for the target's final hidden states (``FinalNormTap``)."""

    def __init__(
        self, heads, *, width: int = DEFAULT_WIDTH, max_depth: int | None = None, shape: TreeShape | None = None
    ) -> None:
        from ..models.medusa_gguf import MedusaFormatError, MedusaWeights, read_medusa_gguf

        if width < 1:
            raise InvalidRequestError(f"the Medusa tree width must be >= 1 (got {width})")
        if isinstance(heads, MedusaWeights):
            wts = heads
            self.path = None
        else:
            self.path = os.fspath(heads)
            try:
                wts = read_medusa_gguf(self.path)
            except FileNotFoundError:
                raise ModelLoadError(f"Medusa heads file {self.path} does not exist") from None
            except MedusaFormatError as e:
                raise ModelLoadError(str(e)) from None
        self.heads = MedusaHeads(wts, max_depth, where=self.path)
        self._init_request_state(width, shape)

    def _init_request_state(self, width: int, shape: TreeShape | None) -> None:
        """What belongs to one request (the heads are shared): sampling, history, hidden
        state, calibration and statistics."""
        wts = self.heads.weights
        self.weights = wts
        self.n_heads = self.heads.n_heads
        self.n_embd = wts.n_embd
        self.width = int(width)
        self.d2t = self.heads.d2t
        self.calib = MedusaCalibration(self.n_heads)
        self.history: list[int] = []
        self.sampler: DraftChildSelector | None = None
        self.n_vocab: int | None = None
        self.suppress_ids = ()
        self._h: np.ndarray | None = None
        self._h_pos = -1
        self.n_drafted_steps = 0
        self.fixed_shape = shape
        self.stats = ModelDraftStats(max_depth=self.n_heads, max_width=self.width)
        self._limits = (0, 0)
        self._ran = False

    # -- set-up -----------------------------------------------------------------------------

    def check_target(self, model) -> None:
        """Check the heads against the target ``model`` (the engine calls this before it
        changes anything, so a refused drafter loses nothing).

        Raises:
            ModelLoadError: another hidden size or vocabulary size.
            VocabMismatchError: the draft tokens' texts differ in the target's vocabulary.
        """
        from ..models.medusa_gguf import vocab_fingerprint

        where = self.path or "the Medusa heads"
        if model.n_embd != self.n_embd:
            raise ModelLoadError(
                f"{where} read hidden states of size {self.n_embd}, the target has {model.n_embd}: "
                "they were trained for another model (`localspec train-medusa` makes heads for yours)"
            )
        tv = int(self.weights.target_vocab_size)
        if (tv and tv != model.n_vocab) or int(self.d2t.max()) >= model.n_vocab:
            raise ModelLoadError(
                f"{where} were trained for a target with {tv} tokens, this one has {model.n_vocab}: "
                "they were trained for another model"
            )
        want = self.weights.target_vocab_sha256
        if want and vocab_fingerprint(model, self.d2t) != want:
            raise VocabMismatchError(
                f"{where} draft tokens whose texts differ in this target's vocabulary: they were trained "
                "for another tokenizer (`localspec train-medusa` makes heads for yours)"
            )

    def attach(self, target: TargetHandle) -> None:
        """Check the heads against the target (``check_target``) and bind to it."""
        model = target.model
        self.check_target(model)
        self.n_vocab = model.n_vocab
        self.suppress_ids = model.suppress_tokens
        self.sampler = None

    def set_sampling(self, sampler) -> None:
        """Draft for this request's sampling (a ``RequestState``; None = greedy)."""
        params = sampler.params if sampler is not None else SamplingParams.greedy(seed=0)
        if self.n_vocab is None:
            raise RuntimeError("attach the Medusa drafter to a target first")
        self.sampler = DraftChildSelector(params, self.n_vocab, self.suppress_ids, d2t=self.d2t)

    # -- protocol ---------------------------------------------------------------------------

    def begin(self, history: Sequence[int], context: Sequence[Sequence[int]] = ()) -> None:
        self.history = [int(t) for t in history]
        self._h, self._h_pos = None, -1
        self.calib.reset_request()

    def accept(self, tokens: Sequence[int]) -> None:
        self.history.extend(int(t) for t in tokens)

    def set_final_hidden(self, pos: int, row: np.ndarray) -> None:
        """The target's final hidden state at position ``pos`` ([n_embd] float32): the row
        whose logits produced the token at ``pos + 1``. Heads draft below that token when it
        is the root (``pos == len(history) - 2``)."""
        self._h = np.ascontiguousarray(row, dtype=np.float32).copy()
        self._h_pos = int(pos)

    def head_logits(self, h: np.ndarray) -> np.ndarray:
        """The heads' draft-vocabulary logits for hidden state ``h`` ([n_embd]): [K, V]
        float32 (``MedusaHeads.logits`` of one row)."""
        return self.heads.logits(np.asarray(h, dtype=np.float32)[None, :])[0]

    def ready(self) -> bool:
        """Whether this step can draft: the hidden state of the position before the root is here."""
        return self._h is not None and self._h_pos == len(self.history) - 2

    # the model drafters' two-phase protocol over ``stats``, ``calib``, ``_limits`` and ``_ran``:
    # the planning statistics, the cheap phase (no drafts, no head computation) and learning
    model_stats = ModelDrafter.model_stats
    propose = ModelDrafter.propose
    observe = ModelDrafter.observe
    _step_shape = ModelDrafter._step_shape

    @property
    def draft_group(self) -> MedusaHeads:
        """Drafters sharing these heads draft together (``MedusaHeads.extend_many``)."""
        return self.heads

    def extend(self, shape: TreeShape) -> TokenTree:
        """The heads' sparse tree below the root, of ``shape`` clipped to the limits given to
        ``propose``, the heads (depth) and ``width``; root-only without a hidden state for it
        (``MedusaHeads.extend_many`` of this request alone).

        Requires: ``propose`` was called for this step.
        """
        return self.heads.extend_many([self], [shape])[0]

    def spawn(self) -> "MedusaDrafter":
        """A drafter for another request with the same options, sharing these heads (their
        weights are loaded once) and what the policy learns of them (``stats``), attached to
        the same target."""
        new = object.__new__(MedusaDrafter)
        new.path = self.path
        new.heads = self.heads
        new._init_request_state(self.width, self.fixed_shape)
        new.stats = self.stats
        new.n_vocab, new.suppress_ids = self.n_vocab, self.suppress_ids
        return new

    def close(self) -> None:
        pass
