"""MTP / NextN drafting (``--drafter mtp``) on tiny test-written GLM-4.5-style GGUFs.

No MTP model is on the package registries: ``mtp_gguf.write_tiny_glm4moe`` writes a random
``glm4moe`` target with one NextN block (and the same trunk without it). The real llama.cpp
runs both: the target's trunk in the engine's context, the NextN block in an MTP context.

* temperature 0 and seeded Gumbel sampling: token for token what plain decoding emits, for
  chains, trees and the policy's shapes, with drafts both accepted and rejected;
* after every drafted step, both caches hold exactly what they should: the MTP context's
  seq 0 ``[0, root_pos]`` (one entry per committed position, the root's included) and
  every scratch sequence empty (``llama_memory_seq_pos_min/max``), the target's
  ``SequenceCache.check``; also across requests that reuse a cached prefix; and after the
  rollbacks the MTP cache computes the root's row a fresh drafter computes (a leaked draft
  cell, invisible to the position checks, fails that);
* exact law of one rejection-sampling step through ``Engine._propose`` (oracle enumeration);
* ``--drafter auto`` drafts with the MTP block of such a target; a recurrent target is refused;
* classic rejection sampling through the engine (``Engine.generate``: ``_propose`` with the
  MTP drafter's sampled trees): the first two tokens follow the target's exact joint law
  (chi-square), and a drafter that records another draft distribution than the one it drew
  from fails the same test;
* a target without MTP blocks, and one that declares them without their tensors: one-line
  errors naming the file and the metadata key; the engine keeps working.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import chisquare_pvalue, frozen_cost_model
from helpers import assert_same_as_plain
from localspec.drafters.mtp import MtpDrafter
from localspec.drafters.tree_expand import Children, DraftChildSelector, DraftMode
from localspec.engine import Engine
from localspec.errors import ModelLoadError
from localspec.policy import TreeShape
from localspec.request_state import RequestState
from localspec.sampling import SamplingParams
from localspec.tree import SparseDist, TokenSource, TokenTree
from mtp_gguf import write_tiny_glm4moe

PROMPT = [1, 50, 60, 70, 80, 90, 100, 110]


@pytest.fixture(scope="module")
def mtp_path(tmp_path_factory):
    return write_tiny_glm4moe(tmp_path_factory.mktemp("mtp") / "tiny-glm4moe-mtp.gguf")


@pytest.fixture(scope="module")
def plain(mtp_path):
    eng = Engine(mtp_path, drafter="none", n_ctx=1024, n_threads=1, cost_model=frozen_cost_model())
    yield eng
    eng.close()


def mtp_engine(path, shape):
    return Engine(path, drafter="mtp", draft_shape=shape, n_ctx=1024, n_threads=1, cost_model=frozen_cost_model(), adaptive=False)


class CacheChecks:
    """Wraps the extend of the drafter's draft context (``DraftHub.extend_many``, which the
    step calls) to check both caches after every drafted step."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.d: MtpDrafter = engine.drafter
        self.n_checked = 0
        hub = self.d.hub
        inner = hub.extend_many

        def extend_many(drafters, shapes):
            trees = inner(drafters, shapes)
            self.check()
            return trees

        hub.extend_many = extend_many

    def check(self) -> None:
        d, ctx = self.d, self.d.ctx
        root_pos = len(d.history) - 1
        assert d.kv_len == root_pos + 1
        assert (ctx.pos_min(0), ctx.pos_max(0)) == (0, root_pos)  # one entry per committed position
        for s in range(1, ctx.n_seq_max):  # every scratch sequence dropped
            assert (ctx.pos_min(s), ctx.pos_max(s)) == (-1, -1), f"MTP scratch sequence {s} holds cells"
        self.engine.cache.check()
        tgt = self.engine.ctx
        n = self.engine.cache.n_past
        assert (tgt.pos_min(0), tgt.pos_max(0)) == ((0, n - 1) if n else (-1, -1))
        self.n_checked += 1


