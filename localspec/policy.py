"""Adaptive speculation: how many draft tokens to verify at each step, down to none.

The expected number of tokens a step emits when it verifies the tree ``T`` is

    E(T) = 1 + sum over draft nodes v in T of P(target accepts the path root..v)

(the 1 is the recovered/bonus token, always emitted). Drafters put their estimate of that
path probability in ``TokenTree.score``. For each candidate batch size b the best tree is the
b highest-scoring nodes (scores never increase down a path, so that set is a subtree), and
the policy picks the b that maximises expected tokens per second::

    rate(b) = E(best b-node subtree) / (t_draft + t_decode(b) + t_host(b))

with ``t_decode`` from the measured ``CostModel``, ``t_draft`` what drafting this tree cost,
and ``t_host`` (verification, bookkeeping) tracked online. b = 1 is a plain decode step, so
speculation is only used when it is expected to be faster. Acceptance estimates are
calibrated online by ``AcceptanceTracker`` so that optimistic drafters are corrected within a
few steps.

For model drafters (a draft model, an EAGLE-3 head) the policy decides the step *once,
before* any model call (``plan``): from the cheap drafts already made (the n-gram tree with
``--drafter auto``, nothing for a model drafter alone) and what it knows of the model
drafter, whether running the model this step is expected to beat the cheap tree (or plain
decoding) once its drafting time is paid (``prefer_model``), with the shape of the tree to
grow (``model_shape``: the chain or tree of the most expected tokens per µs, from the
model's per-depth acceptance) and the size to verify. The model's
drafting time is the cost model's measured time per draft level (``CostModel.t_draft_us``),
weighed like the target's ``t(b)``. A plan without the model makes no model call. A model
that does not pay is probed (a model step) after gaps that double from ``explore_every``
steps up to where probes take at most ``explore_budget`` of the steps, each long enough that
the probe, priced at the last probe's measured cost (drafting time and rows), costs at most
``explore_budget`` of the time since the last (``explore_gap_due``), and only while the
measured cost of all its probes since it last paid (their drafting time, the catch-up they
forced included, and the rows they added) stays within ``explore_budget`` of the measured
step time since then, over the drafter's life across requests (``probe_due``: a request
whose probe is not due never touches the model). It runs again as soon as a probe pays.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from .costmodel import CostModel
from .tree import TokenTree


def tried_nodes(tree: TokenTree, emitted: Sequence[int]) -> Iterator[tuple[int, bool]]:
    """The nodes of ``tree`` the target tried, walking it along the ``emitted`` tokens: every
    child of a reached node, with whether its token is the next emitted one (then the walk
    goes on below the first such child). Yields ``(node, accepted)``."""
    node = 0
    for tok in emitted:
        nxt = -1
        for c in tree.children(node):
            hit = int(tree.token_ids[c]) == tok
            yield c, hit
            if hit and nxt < 0:
                nxt = c
        if nxt < 0:
            return
        node = nxt


class AcceptanceTracker:
    """Online estimate of P(a draft node is accepted | its parent was), per feature bucket.

    Three levels of evidence, each shrunk towards the one above by pseudo-observations:

    * long-run per-bucket rates (kept for the life of the drafter, starting from ``prior``
      with ``prior_weight``);
    * a per-request calibration factor: accepted nodes over the nodes the long-run rates
      expected to be accepted, over the whole request (``request_factor``, an odds ratio
      with ``factor_weight`` pseudo-observations at 1). A request whose drafts keep failing
      (free generation where the history offers only coincidental matches) lowers every
      bucket at once, also the buckets it has not tried yet; a request that copies raises
      them. Without it each of the ~32 buckets has to fail a few times on its own before
      the policy stops verifying it (issue 15: 0 of 50 drafted tokens accepted over 96 steps);
    * per-request per-bucket counts with exponential forgetting (``decay`` per step), which
      dominate once a bucket has a few observations in the current request, so that a
      request in "copy mode" (summaries, repeated code, loops) or in free generation is
      recognised quickly.

    Drafters feed it every node whose parent the target reached, including nodes the policy
    did not verify (their outcome is known from the tokens the target emitted).

    Args:
        prior: [n_buckets] float prior acceptance rates.
        prior_weight: pseudo-observations behind the prior.
        local_weight: pseudo-observations of the request-calibrated long-run rate behind a
            request's per-bucket estimate.
        decay: forgetting of request counts per step.
        factor_weight: pseudo-observations (expected acceptances) behind a request factor of 1.
        factor_decay: forgetting of the request factor's counts per step (slower than
            ``decay``: it pools all buckets).
    """

    def __init__(
        self,
        prior,
        *,
        prior_weight: float = 8.0,
        local_weight: float = 3.0,
        decay: float = 0.95,
        factor_weight: float = 2.0,
        factor_decay: float = 0.995,
    ) -> None:
        self.prior = np.asarray(prior, dtype=np.float64)
        self.prior_weight = prior_weight
        self.local_weight = local_weight
        self.decay = decay
        self.factor_weight = factor_weight
        self.factor_decay = factor_decay
        self.acc = np.zeros_like(self.prior)
        self.n = np.zeros_like(self.prior)
        self._base = self._base_rates()
        self.reset_request()

    def reset_request(self) -> None:
        self.local_acc = np.zeros_like(self.prior)
        self.local_n = np.zeros_like(self.prior)
        self.req_accepted = 0.0  # accepted nodes this request
        self.req_expected = 0.0  # sum of the long-run rates of the nodes tried this request

    def _base_rates(self) -> np.ndarray:
        base = (self.acc + self.prior_weight * self.prior) / (self.n + self.prior_weight)
        self._base_clipped = np.clip(base, 1e-6, 1.0 - 1e-6)
        return base

    def base_rate(self, bucket: int) -> float:
        """Long-run rate of ``bucket`` (all requests so far, with the prior)."""
        return float(self._base[bucket])

    def request_factor(self) -> float:
        """Odds ratio applied to the long-run rates in this request:
        ``(accepted + w) / (expected + w)`` with ``w = factor_weight``."""
        w = self.factor_weight
        return (self.req_accepted + w) / (self.req_expected + w)

    def estimates(self) -> list[float]:
        """``estimate(b)`` of every bucket (one vectorised computation per step)."""
        return self.estimates_array().tolist()

    def estimates_array(self) -> np.ndarray:
        """``estimates`` as a new [n_buckets] float64 array: the long-run rates ``b`` (clipped
        to [1e-6, 1 - 1e-6] once per step, in ``end_step``) with this request's odds ratio
        ``f`` applied, ``f b / (1 - b + f b)``, shrunk with the request's counts, in a handful
        of numpy calls (the n-gram drafter calls it every step, right after a decode has
        evicted the caches)."""
        f = self.request_factor()
        b = self._base_clipped
        fb = f * b
        rb = fb / (1.0 - b + fb)
        w = self.local_weight
        p = (self.local_acc + w * rb) / (self.local_n + w)
        return np.minimum(p, 0.995, out=p)

    def estimate(self, bucket: int) -> float:
        return self.estimates()[bucket]

    def end_step(self) -> None:
        self.local_acc *= self.decay
        self.local_n *= self.decay
        self.req_accepted *= self.factor_decay
        self.req_expected *= self.factor_decay
        self._base = self._base_rates()

    def record(self, bucket: int, accepted: bool) -> None:
        a = 1.0 if accepted else 0.0
        self.req_expected += self._base[bucket]
        self.req_accepted += a
        self.local_acc[bucket] += a
        self.local_n[bucket] += 1.0
        self.acc[bucket] += a
        self.n[bucket] += 1.0

    def learn(self, tree: TokenTree, emitted: Sequence[int]) -> None:
        """Learn from one step, then end it: walk ``tree`` (as proposed, before pruning) along
        the ``emitted`` tokens; every child of a reached node was "tried", and accepted if its
        token is the next emitted one. ``tree.feature`` holds each node's bucket. With greedy
        or seeded Gumbel verification the emitted tokens do not depend on what was verified,
        so nodes the policy did not verify are scored exactly as if they had been."""
        if tree.n_nodes > 1 and tree.feature is not None:
            for c, hit in tried_nodes(tree, emitted):
                self.record(int(tree.feature[c]), hit)
        self.end_step()


class ScoreCalibration:
    """Calibrates the node scores of the trees the policy verifies by what they realised.

    The per-node estimates are calibrated over every node a drafter tried
    (``AcceptanceTracker``), but the policy verifies only the steps whose estimates are the
    highest, and those are the most overestimated (the winner's curse of choosing by noisy
    estimates). Measured on code prompts (issue 15): the verified trees of one request
    predicted 46.8 tokens over 8 steps and emitted 29, and the prompt ran at 0.78x of plain
    decoding. This class measures that bias where it matters, on the verified trees, and
    corrects the next candidates' scores by a power law, ``score ** gamma`` (a path of
    per-node probabilities ``p`` becomes one of ``p ** gamma``: temperature scaling of the
    node probabilities in log space; Guo et al. 2017 calibrate classifiers the same way).
    ``gamma`` solves

        sum_i w_i * (sum_v s_iv ** gamma - a_i) = lam * log(gamma)

    over this request's verified trees ``i`` (draft-node scores ``s_iv``, ``a_i`` draft
    tokens accepted, weights ``w_i`` forgotten by ``decay`` per step so that after a run of
    plain steps the policy tries again), with ``lam`` tokens of evidence pulling ``gamma``
    towards the long-run value (the geometric mean of the exponents of earlier requests, 1
    at first). The left side falls and the right side rises with ``gamma``, so the root is
    unique; it is found on ``log gamma`` in [``lo``, ``hi``] by safeguarded Newton steps from
    the last fit (a handful of evaluations per step). Overconfident
    drafts get ``gamma > 1`` (verified trees shrink or stop), underconfident ones ``< 1``.

    Before a request has verified a tree the exponent is the long-run one but never below 1:
    other requests' underconfident drafts (a translation that copied more than its scores
    said) do not inflate a new request's first trees; those are verified only where the
    drafts' own estimates (``AcceptanceTracker``: match length, support) pay for their rows
    at the cost table's price. A short answer (a 12-token summary) never earns back a tree
    risked on borrowed optimism.
    """

    def __init__(
        self,
        *,
        lam: float = 1.0,
        decay: float = 0.995,
        lo: float = 0.5,
        hi: float = 10.0,
        keep: int = 64,
        first_nodes: int = 8,
    ) -> None:
        self.lam, self.decay, self.lo, self.hi, self.keep = lam, decay, lo, hi, keep
        self.first_nodes = first_nodes
        self.log_center = 0.0  # log of the long-run exponent
        self._n_requests = 0
        self.begin_request()

    def begin_request(self) -> None:
        if getattr(self, "_trees", None):  # the request before this one verified trees
            self._fold(self.exponent())
        self._trees: list[tuple[np.ndarray, float, int]] = []  # (draft-node scores, accepted, step)
        self._step = 0  # steps observed in this request
        self._gamma: float | None = None
        self._last_lg = self.log_center  # where the next fit starts
        self._max_accepted = 0

    def _fold(self, exponent: float) -> None:
        """Fold a finished request's exponent into the long-run one (a running geometric
        mean over the last ~8 requests)."""
        self._n_requests += 1
        self.log_center += (math.log(exponent) - self.log_center) / min(self._n_requests, 8)

    def for_request(self) -> "ScoreCalibration":
        """A calibration for one of several concurrent requests (``BatchScheduler``): fresh,
        starting from this one's long-run exponent; ``end_request`` folds it back."""
        c = ScoreCalibration(lam=self.lam, decay=self.decay, lo=self.lo, hi=self.hi, keep=self.keep,
                             first_nodes=self.first_nodes)  # fmt: skip
        c.log_center = self.log_center
        return c

    def end_request(self, done: "ScoreCalibration") -> None:
        """A concurrent request made by ``for_request`` ended: its exponent joins the long-run
        one (when it verified any tree)."""
        if done.verified_any:
            self._fold(done.exponent())

    @property
    def verified_any(self) -> bool:
        """Whether this request has verified a tree (its exponent is fitted, not the prior)."""
        return bool(self._trees)

    def trust_nodes(self) -> int:
        """Largest tree worth risking now: ``first_nodes`` until this request has verified
        a tree, then twice the longest accepted run so far plus one (a copying request reaches
        64 nodes in three steps; one whose drafts fail never risks more than ``first_nodes``)."""
        return max(self.first_nodes, 2 * (self._max_accepted + 1))

    def observe(self, scores: np.ndarray, accepted: int) -> None:
        """One step: the draft-node scores of the verified tree (empty for a plain step) and
        how many of its draft tokens the target accepted."""
        self._step += 1
        if scores.size:
            self._max_accepted = max(self._max_accepted, int(accepted))
            self._trees.append((np.asarray(scores, dtype=np.float64), float(accepted), self._step))
            if len(self._trees) > self.keep:
                del self._trees[0]
        self._gamma = None

    def exponent(self) -> float:
        if self._gamma is not None:
            return self._gamma
        if not self._trees:  # no evidence of this request's own: never more optimistic than its drafts' scores
            self._gamma = float(min(max(math.exp(self.log_center), 1.0), self.hi))
            return self._gamma
        w_tree = [self.decay ** (self._step - step) for _, _, step in self._trees]  # forgotten per step
        s = np.concatenate([t for t, _, _ in self._trees])
        w = np.concatenate([np.full(t.size, w_i) for (t, _, _), w_i in zip(self._trees, w_tree)])
        a = float(sum(w_i * a_i for (_, a_i, _), w_i in zip(self._trees, w_tree)))
        ls = np.log(np.clip(s, 1e-12, 1.0))

        def excess(lg: float) -> tuple[float, float]:  # the left side minus the right, and its slope
            x = np.exp(lg)
            e = w * np.exp(x * ls)
            return float(e.sum()) - a - self.lam * (lg - self.log_center), float(x * np.dot(e, ls)) - self.lam

        lo_g, hi_g = math.log(self.lo), math.log(self.hi)
        # safeguarded Newton (bisection inside the bracket when a step leaves it): the excess
        # decreases strictly (slope <= -lam), so the root is unique; a handful of evaluations
        # from the last fit instead of 40 halvings (this runs on every step that drafts). A
        # root outside [lo, hi] gives the bound.
        lo, hi = lo_g, hi_g
        g = min(max(self._last_lg, lo_g), hi_g)
        for _ in range(100):
            f, df = excess(g)
            if f > 0.0:
                lo = g
            else:
                hi = g
            if f == 0.0 or hi - lo < 1e-12 or (g == lo_g and f < 0.0) or (g == hi_g and f > 0.0):
                break
            nxt = min(max(g - f / df, lo_g), hi_g)
            if not (lo < nxt < hi or nxt == lo_g == lo or nxt == hi_g == hi):
                nxt = 0.5 * (lo + hi)
            if abs(nxt - g) < 1e-13:
                g = nxt
                break
            g = nxt
        self._last_lg = g
        self._gamma = float(math.exp(g))
        return self._gamma

    def calibrate(self, scores: np.ndarray) -> np.ndarray:
        """``scores ** gamma`` (order preserved). [n] float64."""
        g = self.exponent()
        return scores if g == 1.0 else np.power(scores, g)


