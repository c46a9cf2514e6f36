"""The speculative step, written once, for one request or many.

::

    for each request:  cheap drafts -> the policy's plan
    planned requests:  the model's drafts, all requests together (one draft decode per tree
                       level, one head computation: drafters.extend_together)
    all requests:      one node budget (SpeculationPolicy.allocate)
    ONE llama_decode:  every request's pending tokens and tree (+ prompt pieces)
    for each request:  verify -> commit its KV -> feed the drafter back -> emit

``Engine`` runs it over a list of one request, ``BatchScheduler`` over its active slots with
the prompt pieces of the requests still prefilling in the same batch. A request is a
``Generation`` (its state) with a ``SequenceCache`` (its KV sequence); neither caller
verifies, commits or emits by itself.

Drafters that read the target (EAGLE-3 heads and MTP blocks: ``target_feature_layers``; Medusa
heads: ``target_final_norm``) get their rows here: the context's tap captures one row per
batch token (``FeatureTap``, ``NextnTap``) or per logits row (``FinalNormTap``), and each
request receives the rows of its own committed tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .backend import Batch, Context, SequenceCache
from .backend.features import FeatureTap, FinalNormTap
from .backend.kv import TreeRows
from .drafters import Drafter
from .drafters.base import extend_together
from .generation import Generation, now_us
from .policy import SpeculationPolicy
from .results import StreamChunk, token_logprobs
from .tree import TokenTree
from .verify import verify


def feature_layers(drafter: Drafter | None) -> tuple | None:
    """The target layers whose inputs ``drafter`` reads (EAGLE-3; ``(NEXTN_FEATURES,)``: MTP),
    or None."""
    layers = getattr(drafter, "target_feature_layers", None)
    return tuple(k if isinstance(k, str) else int(k) for k in layers) if layers else None


def reads_final_norm(drafter: Drafter | None) -> bool:
    """Whether ``drafter`` reads the target's final hidden states (Medusa heads)."""
    return bool(getattr(drafter, "target_final_norm", False))


def tapped_context(model, layers: tuple | None, final_norm: bool, **ctx_args):
    """A target ``Context`` with the tap its drafters read: ``(ctx, tap, norm_tap)``, where
    ``tap`` is a ``FeatureTap`` / ``NextnTap`` for ``layers`` (EAGLE-3 heads, MTP blocks) or
    None, and ``norm_tap`` a ``FinalNormTap`` when ``final_norm`` (Medusa heads) or None.
    The context computes small decodes' logits with the lm_head readout
    (``backend.readout``) unless ``readout=False`` is passed or ``LOCALSPEC_READOUT=llama``.

    Raises:
        InvalidRequestError: both asked (one ``cb_eval`` per context).
    """
    from .backend.features import make_feature_tap
    from .errors import InvalidRequestError

    if layers and final_norm:
        raise InvalidRequestError("a drafter reads either target layer features or final hidden states, not both")
    tap = make_feature_tap(layers, model) if layers else None
    norm_tap = FinalNormTap(model.n_embd) if final_norm else None
    cb_tap = tap or norm_tap
    cb, ud = (cb_tap.callback, cb_tap.user_data) if cb_tap is not None else (None, None)
    from .backend import readout

    ctx_args.setdefault("readout", readout.wanted())
    ctx = Context(model, cb_eval=cb, cb_eval_user_data=ud, **ctx_args)
    if hasattr(tap, "bind"):  # NextnTap: llama.cpp's nextn rows, read after each decode
        tap.bind(ctx)
    return ctx, tap, norm_tap


@dataclass
class Entry:
    """A request on the step: its state and its KV sequence."""

    gen: Generation
    kv: SequenceCache


@dataclass
class Piece:
    """Prompt tokens of a request still prefilling, decoded (without logits) in a step's batch."""

    entry: Entry
    n: int


