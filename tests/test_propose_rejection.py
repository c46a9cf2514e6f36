"""Rejection sampling through the engine's own propose path, exactly.

The trees here are not built by hand: the engine's the step's ``propose_one`` asks a real drafter
(``AutoDrafter``: the n-gram drafter's point masses plus a model drafter's sampled children,
merged by ``merge_trees``; or a real EAGLE-3 head on the default model), cuts the proposal
with ``TokenTree.best_subtree`` and renumbers it with ``best_first_dfs``. Every draft draw
is enumerated (the model drafters' ``DraftChildSelector`` draws through the oracle's chooser; all
else is the drafters' own code), every tree is verified with enumerated uniforms, and the
exact law of the step's tokens, extended by plain decoding, must be the target's to 1e-12.
Mutations of the propose path that reorder or prune sampled siblings by their draft
probability are refused by ``verify`` and, with that check switched off, miss the target law.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

import localspec.verify as verify_mod
import oracle
from conftest import FakeModel, fixed_cost_model, frozen_cost_model
from localspec.drafters.auto import AutoDrafter
from localspec.drafters.level_drafter import ModelDrafter
from localspec.drafters.ngram import NgramDrafter
from localspec.drafters.tree_expand import Children, DraftMode, DraftChildSelector
from localspec.engine import Engine
from localspec.step import propose_one
from localspec.policy import ModelDraftStats, SpeculationPolicy, TreeShape
from localspec.request_state import RequestState
from localspec.sampling import SamplingParams
from localspec.tree import TokenSource, TokenTree, TreeBuilder
from localspec.verify import verify_rejection
from test_verify import VS, target_cond, target_logits


class EnumeratedDraftSampler(DraftChildSelector):
    """``DraftChildSelector`` whose i.i.d. draws (classic rejection sampling mode) are decisions of
    the oracle's chooser: the same processed draft distribution, every outcome enumerated."""

    def __init__(self, params, n_vocab, suppress_ids, chooser, d2t=None) -> None:
        super().__init__(params, n_vocab, suppress_ids, d2t=d2t)
        assert self.mode == DraftMode.SAMPLE
        self.chooser = chooser

    def children(self, row, pos, k, counter=0):
        cand = self.processor.candidates(row)  # ids in draft ids when the head has a d2t
        tids = self._target_ids(cand.ids)
        q = cand.probs()
        picks = np.array([self.chooser.categorical(q) for _ in range(k)], dtype=np.int64)
        dist = np.zeros(self.n_vocab, dtype=np.float64)  # dense, in target ids
        dist[tids] = q
        return Children(tids[picks], q[picks], q[picks], dist)


# -- a synthetic model drafter on the 4-token world of test_verify ------------------------------


def draft_logits(prefix: tuple) -> np.ndarray:
    """Draft logits after root + ``prefix``: two possible tokens (different from the target's)."""
    g = np.random.default_rng([13, len(prefix), *prefix])
    x = (g.standard_normal(VS) * 0.8).astype(np.float32)
    x[g.permutation(VS)[:2]] = -np.inf
    return x


class SyntheticModelDrafter(ModelDrafter):
    """A ``ModelDrafter`` (its real ``propose`` and ``expand_tree``) whose draft model is
    ``draft_logits`` of the token path."""

    name = "synthetic"

    def __init__(self, shape: TreeShape) -> None:  # no model to load
        self.fixed_shape = shape
        self.max_depth, self.max_width = shape.depth, shape.width
        self.history: list[int] = []
        self.stats = ModelDraftStats()
        from localspec.drafters.tree_expand import DraftCalibration

        self.calib = DraftCalibration()
        self.sampler = None
        self.target = None
        self.ctx = True  # ready()
        self.slots = SimpleNamespace(release=lambda: None)
        self._slot_of = {}
        self.n_vocab = VS
        self.suppress_ids = np.zeros(0, dtype=np.int32)

    def decode_level(self, tree, nodes):
        def path(n):
            out = []
            while n > 0:
                out.append(tree.tokens[n])
                n = tree.parents[n]
            return tuple(reversed(out))

        return np.stack([draft_logits(path(n)) for n in nodes])

    def check_cache(self) -> None:
        pass