def drafted_outcomes(res) -> tuple[int, int]:
    """(accepted drafts, steps that rejected a draft) of a generation."""
    src = res.stats.token_sources
    return res.stats.num_accepted_tokens, src.get("recovered", 0)


SHAPES = [TreeShape(4, 1, 5, 0.0), TreeShape(3, 2, 7, 0.0), None]


@pytest.mark.parametrize("shape", SHAPES, ids=["chain", "tree", "policy"])
def test_greedy_identical_to_plain_with_caches_checked(mtp_path, plain, shape):
    greedy = SamplingParams.greedy()
    eng = mtp_engine(mtp_path, shape)
    try:
        checks = CacheChecks(eng)
        for prompt, n in [(PROMPT, 300), (PROMPT[:5] + [7, 8, 9], 120), (PROMPT, 150)]:
            ref = plain.generate(prompt, max_tokens=n, sampling=greedy).token_ids
            res = eng.generate(prompt, max_tokens=n, sampling=greedy)
            assert_same_as_plain(eng, prompt, ref, res.token_ids)
            assert len(res.token_ids) == n
            accepted, rejected = drafted_outcomes(res)
            assert accepted >= n // 10 and rejected >= 5  # drafts both accepted and rolled back
        assert checks.n_checked >= 100
        assert res.stats.n_cached_tokens > 0  # the last request reused the cached prompt
    finally:
        eng.close()


def test_seeded_gumbel_identical_to_plain(mtp_path, plain):
    eng = mtp_engine(mtp_path, TreeShape(3, 2, 7, 0.0))
    try:
        checks = CacheChecks(eng)
        for seed in (1, 2):
            s = SamplingParams(temperature=0.8, top_k=20, top_p=1.0, min_p=0.0, seed=seed)
            ref = plain.generate(PROMPT, max_tokens=150, sampling=s).token_ids
            res = eng.generate(PROMPT, max_tokens=150, sampling=s)
            assert_same_as_plain(eng, PROMPT, ref, res.token_ids, sampling=s)
            assert res.stats.num_accepted_tokens >= 15
        assert checks.n_checked > 0
    finally:
        eng.close()


# -- classic rejection sampling through the engine ------------------------------------------------

REJECTION = SamplingParams(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0, verify="rejection")
N_SAMPLES = 2000


def target_joint(plain: Engine, prompt: list[int]) -> dict[tuple[int, int], float]:
    """Exact law of the first two tokens of plain decoding under ``REJECTION`` (real rows)."""
    m = plain.model
    plain.reset()
    plain.cache.prefill(prompt[:-1])
    _, lg = plain.cache.decode_tree(TokenTree.root_only(prompt[-1]))
    p1 = RequestState(REJECTION.with_seed(0), m, prompt).cursor(len(prompt)).target_probs(lg[0].copy())
    plain.cache.truncate(len(prompt) - 1)
    out = {}
    for a in np.flatnonzero(p1):
        _, lg = plain.cache.decode_tree(TokenTree.chain(prompt[-1], [int(a)]))
        row = lg[1].copy()
        plain.cache.truncate(len(prompt) - 1)
        p2 = RequestState(REJECTION.with_seed(0), m, prompt + [int(a)]).cursor(len(prompt) + 1).target_probs(row)
        for b in np.flatnonzero(p2):
            out[(int(a), int(b))] = float(p1[a] * p2[b])
    plain.reset()
    return out


def sampled_joint(eng: Engine, prompt: list[int], n: int) -> tuple[dict, int]:
    """Counts of the first two tokens over ``n`` seeds (generations of 3 tokens, so that the
    first step may draft 2 deep), and how many second tokens were accepted MTP drafts."""
    counts: dict[tuple[int, int], int] = {}
    drafted_second = 0
    for seed in range(n):
        res = eng.generate(prompt, max_tokens=3, sampling=REJECTION.with_seed(seed))
        key = tuple(res.token_ids[:2])
        counts[key] = counts.get(key, 0) + 1
        drafted_second += int(TokenSource(res.sources[1]).is_draft)
    return counts, drafted_second