@dataclass
class Proposal:
    """One request's drafting for a step.

    Attributes:
        candidate: the drafter's tree as proposed (what ``observe`` learns from); the root
            alone when nothing was drafted; None without a drafter.
        tree: the tree to verify (root included, best-first DFS order).
        t_draft_us: what drafting cost (µs).
        plan_nodes: the size the request's own plan chose (root included), or for a model step
            where the cheap drafts verify nothing, what ``select_model_nodes`` chose of the
            model's tree.
        max_nodes: the largest tree it may verify.
        model_step: True when a model drafted this step (its size is kept in a batch). The
            request's score calibration does not learn from such a step: it calibrates the
            cheap drafts' scores, and the model's nodes carry their own (the model drafter's
            acceptance tracker).
        value_stats / value_us: a model step where the cheap drafts verify nothing
            (``SpeculationPolicy.select_model_nodes``): the model's ``ModelDraftStats`` and the
            expected (plain, model) step times, drafting included, that its ``observe_value``
            weighs the emitted tokens with; else None.
        probe: the step's plan was a probe of the model (``StepPlan.probe``).
    """

    candidate: TokenTree | None
    tree: TokenTree
    t_draft_us: float = 0.0
    plan_nodes: int = 1
    max_nodes: int = 1
    model_step: bool = False
    value_stats: object = None
    value_us: tuple[float, float] | None = None
    probe: bool = False


@dataclass
class StepTimes:
    """When one step started and its decode ran (µs, ``now_us``)."""

    t_start: float = 0.0
    t_decode0: float = 0.0
    t_decode1: float = 0.0