@dataclass(frozen=True)
class TreeShape:
    """The shape of a model-drafted tree (see ``drafters.tree_expand``).

    Attributes:
        depth: levels of children (draft decodes after the first one).
        width: top-k: children added per expanded node, and nodes expanded per level.
        max_nodes: node budget of the returned tree (root included).
        min_score: stop expanding once no frontier node's score reaches this.
    """

    depth: int
    width: int
    max_nodes: int
    min_score: float = 0.02

    def __post_init__(self) -> None:
        if self.depth < 1 or self.width < 1 or self.max_nodes < 1:
            raise ValueError(f"invalid tree shape {self}")

    def clipped(self, *, max_depth: int, max_width: int, max_nodes: int) -> "TreeShape":
        return TreeShape(
            depth=max(1, min(self.depth, max_depth)),
            width=max(1, min(self.width, max_width)),
            max_nodes=max(1, min(self.max_nodes, max_nodes)),
            min_score=self.min_score,
        )


MODEL_DEPTHS = 16  # depths with their own acceptance counts in ModelDraftStats


@dataclass
class ModelDraftStats:
    """What the policy knows about a model drafter (draft model, EAGLE-3 head), learned online.

    Attributes:
        t_draft_us: moving average of the drafting time of a step (all its draft decodes).
        accept_length: moving average of the drafter's accepted tokens per step it drafted
            (counted along its own tree, so also when the policy verified less of it).
        n_nodes: moving average of the verified tree size of its steps.
        n_steps: steps it drafted.
        steps_since_run: steps since it last drafted (the plan may skip it).
        max_depth / max_width: the largest shape the drafter can grow.
        last_level_us: time of each level's model call in its last drafted step (µs).
        t_host_us: moving average of the drafting time outside model calls (ranking rows,
            building the tree), µs per drafted step.
        gain_length: moving average of the tokens the model's drafts got accepted *beyond*
            the cheap drafts verified with them (``AutoDrafter``: beyond what the n-gram
            tree alone got accepted); for a drafter alone it is ``accept_length``.
        explore_gap: steps without the model before the policy probes it again while it does
            not pay (0: none probed yet; ``SpeculationPolicy.plan`` doubles it at each probe
            and resets it when the model pays).
        probe: the step the model drafts now is a probe (``plan``): its outcome replaces the
            averages of ``accept_length`` and ``gain_length``, which are stale after the gap.
        n_probes: probes planned over the drafter's life (the first is free: a new model is
            tried once).
        explore_from_us: the policy's step clock (``SpeculationPolicy.t_steps_us``, µs) when
            the model last paid or was first planned with: the start of the exploration window.
        explore_spent_us: what the probes in that window cost (µs): each probe's measured
            drafting time (level 0 with the catch-up it forced, and the deeper levels) plus the
            rows it added to the verified tree (``probe_rows_us``, cost table); reserved at
            ``plan`` as ``probe_cost_us`` (``probe_reserved_us``) and settled by ``observe_draft``.
        last_probe_us: the measured cost of the last probe (µs, as charged), 0 before one.
        last_shape: the shape the last plan with this model priced (``needs_features``).
        value / n_value: where the cheap drafts verify nothing (the step would be plain without
            the model), what running the model was worth: the rate of the step it drafted, as
            ``SpeculationPolicy.select_model_nodes`` verified it (only the nodes that pay by
            their own scores, its drafting time spent) and the target accepted it, over the
            rate of the plain step it replaced (> 1: it paid; ``observe_value``, from the
            engine's step). A moving average over such steps (``alpha``); a probe's replaces
            it, as it replaces the averages. ``n_value``: steps observed.
        depth_tried / depth_ok: per depth d (index d - 1), decayed counts of the model's steps
            whose path reached depth d - 1 accepted with a node drafted at depth d, and of those
            whose depth-d node was accepted (``observe_accept`` with ``depth``; each count decays
            by ``depth_decay`` per observation, and a probe's outcome replaces them, as it
            replaces the averages): ``depth_rates`` estimates from them the chance
            that the model's drafts are accepted to each depth (``SpeculationPolicy.model_shape``).
    """

    t_draft_us: float = 0.0
    accept_length: float = 1.0
    gain_length: float = 1.0
    n_nodes: float = 2.0
    n_steps: int = 0
    steps_since_run: int = 0
    alpha: float = 0.2
    max_depth: int = 8
    max_width: int = 8
    last_level_us: list[float] = field(default_factory=list)
    t_host_us: float = 0.0
    explore_gap: int = 0
    probe: bool = False
    n_probes: int = 0
    explore_from_us: float | None = None
    explore_spent_us: float = 0.0
    probe_reserved_us: float = 0.0
    probe_rows_us: float = 0.0
    last_probe_us: float = 0.0
    last_shape: "TreeShape | None" = None
    depth_tried: list[float] = field(default_factory=lambda: [0.0] * MODEL_DEPTHS)
    depth_ok: list[float] = field(default_factory=lambda: [0.0] * MODEL_DEPTHS)
    depth_decay: float = 0.98
    value: float = 0.0
    n_value: int = 0

    def _ema(self, old: float, new: float) -> float:
        return new if self.n_steps <= 1 else old + self.alpha * (new - old)

    def observe_draft(self, t_draft_us: float, n_nodes: int, level_us: Sequence[float] = ()) -> None:
        """One drafted step: its total time (µs), tree size and the time of each level's
        model call (µs, level 0 first: the cost model's ``observe_draft_levels`` input)."""
        self.n_steps += 1
        self.steps_since_run = 0
        self.t_draft_us = self._ema(self.t_draft_us, t_draft_us)
        self.n_nodes = self._ema(self.n_nodes, float(n_nodes))
        self.last_level_us = [float(t) for t in level_us]
        self.t_host_us = self._ema(self.t_host_us, max(0.0, t_draft_us - sum(self.last_level_us)))
        if self.probe:  # the probe's measured cost replaces what its plan reserved
            self.last_probe_us = t_draft_us + self.probe_rows_us
            self.explore_spent_us += self.last_probe_us - self.probe_reserved_us
            self.probe_reserved_us = 0.0

    def observe_accept(self, n_accepted: int, gain: int | None = None, depth: int | None = None,
                       n_emitted: int | None = None) -> None:  # fmt: skip
        """A drafted step: ``n_accepted`` tokens along the model's tree, ``gain`` of them beyond
        what the cheap drafts got (None: the model drafted alone, gain = ``n_accepted``); a
        probe's outcome replaces the averages. ``depth``: the depth of the model's tree, for the
        per-depth counts (a path accepted to the tree's depth says nothing of deeper ones).
        ``n_emitted``: the tokens the step emitted (None: more than ``n_accepted``). A depth
        counts as tried only where an emitted token tested it: where the policy verified part
        of the tree (``select_model_nodes``), every emitted token (the target's own next one
        included) can follow the model's path, and its nodes below were never tested, not
        rejected."""
        if depth is not None and depth > 0:
            keep = 0.0 if self.probe else self.depth_decay  # a probe's outcome replaces the counts too
            for d in range(MODEL_DEPTHS):
                self.depth_tried[d] *= keep
                self.depth_ok[d] *= keep
            tried = n_accepted + 1 if n_emitted is None else min(n_accepted + 1, n_emitted)
            for d in range(min(depth, tried, MODEL_DEPTHS)):
                self.depth_tried[d] += 1.0
                if d < n_accepted:
                    self.depth_ok[d] += 1.0
        gain = float(n_accepted if gain is None else gain)
        if self.probe:
            self.probe = False
            self.accept_length, self.gain_length = float(n_accepted), gain
            return
        self.accept_length = self._ema(self.accept_length, float(n_accepted))
        self.gain_length = self._ema(self.gain_length, gain)

    def observe_value(self, n_emitted: int, t_plain_us: float, t_model_us: float, *, probe: bool = False) -> None:
        """A model step where the cheap drafts verified nothing, once verified: it emitted
        ``n_emitted`` tokens in an expected ``t_model_us`` where the plain step it replaced
        would have emitted one in ``t_plain_us`` (both from the cost table, with the step's
        drafting time); their rates' ratio updates ``value``. ``probe``: the step's plan was a
        probe (``StepPlan.probe``, not the shared ``probe`` flag, which another request's plan
        of the same step may have changed): its outcome replaces the average, stale after the
        gap."""
        ratio = n_emitted * t_plain_us / max(t_model_us, 1e-9)
        self.value = float(ratio) if probe or self.n_value == 0 else self.value + self.alpha * (ratio - self.value)
        self.n_value += 1

    def settle_probe_rows(self, rows_us: float) -> None:
        """A probe verified rows costing ``rows_us`` (µs, beyond a plain step's) instead of the
        ``probe_rows_us`` its plan charged (``select_model_nodes`` verified less of its tree):
        its measured cost and the exploration window's spending follow."""
        delta = float(rows_us) - self.probe_rows_us
        self.probe_rows_us = float(rows_us)
        self.last_probe_us += delta
        self.explore_spent_us += delta

    def skipped(self) -> None:
        self.steps_since_run += 1

    def depth_rates(self, max_depth: int) -> np.ndarray | None:
        """[max_depth] float64: the estimated chance that the model's drafts are accepted at
        least to depth 1, 2, ... (products of each depth's conditional rate, with the rate of
        the depth above as the prior of one with fewer than 2 observations), or None before
        any observation."""
        if self.depth_tried[0] <= 0.0:
            return None
        out = np.zeros(max_depth)
        q, prior = 1.0, 0.5
        for d in range(min(max_depth, MODEL_DEPTHS)):
            n, k = self.depth_tried[d], self.depth_ok[d]
            r = (k + 2.0 * prior) / (n + 2.0)  # two pseudo-observations at the prior
            q *= r
            out[d] = q
            prior = r
        if max_depth > MODEL_DEPTHS:
            out[MODEL_DEPTHS:] = q * prior ** np.arange(1, max_depth - MODEL_DEPTHS + 1)
        return out