REJECTION = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, verify="rejection")
HISTORY = [1, 2, 3, 0, 1, 2, 0, 3, 1, 2]  # "1 2" was followed by 3 and by 0: n-gram drafts


def engine_shim(max_tree_nodes):
    """What the step's ``propose_one`` needs of its engine (non-adaptive: the policy's node
    count is replaced by ``max_tree_nodes``, so that ``best_subtree`` always prunes)."""
    cost = fixed_cost_model()
    return SimpleNamespace(max_tree_nodes=max_tree_nodes, adaptive=False, policy=SpeculationPolicy(cost, max_nodes=max_tree_nodes),
                           cost_model=cost)  # fmt: skip


def engine_propose(shim, drafter, root, remaining, n_free):
    """One request's proposal as the engine's step makes it (``step.propose_one``) with
    ``remaining`` tokens to emit and ``n_free`` free KV cells."""
    return propose_one(shim.policy, drafter, root, min(remaining - 1, n_free - 1), min(shim.max_tree_nodes, n_free),
                       adaptive=shim.adaptive, calibration=getattr(shim, "calibration", None))  # fmt: skip


def auto_drafter():
    model = SyntheticModelDrafter(TreeShape(2, 2, 6, 0.0))  # 7 drawn nodes, 6 kept
    auto = AutoDrafter(model, NgramDrafter())
    auto.fixed_shape = model.fixed_shape  # the step's plan drafts the model with this shape
    auto.begin(HISTORY)
    return auto


def proposed_tree(auto, chooser, max_tree_nodes):
    auto.model.stats = ModelDraftStats()  # a fresh drafter: the policy lets it run
    auto.model.sampler = EnumeratedDraftSampler(REJECTION.with_seed(0), VS, (), chooser)
    prop = engine_propose(engine_shim(max_tree_nodes), auto, HISTORY[-1], 8, 1000)
    return prop


def rows_of(tree):
    paths = [tuple(int(tree.token_ids[c]) for c in tree.path_to(i)) for i in range(tree.n_nodes)]
    return np.stack([target_logits(p) for p in paths])


def walk(tree, ch, fn=verify_rejection):
    req = RequestState(REJECTION.with_seed(0), FakeModel(VS, eog=()), [])
    return tuple(fn(tree, rows_of(tree), oracle.branching_cursor(req.cursor(10), ch)).tokens)


def mixed_law_error(max_tree_nodes=8, fn=verify_rejection):
    auto = auto_drafter()
    trees = oracle.enumerate_trees(lambda ch: proposed_tree(auto, ch, max_tree_nodes).tree)
    law = oracle.step_law(trees, lambda t, ch: walk(t, ch, fn))
    assert abs(sum(law.values()) - 1) < 1e-12
    m = max(len(t) for t in law)
    return oracle.max_abs_diff(oracle.extended_law(law, target_cond, m), oracle.target_law(target_cond, m)), trees


def test_mixed_ngram_and_model_trees_through_the_propose_path_are_exact():
    err, trees = mixed_law_error()
    assert err < 1e-12
    # the trees really are mixed and really were cut: point masses and sampled children
    # under one node, more proposed than verified
    auto = auto_drafter()
    prop = proposed_tree(auto, oracle.Chooser([]), 8)
    assert prop.candidate.n_nodes > prop.tree.n_nodes == 8
    for _, t in trees:
        kinds = {t.is_stochastic(c) for c in t.children(0)}
        assert kinds == {True, False}
    assert len(trees) == 2 * 2 * 4 * 4  # two possible tokens per draw, 2 + 4 draws


def test_unpruned_mixed_trees_are_exact():
    err, _ = mixed_law_error(max_tree_nodes=64)
    assert err < 1e-12


def _sort_key_by_draft_prob(tree, c):
    p = float(tree.draft_probs[c])
    return (-float(tree.score[c]), -(0.0 if np.isnan(p) else p), c)