class Step:
    """Runs steps over lists of requests on one target context.

    Args:
        ctx: the target context.
        policy: the ``SpeculationPolicy`` (cost model, allocation, calibration).
        max_tree_nodes: largest tree of one request (root included).
        capacity: most tokens one batch holds.
        n_seq_cols: most sequence ids one token of a batch carries.
        adaptive: False verifies every proposed tree up to its limits (tests, experiments).
        tap: the context's ``FeatureTap`` / ``NextnTap`` (drafters reading layer features).
        norm_tap: the context's ``FinalNormTap`` (Medusa heads).
    """

    def __init__(self, ctx: Context, policy: SpeculationPolicy, *, max_tree_nodes: int, capacity: int,
                 n_seq_cols: int, adaptive: bool = True, tap: FeatureTap | None = None,
                 norm_tap: FinalNormTap | None = None) -> None:  # fmt: skip
        self.ctx = ctx
        self.policy = policy
        self.max_tree_nodes = int(max_tree_nodes)
        self.adaptive = adaptive
        self.tap = tap
        self.norm_tap = norm_tap
        self.batch = Batch(capacity, max(1, n_seq_cols))

    # -- propose ------------------------------------------------------------------------------

    def propose(self, entries: Sequence[Entry], *, n_fixed: int = 0) -> list[Proposal]:
        """Every request's tree for this step: its drafts and its own plan, the model drafters
        of all requests together (``propose_many``), then, for several requests, one node
        budget across them (``SpeculationPolicy.allocate``; a request whose model drafted
        keeps its plan's size)."""
        props = propose_many(self.policy, [self._draft_request(e) for e in entries], adaptive=self.adaptive)
        if len(props) > 1 and self.adaptive:
            cands = [p.candidate if p.candidate is not None and not p.model_step else None for p in props]
            sizes = self.policy.allocate(
                cands,
                max_nodes=[p.max_nodes for p in props],
                calibrations=[e.gen.calibration for e in entries],
                n_fixed=n_fixed,
                t_draft_us=sum(p.t_draft_us for p in props),
            )
            for e, p, n in zip(entries, props, sizes):
                if not p.model_step and n != p.plan_nodes:
                    p.tree = self._verified_tree(e, p.candidate, n)
        return props

    def _draft_request(self, e: Entry) -> "DraftRequest":
        g = e.gen
        max_depth, max_nodes = g.limits(e.kv.n_free, self.max_tree_nodes)
        return DraftRequest(g.drafter, g.root, max_depth, max_nodes, g.calibration, g.draft_limits, e.kv.n_scratch)

    def _verified_tree(self, e: Entry, cand: TokenTree | None, n: int) -> TokenTree:
        return verified_tree(cand, n, e.gen.root, e.kv.n_scratch)

    # -- one batch ----------------------------------------------------------------------------

    def run(self, entries: Sequence[Entry], pieces: Sequence[Piece] = (), *, on_decoded=None) -> list[list[StreamChunk]]:
        """One step: propose for every request of ``entries``, decode their trees and the
        prompt ``pieces`` in one batch, then verify, commit, feed back and emit each.

        Returns the chunks each request emitted (a request whose verification raised ends
        with ``finish("error")`` and its ``gen.error`` set; the others go on).
        ``on_decoded(t_us)``, when given, is called right after the decode.

        Raises:
            DecodeError / KVCacheError: the batch failed (every request's KV is as before the
                step; the prompt pieces were not decoded).
        """
        times = StepTimes(t_start=now_us())
        n_fixed = sum(len(e.kv.pending) for e in entries)
        if entries:  # rows after a long context cost more (CostModel.set_context): priced and observed at it
            self.policy.cost.set_context(round(sum(e.kv.n_past for e in entries) / len(entries)))
        props = self.propose(entries, n_fixed=n_fixed)
        pause = self._pause_tap(entries, pieces)
        rows: list[TreeRows] = []
        try:
            for e, p in zip(entries, props):
                rows.append(e.kv.rows(p.tree))
            n_tokens = self._fill(pieces, rows)
            times.t_decode0 = now_us()
            if pause:
                self.tap.paused = True
            try:
                self.ctx.decode(self.batch)
            finally:
                if pause:
                    self.tap.paused = False
        except BaseException:
            for e, r in zip(entries, rows):
                e.kv.drop(r.lay)
            self.clear_taps()
            raise
        logits = self.ctx.logits()
        times.t_decode1 = now_us()
        if on_decoded is not None:
            on_decoded(times.t_decode1)
        f_rows = self.tap.take() if self.tap is not None and not pause else None  # [n_tokens, F], batch order
        h_rows = self.norm_tap.take() if self.norm_tap is not None else None  # [n_outputs, n_embd]
        tok_off = 0
        for pc in pieces:
            self._feed_prompt(pc.entry, pc.n, f_rows, tok_off)
            pc.entry.kv.advance(pc.n)
            tok_off += pc.n
        out: list[list[StreamChunk]] = []
        row_off = 0
        for e, p, r in zip(entries, props, rows):
            n = p.tree.n_nodes
            f = f_rows[tok_off : tok_off + r.n_pending + n] if f_rows is not None else None
            h = h_rows[row_off : row_off + n] if h_rows is not None and h_rows.shape[0] >= row_off + n else None
            out.append(self._finish_one(e, p, r, logits[row_off : row_off + n], f, h, times))
            tok_off += r.n_pending + n
            row_off += n
        if not pieces:  # the cost model prices rows with logits; a step with prompt rows is no sample of it
            t_end = now_us()
            t_decode = times.t_decode1 - times.t_decode0
            t_draft = sum(p.t_draft_us for p in props)
            self.policy.observe_step(n_tokens, t_decode, max(0.0, (t_end - times.t_start) - t_decode - t_draft))
        return out

    def _fill(self, pieces: Sequence[Piece], rows: Sequence[TreeRows]) -> int:
        """Put the prompt pieces (sequence ``base``, no logits) and every request's rows into
        the batch; returns the number of tokens."""
        k = max([r.seq_sets.shape[1] for r in rows] + [1])
        toks, pos, seqs, nseq, outp = [], [], [], [], []
        for pc in pieces:
            t, p = pc.entry.kv.prompt_rows(pc.n)
            s = np.zeros((pc.n, k), dtype=np.int32)
            s[:, 0] = pc.entry.kv.base
            toks.append(t), pos.append(p), seqs.append(s)
            nseq.append(np.ones(pc.n, dtype=np.int32)), outp.append(np.zeros(pc.n, dtype=np.int8))
        for r in rows:
            s = np.zeros((r.tokens.size, k), dtype=np.int32)
            s[:, : r.seq_sets.shape[1]] = r.seq_sets
            toks.append(r.tokens), pos.append(r.pos), seqs.append(s), nseq.append(r.n_seq), outp.append(r.output)
        if len(toks) == 1:
            self.batch.set_tree(toks[0], pos[0], seqs[0], nseq[0], outp[0])
        else:
            self.batch.set_tree(np.concatenate(toks), np.concatenate(pos), np.concatenate(seqs), np.concatenate(nseq),
                                np.concatenate(outp))  # fmt: skip
        return int(self.batch.n_tokens)

    def _pause_tap(self, entries: Sequence[Entry], pieces: Sequence[Piece]) -> bool:
        """Whether this step's decode may run with the feature tap paused: no prompt piece, and
        no request whose drafter will read the rows (a drafter reading target features says
        when it may go without them: ``feature_gate``, then ``SpeculationPolicy.needs_features``)."""
        if self.tap is None or pieces or not self.adaptive or not hasattr(self.tap, "paused"):
            return False
        for e in entries:
            d = e.gen.drafter
            if d is None or not feature_layers(d):
                continue
            stats = getattr(d, "feature_gate", None)
            if stats is None or self.policy.needs_features(stats):
                return False
        return True

    def clear_taps(self) -> None:
        """Drop rows the taps captured and nobody took (a failed decode, a prefill)."""
        if self.tap is not None:
            self.tap.clear()
        if self.norm_tap is not None:
            self.norm_tap.clear()

    # -- per request --------------------------------------------------------------------------

    def _finish_one(self, e: Entry, p: Proposal, r: TreeRows, logits: np.ndarray, f_rows, h_rows,
                    times: StepTimes) -> list[StreamChunk]:  # fmt: skip
        """Verify the request's tree against its logits rows ([n_nodes, n_vocab] float32),
        commit its KV, feed its drafter back and emit its tokens."""
        g, kv, tree = e.gen, e.kv, p.tree
        t2 = now_us()
        if not g.t_gen0_us:
            g.t_gen0_us = times.t_start
        n_past0 = kv.n_past
        cursor = g.state.cursor(kv.root_pos + 1)
        try:
            res = verify(tree, logits, cursor)
        except Exception as err:  # e.g. a grammar with no way on: keep the history, drop the drafts
            kv.commit(tree, r.lay, [])
            g.error = err
            g.finish("error")
            return []
        finally:
            cursor.close()
        want = g.want_logprobs
        lps = token_logprobs(logits, res.rows, res.tokens, want) if want is not None else None
        t3 = now_us()
        kv.commit(tree, r.lay, res.path)
        d = g.drafter
        if d is not None:
            if f_rows is not None and feature_layers(d):  # the committed rows: pending tokens, root, accepted path
                keep = list(range(r.n_pending + 1)) + [r.n_pending + int(x) for x in res.path]
                d.add_target_features(n_past0, f_rows[keep])
            if p.value_us is not None:  # before observe: a probe's outcome replaces the model's averages there
                p.value_stats.observe_value(len(res.tokens), *p.value_us, probe=p.probe)
            d.observe(p.candidate, res.tokens)
            d.accept(res.tokens)
            if h_rows is not None and reads_final_norm(d):
                # the row that produced the last emitted token: it predicts the next root
                d.set_final_hidden(kv.root_pos - 1, h_rows[res.rows[-1]])
        g.state.commit(res.tokens)
        if g.calibration is not None:  # every step, so that plain steps age the evidence; a model step ages it only
            scores = tree.score[1:] if not p.model_step else ()
            g.calibration.observe(np.asarray(scores, dtype=np.float64), len(res.path))
        chunks = g.emit(tree, res, lps)
        st = g.stats
        st.t_draft_us += p.t_draft_us
        st.t_decode_us += times.t_decode1 - times.t_decode0
        st.t_verify_us += t3 - t2
        st.t_other_us += now_us() - t3
        return chunks

    def _feed_prompt(self, e: Entry, n: int, f_rows, off: int) -> None:
        """A drafter reading layer features gets the rows of the prompt tokens just decoded."""
        d = e.gen.drafter
        if f_rows is not None and d is not None and feature_layers(d):
            d.add_target_features(e.kv.n_past, f_rows[off : off + n])