def accepted_length(tree: TokenTree, emitted: Sequence[int]) -> int:
    """How many leading ``emitted`` tokens follow a path of ``tree`` from its root."""
    node, n = 0, 0
    for tok in emitted:
        nxt = next((c for c in tree.children(node) if int(tree.token_ids[c]) == tok), -1)
        if nxt < 0:
            break
        node, n = nxt, n + 1
    return n


@dataclass
class Choice:
    """The policy's decision for one step."""

    n_nodes: int  # batch size b (root included); 1 = plain decode
    expected_tokens: float
    expected_rate: float  # tokens per µs


@dataclass(frozen=True)
class StepPlan:
    """What a step verifies, decided once before any model call (``SpeculationPolicy.plan``),
    but for a model step where the cheap drafts verify nothing: how much of the model's tree,
    once it is drafted (``SpeculationPolicy.select_model_nodes``).

    Attributes:
        n_nodes: nodes to verify (root included; 1 = plain decode): the best ``n_nodes`` of
            the step's candidate tree by score.
        shape: the tree the model drafter grows this step, or None: no model call.
        probe: the model drafts because a probe is due, not because it pays: the step's
            outcome is no evidence about the calibration of the request's drafts (a head that
            fails its probe must not make the request's n-gram trees look overconfident).
        cheap_nodes: what the cheap drafts alone would verify (root included; 1: nothing, the
            step would be plain; None: not decided, as with ``adaptive=False``): with a model
            step where it is 1, ``select_model_nodes`` decides how much of the model's tree to
            verify once the model has drafted (``n_nodes`` is then its most).
    """

    n_nodes: int
    shape: TreeShape | None
    probe: bool = False
    cheap_nodes: int | None = None