def chisquare_vs_target(counts: dict, law: dict) -> float:
    keys = list(law)
    assert sum(counts.values()) == sum(counts.get(k, 0) for k in keys)  # nothing outside the support
    return chisquare_pvalue([counts.get(k, 0) for k in keys], [law[k] for k in keys])


@pytest.fixture(scope="module")
def rejection_setup(mtp_path, plain):
    law = target_joint(plain, PROMPT)
    assert len(law) >= 6  # a real two-token distribution
    return law


def test_rejection_sampling_follows_the_target_law(mtp_path, rejection_setup):
    law = rejection_setup
    eng = mtp_engine(mtp_path, TreeShape(2, 2, 7, 0.0))  # sampled children at both levels
    try:
        checks = CacheChecks(eng)
        counts, drafted_second = sampled_joint(eng, PROMPT, N_SAMPLES)
        assert checks.n_checked >= N_SAMPLES  # every generation drafts its first step
        assert drafted_second > N_SAMPLES // 10  # the drafts really decide many second tokens
        assert chisquare_vs_target(counts, law) > 1e-3
    finally:
        eng.close()


def _children_recording_uniform(self, row, pos, k, counter=0):
    """Mutant of ``DraftChildSelector.children`` (rejection mode): draws from the processed
    MTP distribution q but records the uniform distribution over q's support."""
    ch = _real_children(self, row, pos, k, counter)
    if self.mode != DraftMode.SAMPLE:
        return ch
    ids = np.asarray(ch.dist.ids)
    flat = np.full(ids.size, 1.0 / ids.size)
    at = {int(t): i for i, t in enumerate(ids)}
    probs = np.array([flat[at[int(t)]] for t in ch.tokens])
    return Children(ch.tokens, ch.confidence, probs, SparseDist.from_unsorted(ids, flat))


_real_children = DraftChildSelector.children


def test_a_wrong_draft_distribution_fails_the_rejection_test(mtp_path, rejection_setup, monkeypatch):
    """The test above can fail: recording another distribution than the one the MTP draft
    was drawn from moves the output off the target's law."""
    monkeypatch.setattr(DraftChildSelector, "children", _children_recording_uniform)
    eng = mtp_engine(mtp_path, TreeShape(2, 2, 7, 0.0))
    try:
        counts, _ = sampled_joint(eng, PROMPT, N_SAMPLES)
        assert chisquare_vs_target(counts, rejection_setup) < 1e-3
    finally:
        eng.close()


# -- refused targets -----------------------------------------------------------------------------


def test_a_target_without_mtp_blocks_is_a_one_line_error(tmp_path):
    path = write_tiny_glm4moe(tmp_path / "tiny-glm4moe.gguf", nextn=False)
    with pytest.raises(ModelLoadError) as e:
        Engine(path, drafter="mtp", n_ctx=256, n_threads=1, cost_model=frozen_cost_model())
    msg = str(e.value)
    assert "\n" not in msg and "tiny-glm4moe.gguf" in msg and "glm4moe.nextn_predict_layers is absent" in msg
    # set_drafter refuses it too and the engine keeps its drafter and works
    eng = Engine(path, drafter="ngram", n_ctx=256, n_threads=1, cost_model=frozen_cost_model())
    try:
        with pytest.raises(ModelLoadError, match="nextn_predict_layers"):
            eng.set_drafter("mtp")
        assert eng.drafter_name == "ngram"
        assert len(eng.generate(PROMPT, max_tokens=8, sampling=SamplingParams.greedy()).token_ids) == 8
    finally:
        eng.close()


def test_declared_mtp_blocks_without_tensors_are_refused(tmp_path):
    path = write_tiny_glm4moe(tmp_path / "tiny-no-nextn-tensors.gguf", nextn_tensors=False)
    with pytest.raises(ModelLoadError) as e:
        Engine(path, drafter="mtp", n_ctx=256, n_threads=1, cost_model=frozen_cost_model())
    msg = str(e.value)
    assert "\n" not in msg and "tiny-no-nextn-tensors.gguf" in msg and "blk.2." in msg


# -- exact law of one step through Engine._propose (every draft draw enumerated) ------------------