@dataclass
class DraftRequest:
    """One request's drafting inputs for a step (``propose_many``).

    Attributes:
        drafter: the request's drafter (None: a plain step).
        root: the last emitted token (the tree's root).
        max_depth / max_nodes: what the step may verify (tokens still to emit, free cells).
        calibration: the request's ``ScoreCalibration``, or None.
        limits: the request's ``DraftLimits``, or None.
        n_scratch: the request's scratch sequences (leaves a tree may have), or None.
    """

    drafter: Drafter | None
    root: int
    max_depth: int
    max_nodes: int
    calibration: object = None
    limits: object = None
    n_scratch: int | None = None


def propose_many(policy: SpeculationPolicy, reqs: Sequence[DraftRequest], *, adaptive: bool = True) -> list[Proposal]:
    """Every request's drafting for a step, each decided once: its cheap drafts (``propose``),
    its plan (``SpeculationPolicy.plan``: whether a model drafts, in which shape, how much to
    verify), then the model's drafts of every request whose plan says so, together
    (``drafters.extend_together``: the model drafters that share a draft context or heads
    make one model call per tree level, or one head computation, for all of them), each cut
    to its ``max_depth`` and ``limits`` (``DraftLimits``); where the cheap drafts verify
    nothing, the model's own tree, of which the nodes that pay
    (``SpeculationPolicy.select_model_nodes``). Each ``tree`` is what the request would
    verify alone. The time of a shared model call is shared equally by its requests
    (their ``t_draft_us``, and the per-level times the cost model learns)."""
    out: list[Proposal | None] = [None] * len(reqs)
    planned = []  # (index, cheap tree, plan, time of the cheap phase)
    stats: dict[int, object] = {}  # the model's ModelDraftStats the plan used
    for i, r in enumerate(reqs):
        d = r.drafter
        if d is None:
            out[i] = Proposal(None, TokenTree.root_only(r.root))
            continue
        if r.max_depth <= 0 or r.max_nodes <= 1:
            t = TokenTree.root_only(r.root)
            out[i] = Proposal(t, t)
            continue
        t0 = now_us()
        cand = d.propose(r.max_depth, r.max_nodes)
        if cand.base_score is not None and adaptive:  # the memory's nodes join after the n-grams' plan
            cand = policy.keep_base_plan(cand, max_nodes=r.max_nodes, t_draft_us=now_us() - t0, calibration=r.calibration)
            rescored = getattr(d, "use_cheap_tree", None)
            if rescored is not None:
                rescored(cand)
        cand = _clip(d, cand, r.root, r.max_depth, r.limits)
        stats[i] = getattr(d, "model_stats", None)
        plan = policy.plan(
            cand,
            stats[i],
            max_nodes=r.max_nodes,
            max_depth=r.max_depth,
            t_draft_us=now_us() - t0,
            fixed_shape=getattr(d, "fixed_shape", None),
            adaptive=adaptive,
            calibration=r.calibration,
        )
        planned.append((i, cand, plan, now_us() - t0))
    ext = [(i, plan.shape) for i, _, plan, _ in planned if plan.shape is not None]
    t_ext = 0.0
    trees: dict[int, TokenTree] = {}
    if ext:
        t0 = now_us()
        drafters = [reqs[i].drafter for i, _ in ext]
        for (i, _), tree in zip(ext, extend_together(drafters, [s for _, s in ext])):
            trees[i] = _clip(reqs[i].drafter, tree, reqs[i].root, reqs[i].max_depth, reqs[i].limits)
        t_ext = (now_us() - t0) / len(ext)
        seen: set[int] = set()
        for i, _ in ext:  # each shared model call once (its levels' times are per-request shares)
            part = getattr(reqs[i].drafter, "model_part", reqs[i].drafter)
            group = getattr(part, "draft_group", None)
            key = id(group if group is not None else part)
            if key not in seen:
                seen.add(key)
                levels = getattr(group, "last_level_us", None)
                probe = any(plan.probe for j, _, plan, _ in planned if j == i)
                policy.observe_draft_levels(stats[i].last_level_us if levels is None else levels, probe=probe)
    for i, cand, plan, t_cheap in planned:
        r = reqs[i]
        cand = trees.get(i, cand)
        cap = r.max_nodes
        if adaptive and r.calibration is not None:
            cap = min(cap, r.calibration.trust_nodes())
        n = min(plan.n_nodes, r.max_nodes)
        verify, value_us, k = cand, None, None
        if i in trees and adaptive and getattr(r.drafter, "fixed_shape", None) is None:
            own = getattr(r.drafter, "model_tree", None)  # auto: the model's tree before the merge
            own = cand if own is None else _clip(r.drafter, own, r.root, r.max_depth, r.limits)
            k = policy.select_model_nodes(own, plan, max_nodes=r.max_nodes, t_spent_us=t_cheap + t_ext)
        if k is not None:  # the model's own tree, of which what pays
            verify, n = own, k
            if hasattr(r.drafter, "verify_model_only"):
                r.drafter.verify_model_only()
        tree = verified_tree(verify, n, r.root, r.n_scratch)
        if k is not None:
            if plan.probe:  # the probe's plan charged the rows of the model's whole budget
                stats[i].settle_probe_rows(policy.step_us(tree.n_nodes) - policy.step_us(1))
            if own.n_nodes > 1:  # its worth, once verified: against the plain step it replaced
                value_us = (t_cheap + policy.step_us(1), t_cheap + t_ext + policy.step_us(tree.n_nodes))
        out[i] = Proposal(cand, tree, t_cheap + (t_ext if i in trees else 0.0), n, cap, plan.shape is not None,
                          stats[i] if value_us is not None else None, value_us, plan.probe)  # fmt: skip
    return out  # type: ignore[return-value]