def dfs_sorted_by_draft_prob(self):
    """Mutant of ``best_first_dfs``: siblings of equal score by descending draft probability."""
    kids = self._children
    order, stack = [], [0]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(reversed(sorted(kids[node], key=lambda c: _sort_key_by_draft_prob(self, c))))
    return self.reordered(np.asarray(order))


def subtree_keeping_likely_draws(self, n_nodes):
    """Mutant of ``best_subtree``: among equal scores, keep the most probable draws."""
    if n_nodes >= self.n_nodes:
        return self
    order = sorted(range(1, self.n_nodes), key=lambda c: _sort_key_by_draft_prob(self, c))
    keep = np.zeros(self.n_nodes, dtype=bool)
    keep[0] = True
    for i in order:
        if keep.sum() >= n_nodes:
            break
        if keep[self.parents[i]]:
            keep[i] = True
    return self.subtree(keep)


@pytest.mark.parametrize(
    "name, mutated",
    [("best_first_dfs", dfs_sorted_by_draft_prob), ("best_subtree", subtree_keeping_likely_draws)],
    ids=["dfs-sorts-draws", "subtree-keeps-likely-draws"],
)
def test_propose_path_mutations_are_caught(monkeypatch, name, mutated):
    """Ordering or pruning sampled siblings by their draft probability: ``verify`` refuses the
    tree (sibling-order invariant), and without that check the law is off the target's."""
    monkeypatch.setattr(TokenTree, name, mutated)
    auto = auto_drafter()
    with pytest.raises(ValueError, match="sibling-order invariant"):
        for seed in range(20):  # some draws make the mutation visible
            ch = oracle.Chooser([seed % 2, (seed // 2) % 2, 0, 1, 1, 0])
            t = proposed_tree(auto, ch, 8).tree
            req = RequestState(REJECTION.with_seed(seed), FakeModel(VS, eog=()), [])
            verify_mod.verify(t, rows_of(t), req.cursor(10))
    monkeypatch.setattr(verify_mod, "check_sampled_siblings", lambda tree: None)
    err, _ = mixed_law_error()
    assert err > 1e-3


# -- a real EAGLE-3 head on the default model, through the real engine --------------------------

EAGLE_SAMPLING = SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0, verify="rejection")


def compress(tree, ids):
    """``tree`` on the local vocabulary ``ids`` (sorted target ids): same decisions, rows of 8."""
    local = {int(t): i for i, t in enumerate(ids)}
    tok = np.array([local.get(int(t), 0) for t in tree.token_ids], dtype=np.int32)
    dists = {k: np.ascontiguousarray(d[ids]) for k, d in tree.draft_dists.items()}
    for d in tree.draft_dists.values():
        assert abs(float(np.asarray(d, dtype=np.float64)[ids].sum()) - 1) < 1e-12  # support inside ids
    return dataclasses.replace(tree, token_ids=tok, draft_dists=dists)


def test_eagle3_trees_through_the_engine_propose_path_are_exact(model):
    """The shipped EAGLE-3 head for the default model drafts 3 i.i.d. children of the root at
    temperature 1 (top-k 2, classic rejection sampling), through the step's ``propose_one`` with a
    node budget that makes ``best_subtree`` keep 2 of them. Every draw is enumerated (8
    trees); the step's tokens, on the target's real rows (restricted to the few tokens with
    probability > 0, which changes no decision), follow the target's law exactly. The
    target's and the head's supports overlap (otherwise every draft would be rejected with
    probability 1 and nothing of the residual rule would be exercised)."""
    from localspec.drafters.eagle3 import Eagle3Drafter
    from localspec.models.eagle3_heads import shipped_head

    head = shipped_head(model.path)
    assert head is not None
    eng = Engine(model, drafter="none", n_ctx=512, cost_model=frozen_cost_model(), adaptive=False)
    d = Eagle3Drafter(head, shape=TreeShape(1, 3, 4, 0.0))
    try:
        eng.set_drafter(d)
        eng.adaptive = False
        eng.max_tree_nodes = 3
        prompt = model.tokenize("Question: What is the capital of France?\nAnswer: The capital of France is")
        eng.reset()
        d.begin(prompt)
        eng.cache.prefill(prompt[:-1])
        d.add_target_features(0, eng._tap.take())
        d.set_sampling(RequestState(EAGLE_SAMPLING.with_seed(0), model, prompt))

        def build(ch):
            d.sampler = EnumeratedDraftSampler(EAGLE_SAMPLING.with_seed(0), model.n_vocab, model.suppress_tokens, ch, d.d2t)
            prop = engine_propose(eng, d, prompt[-1], 8, 256)
            assert prop.tree.n_nodes == 3 and prop.tree.is_stochastic(1)
            return prop.tree

        trees = oracle.enumerate_trees(build)
        assert len(trees) == 8 and abs(sum(p for p, _ in trees) - 1) < 1e-12  # 3 draws of 2 tokens
        # the target's real rows: after the prompt, and after each possible first token
        pos = len(prompt)
        tcur = RequestState(EAGLE_SAMPLING.with_seed(0), model, prompt).cursor(pos)
        draft_support = np.flatnonzero(trees[0][1].draft_dists[0])
        vocab = np.arange(model.n_vocab)
        _, lg = eng.cache.decode_tree(TokenTree.root_only(prompt[-1]))
        root_row = lg[0].copy()
        eng.cache.truncate(len(prompt) - 1)
        p_root = tcur.target_probs(root_row)
        first = np.union1d(np.flatnonzero(p_root), draft_support)
        assert np.intersect1d(np.flatnonzero(p_root), draft_support).size >= 1  # overlap
        tb = TreeBuilder(prompt[-1])
        for t in first:
            tb.add(0, int(vocab[t]), source=TokenSource.NGRAM)
        t1 = tb.build()
        _, lg = eng.cache.decode_tree(t1)
        eng.cache.truncate(len(prompt) - 1)
        rows_after = {int(t1.token_ids[i]): lg[i].copy() for i in range(1, t1.n_nodes)}
        cond_after = {
            t: RequestState(EAGLE_SAMPLING.with_seed(0), model, prompt + [t]).cursor(pos + 1).target_probs(r)
            for t, r in rows_after.items()
        }
        ids = np.unique(np.concatenate([first] + [np.flatnonzero(c) for c in cond_after.values()]))
        local_root = root_row[ids]
        local_after = {t: r[ids] for t, r in rows_after.items()}
        # restricting to ids changes no probability
        lc = RequestState(EAGLE_SAMPLING.with_seed(0), FakeModel(ids.size, eog=()), []).cursor(pos)
        assert np.allclose(lc.target_probs(local_root), p_root[ids], rtol=0, atol=1e-12)
        for t in rows_after:
            assert np.allclose(lc.target_probs(local_after[t]), cond_after[t][ids], rtol=0, atol=1e-12)

        def cond(prefix):
            if not prefix:
                return lc.target_probs(local_root)
            return lc.target_probs(local_after[int(ids[prefix[0]])])

        def walk_local(tree, ch):
            rows = np.stack([local_root] + [local_after[int(tree.token_ids[i])] for i in range(1, tree.n_nodes)])
            t = compress(tree, ids)
            req = RequestState(EAGLE_SAMPLING.with_seed(0), FakeModel(ids.size, eog=()), [])
            return tuple(verify_rejection(t, rows, oracle.branching_cursor(req.cursor(pos), ch)).tokens)

        law = oracle.step_law(trees, walk_local)
        err = oracle.max_abs_diff(oracle.extended_law(law, cond, 2), oracle.target_law(cond, 2))
        assert err < 1e-12
        # the mutation of best_subtree that keeps the likeliest draws is off this law
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(TokenTree, "best_subtree", subtree_keeping_likely_draws)
            mp.setattr(verify_mod, "check_sampled_siblings", lambda tree: None)
            bad = oracle.step_law(oracle.enumerate_trees(build), walk_local)
        bad_err = oracle.max_abs_diff(oracle.extended_law(bad, cond, 2), oracle.target_law(cond, 2))
        assert bad_err > 1e-3
    finally:
        eng.set_drafter(None)
        eng.close()