EXACT = SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0, verify="rejection")


def test_rejection_step_law_is_exact_through_the_propose_path(mtp_path):
    """The MTP drafter grows sampled trees two levels deep (2 i.i.d. children per node, top-k
    2: 7 nodes) through ``Engine._propose`` with a node budget of 5 that makes
    ``best_subtree`` cut them;
    every MTP draw is a decision of the oracle (``EnumeratedDraftSampler``, the drafter's own
    processed distribution) and every tree is verified with enumerated uniforms on the
    target's real rows: the law of the step's tokens, extended by plain decoding to 3 tokens,
    is the target's to 1e-12. A ``best_subtree`` that keeps the likeliest draws is off it."""
    import oracle
    import localspec.verify as verify_mod
    from localspec.verify import verify_rejection
    from test_propose_rejection import EnumeratedDraftSampler, engine_propose, subtree_keeping_likely_draws

    eng = Engine(mtp_path, drafter="none", n_ctx=512, n_threads=1, cost_model=frozen_cost_model(), adaptive=False)
    d = MtpDrafter(shape=TreeShape(2, 2, 7, 0.0))
    try:
        eng.set_drafter(d)
        eng.adaptive = False
        eng.max_tree_nodes = 5  # 7 nodes drawn (2 per node), best_subtree keeps 5 (in expand_tree)
        model, prompt = eng.model, PROMPT
        pos = len(prompt)
        eng.reset()
        d.begin(prompt)
        eng.cache.prefill(prompt[:-1])
        d.add_target_features(0, eng._tap.take())
        d.set_sampling(RequestState(EXACT.with_seed(0), model, prompt))
        rows: dict[tuple, np.ndarray] = {}

        def target_row(path: tuple) -> np.ndarray:
            if path not in rows:
                _, lg = eng.cache.decode_tree(TokenTree.chain(prompt[-1], list(path)))
                rows[path] = lg[len(path)].copy()
                eng.cache.truncate(len(prompt) - 1)
                eng._tap.clear()
            return rows[path]

        def build(ch):
            d.sampler = EnumeratedDraftSampler(EXACT.with_seed(0), model.n_vocab, model.suppress_tokens, ch)
            prop = engine_propose(eng, d, prompt[-1], 8, 256)
            assert prop.tree.n_nodes == 5 and prop.tree.max_depth() == 2
            return prop.tree

        def walk(tree, ch):
            paths = [tuple(int(tree.token_ids[c]) for c in tree.path_to(i)) for i in range(tree.n_nodes)]
            lg = np.stack([target_row(p) for p in paths])
            cur = oracle.branching_cursor(RequestState(EXACT.with_seed(0), model, prompt).cursor(pos), ch)
            return tuple(verify_rejection(tree, lg, cur).tokens)

        def cond(prefix):
            c = RequestState(EXACT.with_seed(0), model, prompt + list(prefix)).cursor(pos + len(prefix))
            return c.target_probs(target_row(tuple(prefix)))

        # the first extend writes the catch-up entries and the root's in one call; later ones
        # redo the root's entry alone (its MTP row then differs in the last bits from the
        # batched one, which would make the replays of the enumeration disagree)
        build(oracle.Chooser([]))
        trees = oracle.enumerate_trees(build)
        assert abs(sum(p for p, _ in trees) - 1) < 1e-12 and len(trees) == 2**6  # 6 draws of 2 tokens
        law = oracle.step_law(trees, walk)
        assert max(len(t) for t in law) == 3  # two drafts accepted, then the bonus token
        err = oracle.max_abs_diff(oracle.extended_law(law, cond, 3), oracle.target_law(cond, 3))
        assert err < 1e-12
        d.check_cache()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(TokenTree, "best_subtree", subtree_keeping_likely_draws)
            mp.setattr(verify_mod, "check_sampled_siblings", lambda tree: None)
            bad = oracle.step_law(oracle.enumerate_trees(build), walk)
        assert oracle.max_abs_diff(oracle.extended_law(bad, cond, 3), oracle.target_law(cond, 3)) > 1e-3
    finally:
        eng.set_drafter(None)
        eng.close()