def propose_one(policy: SpeculationPolicy, drafter: Drafter | None, root: int, max_depth: int, max_nodes: int, *,
                adaptive: bool = True, calibration=None, limits=None, n_scratch: int | None = None) -> Proposal:  # fmt: skip
    """``propose_many`` of one request (see ``DraftRequest`` for the arguments)."""
    req = DraftRequest(drafter, root, max_depth, max_nodes, calibration, limits, n_scratch)
    return propose_many(policy, [req], adaptive=adaptive)[0]


def _clip(drafter: Drafter, cand: TokenTree, root: int, max_depth: int, limits) -> TokenTree:
    if cand.n_nodes > 1 and int(cand.token_ids[0]) != root:
        raise RuntimeError(f"drafter {drafter.name} proposed a tree rooted at {cand.token_ids[0]}, not {root}")
    if cand.max_depth() > max_depth:
        cand = cand.subtree(cand.depth <= max_depth)
    if limits is not None:
        cand = limits.apply(cand)
    return cand


def verified_tree(cand: TokenTree | None, n: int, root: int, n_scratch: int | None = None) -> TokenTree:
    """The best ``n`` nodes of ``cand`` (root included), cut until their leaves fit in
    ``n_scratch`` scratch sequences, in best-first DFS order; the root alone when ``n <= 1``."""
    if cand is None or n <= 1 or cand.n_nodes <= 1:
        return TokenTree.root_only(root)
    tree = cand.best_subtree(n) if n < cand.n_nodes else cand
    if n_scratch is not None:
        while tree.n_nodes > 1 and not tree.is_chain() and tree.leaves().size > n_scratch:
            tree = tree.best_subtree(tree.n_nodes - 1)
    return tree.best_first_dfs() if tree.n_nodes > 1 else TokenTree.root_only(root)