class SpeculationPolicy:
    """Chooses the verified tree for each step (see module docstring).

    Args:
        cost: the target's ``CostModel``.
        max_nodes: largest tree to verify (root included).
        min_gain: speculate only when the expected rate beats plain decoding by this fraction
            (estimation errors make marginal choices lose on average).
    """

    def __init__(self, cost: CostModel, *, max_nodes: int = 64, min_gain: float = 0.05) -> None:
        self.cost = cost
        self.max_nodes = max_nodes
        self.min_gain = min_gain
        self.t_host_base_us = 1500.0  # per step, refined online
        self.t_host_node_us = 100.0  # per extra node, refined online
        self._host_node_prior = self.t_host_node_us
        self._host_node_load = 1.0  # cost.load() when t_host_node_us was last refined
        self._alpha = 0.1
        self.verify_cost_factor = 2.5  # tree_shape: verification budget, in plain decodes
        self.width_credit = 0.05  # model_shape: tree_shape's tree wins within this of the best chain's rate
        self.explore_every = 32  # plan: first gap (steps) between probes of a model drafter that does not pay
        self.explore_budget = 0.01  # plan: probes take at most this fraction of the steps and of their time
        self.feature_lead = 4  # needs_features: steps before a possible model step from which its head gets rows
        self.t_steps_us = 0.0  # measured time of every step so far (decode + host, µs): probe_due's clock
        self.calibration = ScoreCalibration()

    def host_us(self, b: int) -> float:
        return self.t_host_base_us + self.t_host_node_us * (b - 1)

    def allocate(
        self,
        candidates: Sequence[TokenTree | None],
        *,
        max_nodes: Sequence[int],
        calibrations: Sequence["ScoreCalibration | None"],
        n_fixed: int = 0,
        t_draft_us: float = 0.0,
    ) -> list[int]:
        """Tree size per request for one step of ``len(candidates)`` requests (``allocate_nodes``
        with this policy's cost model, host cost, gain margin and bound)."""
        return allocate_nodes(
            candidates,
            self.step_us,
            n_fixed=n_fixed,
            max_nodes=max_nodes,
            t_extra_us=t_draft_us,
            min_gain=self.min_gain,
            calibrations=calibrations,
            cost_floor=self._cost_floor,
        ).sizes

    def step_us(self, b: int) -> float:
        """Expected time of a step whose batch holds ``b`` tokens (µs): decode plus host."""
        return self.cost.t_decode_us(b) + self.host_us(b)

    def _cost_floor(self, lo: int, hi: int) -> float:
        """No step of ``lo..hi`` tokens costs less than this (µs): the cheapest decode of that
        range (``CostModel.min_ratio``) plus the host time of ``lo`` tokens."""
        return self.cost.t1_us() * self.cost.min_ratio(lo, hi) + self.host_us(lo)

    def choose(
        self,
        tree: TokenTree,
        *,
        max_nodes: int | None = None,
        t_draft_us: float = 0.0,
        calibration: "ScoreCalibration | None" = None,
        raw: bool = False,
    ) -> Choice:
        """Best batch size for ``tree`` (the candidate tree from the drafter): ``allocate_nodes``
        for one request, within its calibration's trust region (``calibration``: the request's,
        default the policy's own).

        ``t_draft_us`` is what drafting this tree cost: already spent, it is part of this
        step's time whatever size is verified. ``raw``: the scores as they are, no calibration
        nor trust region (a model drafter's nodes: its acceptance tracker calibrated them).
        """
        calibration = calibration or self.calibration
        limit = min(self.max_nodes, tree.n_nodes, max_nodes or self.max_nodes)
        if not raw:
            limit = min(limit, calibration.trust_nodes())
        a = allocate_nodes(
            [tree],
            self.step_us,
            max_nodes=[limit],
            t_extra_us=t_draft_us,
            min_gain=self.min_gain,
            calibrations=[None if raw else calibration],
            cost_floor=self._cost_floor,
        )
        return Choice(a.sizes[0], a.expected_tokens, a.expected_rate)

    def select_model_nodes(self, tree: TokenTree, plan: "StepPlan", *, max_nodes: int, t_spent_us: float) -> int | None:
        """How much of a model step's tree to verify where the cheap drafts verify nothing,
        decided once the model has drafted; None elsewhere (the plan's size of the merged tree
        stands, never fewer nodes than the cheap drafts alone would verify).

        Where the cheap drafts would verify nothing (``plan.cheap_nodes == 1``: the step would
        be plain without the model) the step verifies the model's own tree only (the cheap
        drafts the policy would not verify are dropped, also where both drafted a token: the
        merged node would carry the cheap draft's uncalibrated score), and its nodes compete on
        their own scores, which the model's acceptance tracker calibrated per draft confidence
        and request (``DraftCalibration``; EAGLE-2's observation that a draft's confidence
        predicts its acceptance): ``choose`` with those scores (not the request's calibration,
        which is of the cheap drafts' scores) and the drafting time as spent, so an unsure
        draft is not verified (the step is plain, having paid only the drafting). A tree of
        sampled children (classic rejection sampling) is verified whole, as planned: its
        tracker learns from every node it drafted, which is fair only for nodes verified under
        that rule. The engine then measures the step's worth (``ModelDraftStats.observe_value``).

        Args:
            tree: the model's own tree this step (root included, cut to the request's limits).
            plan: the step's ``StepPlan`` (a model step: ``plan.shape`` set).
            max_nodes: the most the request may verify (root included).
            t_spent_us: time the step has spent drafting (cheap drafts and model, µs).
        Returns:
            nodes of ``tree`` to verify (root included; 1: none, also where the model drafted
            nothing), or None.
        """
        if plan.cheap_nodes != 1:
            return None
        if tree.n_nodes <= 1:  # the model drafted nothing (cut to the limits): a plain step
            return 1
        if tree.stochastic_nodes().size:
            return min(plan.n_nodes, max_nodes)
        return self.choose(tree, max_nodes=max_nodes, t_draft_us=t_spent_us, raw=True).n_nodes

    def keep_base_plan(
        self,
        tree: TokenTree,
        *,
        max_nodes: int | None = None,
        t_draft_us: float = 0.0,
        calibration: "ScoreCalibration | None" = None,
    ) -> TokenTree:
        """``tree`` with scores such that its added nodes (``TokenTree.base_score``: the
        drafting memory's, merged into the n-gram tree) never displace what the first tree
        alone would have had verified: the nodes ``S`` that ``choose`` picks from the first
        tree (its scores before the merge) rank above every other node, so the best ``k``
        nodes contain ``S`` for every ``k >= |S|`` and are ``choose``'s own for ``k <= |S|``.

        ``S`` keeps its first-tree scores; every other node's score is multiplied by one
        factor ``f <= 1`` (the smallest that puts it below ``S``'s lowest), which keeps their
        order and scores that never increase down a path. When the first tree alone would
        verify nothing, the added nodes compete on their own scores (``f = 1``).

        Returns ``tree`` itself when it has no ``base_score``; otherwise a copy without it.
        """
        base = tree.base_score
        if base is None:
            return tree
        out = replace(tree, score=np.array(tree.score, dtype=np.float64), base_score=None)
        m = int(base.size)
        if m <= 1:
            return out
        first = replace(tree.subtree(np.arange(tree.n_nodes) < m), score=base, base_score=None)
        n = self.choose(first, max_nodes=max_nodes, t_draft_us=t_draft_us, calibration=calibration).n_nodes
        if n <= 1:
            return out
        keep = np.lexsort((np.arange(m), -base))[:n]  # best_subtree's order: score, then lower index
        chosen = np.zeros(tree.n_nodes, dtype=bool)
        chosen[keep] = True
        score = out.score
        score[keep] = base[keep]
        lo = float(score[chosen].min())
        others = ~chosen
        hi = float(score[others].max(initial=0.0))
        if hi >= lo:
            score[others] *= lo / hi * (1.0 - 1e-9)
        return out

    # -- model drafters -----------------------------------------------------------------------

    def tree_shape(self, stats: ModelDraftStats, *, max_depth: int, max_nodes: int, max_width: int) -> TreeShape:
        """Shape of the next model-drafted tree.

        * node budget: the largest tree whose verification costs at most
          ``verify_cost_factor`` plain decodes on this machine (about 4 nodes on a 2-core CPU,
          64 on a GPU, where a batch costs about as much as one token);
        * depth: the drafter's recent accepted length plus 2 (drafting deeper than it is
          accepted costs draft decodes for nothing);
        * width (top-k per node and nodes expanded per level): the budget spread over the depth.
        """
        t1 = self.cost.t1_us()  # = t_decode_us(1)
        cap = self.verify_cost_factor * t1
        budget = 2
        for b in self.cost.sizes:  # ascending
            if b > max_nodes:
                break
            if t1 * self.cost.ratio(b) <= cap:  # t_decode_us(b)
                budget = max(budget, b)
        budget = min(budget, max_nodes)
        depth = int(min(max_depth, max(2, math.ceil(stats.accept_length) + 2)))
        width = int(min(max_width, max(1, math.ceil((budget - 1) / depth))))
        return TreeShape(depth=depth, width=width, max_nodes=budget)

    def model_shape(self, stats: ModelDraftStats, *, max_depth: int, max_nodes: int, max_width: int) -> TreeShape:
        """Shape of the next model-drafted tree: the one with the most expected tokens per µs
        (``model_rate``) among chains of every depth up to ``max_depth`` and ``tree_shape``'s
        tree, which also wins when its rate is within ``width_credit`` of the best chain's
        (its width adds acceptance that the estimate, made from the per-depth rates of the
        drafts on each path, does not count). Before the model's drafts were verified (no
        per-depth counts) ``tree_shape``'s.

        Where a verified node costs a good part of a decode (the 2-core development CPU:
        t(2) = 1.17 t(1)), a head whose first draft is accepted about half the time drafts
        chains of one or two; where a batch costs about one token (a GPU) the same head
        drafts deeper, each node still priced at its host time (``host_us``)."""
        base = self.tree_shape(stats, max_depth=max_depth, max_nodes=max_nodes, max_width=max_width)
        q = stats.depth_rates(max_depth)
        if q is None:
            return base
        best, best_rate = None, -1.0
        for depth in range(1, min(max_depth, max_nodes - 1) + 1):
            chain = TreeShape(depth=depth, width=1, max_nodes=depth + 1)
            r = self.model_rate(stats, chain, q)
            if r > best_rate:
                best, best_rate = chain, r
        if best is None or self.model_rate(stats, base, q) >= best_rate * (1.0 - self.width_credit):
            return base
        return best

    def model_rate(self, stats: ModelDraftStats, shape: TreeShape, q: np.ndarray | None = None, *, t_spent_us: float = 0.0) -> float:
        """Expected tokens per µs of a model step of ``shape`` (its drafting, verification and
        host time), credited with what the model is expected to get accepted beyond the cheap
        drafts: the expected accepted length of ``shape.depth`` levels, or of as many as its
        ``shape.max_nodes - 1`` drafted nodes can reach when fewer (``depth_rates``, over
        the last ~50 drafted steps) times the share of the model's recent accepted tokens that
        were a gain (``gain_length / accept_length``, moving averages; nothing when its recent
        drafts got nothing accepted: its probes decide when it comes back); ``gain_length``
        before any per-depth count. ``t_spent_us``: time this step already spent (the cheap
        drafts), part of its time whatever it verifies, as in ``choose``'s rates."""
        # a tree of n drafted nodes reaches at most depth n: (depth 4, 2 nodes) drafts one node
        reach = max(0, min(shape.depth, shape.max_nodes - 1))
        if q is None or q.size < reach:
            q = stats.depth_rates(reach)
        if q is None:
            gain = stats.gain_length
        else:
            share = min(1.0, stats.gain_length / stats.accept_length) if stats.accept_length > 1e-9 else 0.0
            gain = share * float(np.sum(q[:reach]))
        b = shape.max_nodes
        return (1.0 + gain) / (t_spent_us + self.model_step_us(stats, shape) + self.cost.t_decode_us(b) + self.host_us(b))

    def model_step_us(self, stats: ModelDraftStats, shape: TreeShape) -> float:
        """Expected drafting time of a model step of ``shape`` (µs): the cost model's measured
        time of ``shape.depth`` draft levels plus the drafter's host time; the drafter's
        own average before any level is measured."""
        t = self.cost.t_draft_us(shape.depth)
        return stats.t_draft_us if t is None else t + stats.t_host_us

    def prefer_model(self, cheap: Choice, stats: ModelDraftStats, shape: TreeShape | None = None, *,
                     t_spent_us: float = 0.0) -> bool:  # fmt: skip
        """Does running the model drafter this step pay, rather than verifying only the cheap
        drafts (the n-gram tree, or nothing), whose best choice is ``cheap``? Compares the
        expected tokens per µs of a model step of ``shape``, including its drafting time, with
        the cheap step. False for a model never run (no evidence: ``plan`` probes it).

        The model step is credited with what the model is expected to get accepted beyond the
        cheap drafts verified with it (``model_rate``; for a model drafting alone its
        acceptance): tokens both drafters proposed are no gain of the model, and the merged
        step verifies only ``shape.max_nodes`` nodes, so it cannot count on the cheap tree's
        longer runs either. Like ``choose``, it must beat the cheap step by ``min_gain``.
        ``t_spent_us``: the time the step already spent on the cheap drafts (``model_rate``).

        Where the cheap drafts verify nothing (``cheap.n_nodes == 1``) the model also runs
        where its ``value`` is above 1 (its such steps beat the plain steps they replaced),
        even if the estimate does not pay: such a step verifies only the model's nodes that pay
        by their own scores (``select_model_nodes``), so a model whose drafts are mostly unsure
        costs its drafting time there and not the rows of drafts that fail, which
        ``model_rate``'s verify-everything estimate charges; by the same token, where that
        estimate pays, such a step does too, and a value below 1 (a short average, or one
        probe's outcome) does not overrule it. (Measured 2026-12-05, the head alone against
        the rule before the measured worth: with the value alone deciding, 1.07x on bare
        Spec-Bench prompts but 0.91-0.97x as user turns, where the head is strong and a few
        failing steps switched it off; with either, 1.07x and 1.05x.)
        (Measured 2026-12-01 on Spec-Bench: crediting the whole acceptance length gave
        ``auto`` 0.86x of ``ngram``; crediting the cheap tree's expected tokens plus the gain
        0.55x, because the head then ran, with its small budget, where the n-grams had long
        runs.)"""
        if stats.n_steps == 0:
            return False
        if cheap.n_nodes <= 1 and stats.value > 1.0:  # its nodes only verified where they pay (0 before any)
            return True
        if shape is not None:
            rate = self.model_rate(stats, shape, t_spent_us=t_spent_us)
        else:
            b = max(2, int(round(stats.n_nodes)))
            rate = (1.0 + stats.gain_length) / (t_spent_us + stats.t_draft_us + self.cost.t_decode_us(b) + self.host_us(b))
        return rate > cheap.expected_rate * (1.0 + self.min_gain)

    def probe_us(self, stats: ModelDraftStats, shape: TreeShape) -> float:
        """What a probe costs beyond a plain step (µs), where the model does not pay: its
        drafting time (``model_step_us``, the cost model's measured levels) and the rows of
        the ``shape.max_nodes`` nodes it verifies (the cost table)."""
        return self.model_step_us(stats, shape) + self.step_us(max(1, shape.max_nodes)) - self.step_us(1)

    def probe_cost_us(self, stats: ModelDraftStats, shape: TreeShape) -> float:
        """What the next probe is expected to cost beyond a plain step (µs): the last probe's
        measured cost (``ModelDraftStats.last_probe_us``: its drafting time with the catch-up
        it forced, and the rows it verified, which ``select_model_nodes`` keeps to the nodes
        that pay), or before any, ``probe_us`` (every planned node verified)."""
        return stats.last_probe_us if stats.last_probe_us > 0.0 else self.probe_us(stats, shape)

    def paid_explore_gap(self, stats: ModelDraftStats, shape: TreeShape) -> int:
        """Shortest gap (steps) after which a probe's cost (``probe_cost_us``) is at most
        ``explore_budget`` of the time of the plain steps before it."""
        return math.ceil(self.probe_cost_us(stats, shape) / (self.explore_budget * self.step_us(1)))

    def max_explore_gap(self, stats: ModelDraftStats, shape: TreeShape) -> int:
        """Longest gap (steps) between probes of a model drafter that does not pay: probes on
        at most ``explore_budget`` of the steps, and their cost at most ``explore_budget`` of
        the time (``paid_explore_gap``). Never below ``explore_every``."""
        return max(self.steps_explore_gap(), self.paid_explore_gap(stats, shape))

    def steps_explore_gap(self) -> int:
        """Longest gap (steps) that keeps probes on ``explore_budget`` of the steps, never
        below ``explore_every``."""
        return max(self.explore_every, math.ceil(1.0 / self.explore_budget))

    def next_explore_gap(self, stats: ModelDraftStats) -> int:
        """The gap (steps) stored after a probe: twice the last one (``explore_every`` at
        first), at most ``steps_explore_gap``. What a probe
        costs is not stored in it: ``explore_gap_due`` adds that when the next probe is
        weighed, with the cost as measured then (a first try priced as verifying its whole
        tree, before its cost is known, would otherwise set every later gap)."""
        gap = 2 * stats.explore_gap if stats.explore_gap else self.explore_every
        return min(gap, self.steps_explore_gap())

    def explore_gap_due(self, stats: ModelDraftStats, shape: TreeShape) -> int:
        """Steps without the model before it is due a probe: the stored gap (``explore_every``
        before the first probe), and never one that the probe's cost, as measured now, does
        not fit in (``paid_explore_gap``: a probe that costs a few decodes waits hundreds of
        steps from the start); at most ``max_explore_gap``."""
        return max(stats.explore_gap or self.explore_every, self.paid_explore_gap(stats, shape))

    def needs_features(self, stats: ModelDraftStats) -> bool:
        """Whether a model drafter that reads the target's features (an EAGLE-3 head in
        ``auto``) must receive this step's rows: it may draft within ``feature_lead`` steps.
        It may when it was never planned with (no ``last_shape``) or never tried, when it
        would pay against a plain step (``prefer_model``; no cheap tree is worse, so where it
        does not, it pays on no step), or when a probe is due within ``feature_lead`` steps
        (``probe_due``). Otherwise the step pauses the tap: on the development CPU capturing
        and handing over the rows cost about 1% of every step of a head that does not pay
        (``auto`` at 0.986x of ``ngram``, measured 2026-12-03); the head restarts its context
        on the rows of the steps before its next draft."""
        shape = stats.last_shape
        if shape is None or (stats.n_steps == 0 and stats.n_probes == 0):
            return True
        t1 = self.step_us(1)
        if self.prefer_model(Choice(1, 1.0, 1.0 / t1), stats, shape):
            return True
        return self.probe_due(stats, shape, ahead=self.feature_lead)

    def probe_due(self, stats: ModelDraftStats, shape: TreeShape, *, ahead: int = 0) -> bool:
        """Whether a model drafter that does not pay is due a probe: never probed nor run (a
        new model is tried once), or ``explore_gap_due`` steps without it, and within the
        budget of the drafter's life across requests: the measured cost of the probes since
        the model last paid (``stats.explore_spent_us``) plus this one's (``probe_cost_us``) at most
        ``explore_budget`` of the measured step time since then (``t_steps_us -
        stats.explore_from_us``). ``ahead``: whether it is due within that many more steps
        (each priced a plain step)."""
        if stats.n_steps == 0 and stats.n_probes == 0:
            return True
        if stats.steps_since_run + ahead < self.explore_gap_due(stats, shape):
            return False
        start = self.t_steps_us if stats.explore_from_us is None else stats.explore_from_us
        cost = self.probe_cost_us(stats, shape)
        clock = self.t_steps_us + ahead * self.step_us(1)
        return stats.explore_spent_us + cost <= self.explore_budget * (clock - start)

    def plan(
        self,
        cheap: TokenTree,
        model: ModelDraftStats | None,
        *,
        max_nodes: int,
        max_depth: int,
        t_draft_us: float = 0.0,
        fixed_shape: TreeShape | None = None,
        adaptive: bool = True,
        calibration: "ScoreCalibration | None" = None,
    ) -> "StepPlan":
        """The step's one decision, made before any model call.

        Args:
            cheap: the drafts already made this step (n-gram tree; the root alone when the
                drafter has only a model).
            model: the model drafter's ``ModelDraftStats`` when it can draft this step, else None.
            max_nodes / max_depth: what the step may verify (context, token budget).
            t_draft_us: what the cheap drafts cost (already spent).
            fixed_shape: always draft with this shape (a drafter made with one).
            adaptive: False verifies everything drafted (tests, experiments).
            calibration: the request's ``ScoreCalibration`` (default: the policy's own).
        """
        if adaptive:
            c = self.choose(cheap, max_nodes=max_nodes, t_draft_us=t_draft_us, calibration=calibration)
        else:
            n = min(max_nodes, self.max_nodes)
            c = Choice(n, float("nan"), float("nan"))
        if model is None:
            return StepPlan(c.n_nodes, None)
        if fixed_shape is not None:
            shape = fixed_shape
        else:
            shape = self.model_shape(model, max_depth=min(max_depth, model.max_depth), max_nodes=max_nodes, max_width=model.max_width)
        model.last_shape = shape
        if not adaptive:
            return StepPlan(c.n_nodes, shape)
        # the merged tree's best nodes: the model's budget, and never fewer than the cheap drafts
        # would have had alone (a model step must not cut a long n-gram run down to the
        # model's few nodes)
        n_nodes = max(c.n_nodes, min(shape.max_nodes, max_nodes))
        if model.explore_from_us is None:
            model.explore_from_us = self.t_steps_us
        if fixed_shape is None and not self.prefer_model(c, model, shape, t_spent_us=t_draft_us):
            # probes (after a new model's first try) only where the cheap drafts verify nothing:
            # where a model that does not pay would come back (``value``), and where what it
            # gets accepted is all its own
            if (c.n_nodes > 1 and model.n_probes > 0) or not self.probe_due(model, shape):
                return StepPlan(c.n_nodes, None)
            # a probe: a model step like any other (the target can only accept what it
            # verifies), whose cost is bounded: each probe that does not pay doubles the gap
            # to the next (``next_explore_gap``), and its cost is charged to the drafter's
            # exploration budget (reserved now, so that other requests of this step see it;
            # replaced by the measured cost in ``observe_draft``); its outcome replaces the
            # model's averages (``ModelDraftStats.probe``), so one probe that pays brings the
            # model back
            model.explore_gap = self.next_explore_gap(model)
            model.probe = True
            model.n_probes += 1
            model.probe_rows_us = self.step_us(n_nodes) - self.step_us(c.n_nodes)
            model.probe_reserved_us = self.probe_cost_us(model, shape)
            model.explore_spent_us += model.probe_reserved_us
        else:
            # it pays: a new exploration window; once it stops, probes start again at explore_every
            model.explore_gap, model.probe = 0, False
            model.explore_from_us, model.explore_spent_us, model.probe_reserved_us = self.t_steps_us, 0.0, 0.0
        return StepPlan(n_nodes, shape, probe=model.probe, cheap_nodes=c.n_nodes)

    def observe_draft_levels(self, level_us: Sequence[float], *, probe: bool = False) -> None:
        """Feed back the time of each level of a model-drafted step (µs, level 0 first) to the
        cost model (``CostModel.t_draft_us``: what ``prefer_model`` prices a model step at).
        A probe's level 0 carries the catch-up of every position since the model last ran
        (an EAGLE-3 head writes up to 16 entries in that call), a one-off cost that the
        probe's budget pays (``ModelDraftStats.explore_spent_us``), not the price of level 0
        of a model step that follows one: from a probe only the deeper levels are learned
        (else a head whose probe pays is priced at its catch-up and not used again)."""
        self.cost.observe_draft_levels(list(level_us)[1:] if probe else level_us, first=1 if probe else 0)

    def begin_request(self) -> None:
        """A new request: its score calibration starts from the long-run exponent."""
        self.calibration.begin_request()

    def observe_outcome(self, tree: TokenTree, n_accepted: int) -> None:
        """Feed back a verified ``tree`` (as verified, root included) and how many of its
        draft tokens the target accepted (``ScoreCalibration``)."""
        self.calibration.observe(np.asarray(tree.score[1:], dtype=np.float64), int(n_accepted))

    def observe_step(self, b: int, t_decode_us: float, t_host_us: float) -> None:
        """Feed back the measured decode and host time of a step of ``b`` nodes.

        The host time per extra node is refined only by steps that verify trees; one learned
        under a load that has since fallen by ``cost.load_change`` returns to its prior, as
        the cost model's ratios do (``CostModel.load_fell_since``): else a per-node time
        inflated by a burst keeps every tree dear and the policy plain after the load went."""
        load_then = self.cost.load()  # the load the step ran in, as the steps before it saw it
        self.t_steps_us += t_decode_us + t_host_us
        self.cost.observe(b, t_decode_us)
        a = self._alpha
        if self.cost.load_fell_since(self._host_node_load):
            self.t_host_node_us, self._host_node_load = self._host_node_prior, self.cost.load()
        if b == 1:
            self.t_host_base_us += a * (t_host_us - self.t_host_base_us)
        else:
            per_node = max(0.0, (t_host_us - self.t_host_base_us) / (b - 1))
            self.t_host_node_us += a * (per_node - self.t_host_node_us)
            self._host_node_load = load_then