def test_recurrent_targets_are_refused(tmp_path):
    """A recurrent target declaring an MTP block (a tiny Mamba; the Qwen3-Next / Qwen3.5
    hybrids take the same path): refused in one line before any context is made."""
    from mtp_gguf import write_tiny_mamba

    path = write_tiny_mamba(tmp_path / "tiny-mamba.gguf")
    with pytest.raises(ModelLoadError) as e:
        Engine(path, drafter="mtp", n_ctx=256, n_threads=1, cost_model=frozen_cost_model())
    msg = str(e.value)
    assert "\n" not in msg and "tiny-mamba.gguf" in msg and "recurrent / linear-attention" in msg
    assert msg.startswith("the mtp drafter: "), msg  # not "--drafter mtp:", which a Python caller never typed


def test_auto_drafts_with_the_mtp_block_of_a_target_that_has_one(mtp_path, plain):
    from localspec.drafters.auto import AutoDrafter

    eng = Engine(mtp_path, drafter="auto", n_ctx=1024, n_threads=1, cost_model=frozen_cost_model(), adaptive=False)
    try:
        assert isinstance(eng.drafter, AutoDrafter) and isinstance(eng.drafter.model, MtpDrafter)
        greedy = SamplingParams.greedy()
        ref = plain.generate(PROMPT, max_tokens=200, sampling=greedy).token_ids
        res = eng.generate(PROMPT, max_tokens=200, sampling=greedy)
        assert_same_as_plain(eng, PROMPT, ref, res.token_ids)
        assert res.stats.token_sources.get("draft_model", 0) >= 20  # tokens the MTP block drafted
    finally:
        eng.close()


def test_mtp_cache_after_rollbacks_computes_what_a_fresh_one_does(mtp_path):
    """After two requests of drafted steps (accepts, rejections, a reused prefix), the MTP
    block's row for the root is the one a fresh drafter computes from the same history in
    one catch-up (to the last bits that batching changes). A rejected draft's cell left in
    seq 0 keeps the position range [0, root_pos] that the per-step checks read, but moves
    this row: the content check catches what the position check cannot."""
    from localspec.tree import TreeBuilder

    greedy = SamplingParams.greedy()
    eng = mtp_engine(mtp_path, TreeShape(3, 2, 7, 0.0))
    fresh = MtpDrafter()
    eng2 = Engine(mtp_path, drafter=fresh, n_ctx=1024, n_threads=1, cost_model=frozen_cost_model(), adaptive=False)
    try:
        eng.generate(PROMPT, max_tokens=120, sampling=greedy)
        res = eng.generate(PROMPT[:5] + [9], max_tokens=60, sampling=greedy)
        assert drafted_outcomes(res)[1] >= 5  # rollbacks happened
        d = eng.drafter
        hist, root = list(d.history), d.history[-1]
        row = d.decode_level(TreeBuilder(root), [0])[0].copy()
        eng2.reset()
        fresh.begin(hist)
        eng2.cache.prefill(hist[:-1])
        fresh.add_target_features(0, eng2._tap.take())
        ref = fresh.decode_level(TreeBuilder(root), [0])[0].copy()
        assert np.abs(row - ref).max() < 1e-4
        # a leaked draft cell in seq 0 (same position range), and the row moves
        lo_hi = (d.ctx.pos_min(0), d.ctx.pos_max(0))
        d.batch.clear()
        d.batch.add(token=77, pos=len(hist) - 4, seq_id=1, output=False, embd=np.ones(d.n_embd, np.float32))
        d.ctx.process(d.batch)
        d.ctx.seq_cp(1, 0, -1, -1)
        d.ctx.seq_rm(1, -1, -1)
        assert (d.ctx.pos_min(0), d.ctx.pos_max(0)) == lo_hi
        leaked = d.decode_level(TreeBuilder(root), [0])[0].copy()
        assert np.abs(leaked - ref).max() > 1e-2
    finally:
        eng.close()
        eng2.close()