@dataclass
class Allocation:
    """``allocate_nodes``' answer: the tree size per request (root included, 1 = plain), and
    the expected emitted tokens and rate (tokens per µs) of the step it chose."""

    sizes: list[int]
    expected_tokens: float
    expected_rate: float


def allocate_nodes(
    candidates: Sequence[TokenTree | None],
    cost,
    *,
    n_fixed: int = 0,
    max_nodes: Sequence[int] | int = 64,
    t_extra_us: float = 0.0,
    min_gain: float = 0.05,
    calibrations: Sequence["ScoreCalibration | None"] | None = None,
    cost_floor=None,
) -> Allocation:
    """The one rule that sizes verified trees: split one step's node budget across requests
    (one request is the case ``SpeculationPolicy.choose``).

    Args:
        candidates: per request, the drafter's candidate tree (node ``score`` = estimated
            probability that the target accepts the path to the node) or None (no draft).
        cost: ``b -> µs`` of one step whose batch holds ``b`` tokens (decode + host).
        n_fixed: tokens the batch holds besides the trees (pending re-decodes).
        max_nodes: per request (or for all) the largest tree, root included.
        t_extra_us: time already spent this step whatever is verified (drafting).
        min_gain: draft only for an expected rate this fraction above no drafts at all.
        calibrations: per request, the ``ScoreCalibration`` of its verified trees so far (or
            None): its candidates' scores become ``score ** gamma`` before pooling. Order is
            preserved, so each request's chosen nodes are still its best subtree.
        cost_floor: ``(lo, hi) -> µs`` no step of ``lo..hi`` tokens costs less than, for a
            bound that skips the calibration fit when even uncalibrated-at-best scores
            (``score ** lo``) cannot beat plain decoding (most steps where matches are weak).

    The expected emitted tokens of a step are ``R + sum of the chosen scores`` (every request
    emits at least one token); the rate is that over ``t_extra_us + cost(n_fixed + R + k)``,
    maximised over ``k``, the pooled nodes taken best first. Scores along a path never
    increase, so the best ``k`` pooled nodes of each request are its best subtree.
    """
    R = len(candidates)
    if isinstance(max_nodes, int):
        max_nodes = [max_nodes] * R
    base = n_fixed + R
    plain_rate = R / (t_extra_us + cost(base)) if R else 0.0
    out = Allocation([1] * R, float(R), plain_rate)
    raws: list[tuple[int, np.ndarray]] = []
    for r, c in enumerate(candidates):
        if c is None or c.n_nodes <= 1 or max_nodes[r] <= 1:
            continue
        s = np.sort(np.asarray(c.score[1:], dtype=np.float64))[::-1][: max_nodes[r] - 1]
        if s.size:
            raws.append((r, s))
    if not raws:
        return out
    if cost_floor is not None:
        lo_exp = min((c.lo for c in calibrations or () if c is not None), default=1.0)
        n_all = sum(s.size for _r, s in raws)
        bound = R + sum(float(np.power(np.clip(s, 0.0, 1.0), lo_exp).sum()) for _r, s in raws)
        if bound / (t_extra_us + cost_floor(base + 1, base + n_all)) < plain_rate * (1.0 + min_gain):
            return out
    pool: list[tuple[float, int]] = []
    for r, s in raws:
        if calibrations is not None and calibrations[r] is not None:
            s = calibrations[r].calibrate(s)
        pool.extend((float(x), r) for x in s if x > 0)
    if not pool:
        return out
    pool.sort(key=lambda t: -t[0])
    best_k, best_rate, best_e = 0, plain_rate, float(R)
    e = float(R)
    for k, (x, _r) in enumerate(pool, start=1):
        e += x
        rate = e / (t_extra_us + cost(base + k))
        if rate > best_rate:
            best_k, best_rate, best_e = k, rate, e
    if best_rate < plain_rate * (1.0 + min_gain):
        return out
    for _x, r in pool[:best_k]:
        out.sizes[r] += 1
    return Allocation(out.sizes, best_e, best_rate)
