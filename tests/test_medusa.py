"""Medusa heads (``drafters.medusa``): the gemm kernel against numpy, the GGUF format and its
one-line errors, the final hidden states the engine hands the heads, exactness of rejection
sampling through the engine's propose path (exact enumeration, with the mutation it must
catch), and temperature 0 identical to plain decoding over 160 tokens after a 620-token
prompt (past the 512-token window)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import localspec.verify as verify_mod
import oracle
from conftest import frozen_cost_model
from helpers import PROSE, assert_greedy_is_target_argmax, assert_same_as_plain
from localspec import Engine, SamplingParams, native
from localspec.drafters.medusa import MedusaCalibration, MedusaDrafter
from localspec.errors import ModelLoadError, VocabMismatchError
from localspec.models.medusa_gguf import MedusaWeights, read_medusa_gguf, untrained_heads, write_medusa_gguf
from localspec.policy import TreeShape
from localspec.tree import TokenTree
from test_propose_rejection import EnumeratedDraftSampler, engine_propose, engine_shim, walk
from test_verify import VS, target_cond

needs_native = pytest.mark.skipif(not native.AVAILABLE, reason=f"native kernels not built: {native.LOAD_ERROR}")
GREEDY = SamplingParams.greedy()


# -- the kernel -----------------------------------------------------------------------------------


@needs_native
def test_gemm_kernel_matches_numpy(rng):
    """``ls_gemm_t`` = ``x @ wt`` (float64 reference) for shapes around the 64-column blocks
    and the 8-row groups, the same bits for 1 and 3 threads, and a shape mismatch refused."""
    from localspec.native import rows

    for n, m, r in [(1, 1, 1), (7, 63, 2), (64, 64, 8), (33, 65, 9), (640, 640, 1), (640, 2051, 3), (5, 200, 17)]:
        wt = rng.standard_normal((n, m)).astype(np.float32)
        x = rng.standard_normal((r, n)).astype(np.float32)
        ref = x.astype(np.float64) @ wt.astype(np.float64)
        scale = np.abs(x).astype(np.float64) @ np.abs(wt).astype(np.float64) + 1.0
        y = rows.gemm_t(wt, x)
        assert y.shape == (r, m) and np.all(np.abs(y - ref) <= 1e-5 * scale)
        with _threads(3):
            assert np.array_equal(rows.gemm_t(wt, x), y)
    with pytest.raises(ValueError):
        rows.gemm_t(np.zeros((3, 4), np.float32), np.zeros((1, 5), np.float32))


class _threads:
    def __init__(self, n):
        self.n = n

    def __enter__(self):
        self.old = native.threads()
        native.set_threads(self.n)

    def __exit__(self, *exc):
        native.set_threads(self.old)


def test_heads_in_c_and_numpy_agree(rng):
    wts = _synthetic_weights(rng, e=48, v=300, k=3)
    d = MedusaDrafter(wts)
    h = rng.standard_normal(48).astype(np.float32) * 5
    with native.use(False):
        ref = d.head_logits(h)
    with native.use(True):
        got = d.head_logits(h)
    assert ref.shape == (3, 300)
    assert np.allclose(got, ref, rtol=1e-5, atol=1e-4)
    # the block is h + SiLU(W h + b) and the readout U r
    u = wts.w[1] @ h + wts.b[1]
    r = h + u / (1 + np.exp(-u))
    assert np.allclose(ref[1], wts.out[1] @ r, rtol=1e-5, atol=1e-4)


@needs_native
@pytest.mark.parametrize("shared", [False, True])
def test_heads_of_several_requests_in_one_call_are_each_requests_rows_bit_for_bit(rng, shared):
    """``MedusaHeads.logits`` over the stacked hidden states of R requests (one C call per
    matrix) gives each request exactly the rows it gets alone, for R around the kernel's
    8-row blocks, with a shared readout or one per head; and a drafter's ``spawn`` shares the
    heads (nothing copied)."""
    wts = _synthetic_weights(rng, e=40, v=130, k=3)
    if shared:
        wts.out = wts.out[:1]
    d = MedusaDrafter(wts)
    assert d.heads.shared == shared
    assert d.spawn().heads is d.heads
    h = rng.standard_normal((11, 40)).astype(np.float32) * 3
    for r in (1, 2, 8, 9, 11):
        together = d.heads.logits(h[:r])
        for i in range(r):
            assert np.array_equal(together[i], d.head_logits(h[i]))


# -- the file format and its errors ---------------------------------------------------------------


def _synthetic_weights(rng, e=8, v=3, k=2, d2t=None) -> MedusaWeights:
    return MedusaWeights(
        w=(rng.standard_normal((k, e, e)) * 0.5).astype(np.float32),
        b=(rng.standard_normal((k, e)) * 0.3).astype(np.float32),
        out=rng.standard_normal((k, v, e)).astype(np.float32),
        d2t=np.arange(v, dtype=np.int64) if d2t is None else np.asarray(d2t, dtype=np.int64),
    )


def test_gguf_round_trip(tmp_path, rng):
    wts = _synthetic_weights(rng, e=16, v=5, k=3)
    wts.training = {"val": [0.5, 0.4]}
    wts.target_vocab_size, wts.target_vocab_sha256, wts.target = 99, "ab" * 32, "t.gguf"
    p = write_medusa_gguf(tmp_path / "h.gguf", wts)
    r = read_medusa_gguf(p)
    assert (r.n_heads, r.n_embd, r.n_vocab_draft) == (3, 16, 5)
    assert np.allclose(r.w, wts.w, atol=2e-3) and np.allclose(r.out, wts.out, atol=2e-3)  # F16
    assert np.array_equal(r.b, wts.b) and np.array_equal(r.d2t, wts.d2t)
    assert (r.target_vocab_size, r.target_vocab_sha256, r.target, r.training) == (99, "ab" * 32, "t.gguf", wts.training)


def test_bad_files_are_one_line_errors(tmp_path, rng, random_head_path, model_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        MedusaDrafter(tmp_path / "nope.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + bytes(rng.integers(0, 256, 200, dtype=np.uint8)))
    with pytest.raises(ModelLoadError, match="not a readable GGUF") as e:
        MedusaDrafter(junk)
    assert "\n" not in str(e.value)
    with pytest.raises(ModelLoadError, match="is an EAGLE-3 head, not Medusa heads: use it with --drafter eagle3 --eagle"):
        MedusaDrafter(random_head_path)
    with pytest.raises(ModelLoadError, match="is a gemma3 model, not Medusa heads .*--drafter draft --draft-model"):
        MedusaDrafter(model_path)
    good = write_medusa_gguf(tmp_path / "ok.gguf", _synthetic_weights(rng))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:-40])  # truncated tensor data
    with pytest.raises(ModelLoadError) as e:
        MedusaDrafter(cut)
    assert "\n" not in str(e.value)


def test_another_architecture_is_refused_from_the_header_alone(monkeypatch, random_head_path, model_path):
    """gguf's reader parses every key of a file (the default model's 262,144 tokenizer
    strings: 11 s to refuse it); the architecture is read from the header's first entry."""
    import gguf

    def no_full_read(*a, **k):
        raise AssertionError("the whole file was parsed")

    monkeypatch.setattr(gguf, "GGUFReader", no_full_read)
    with pytest.raises(ModelLoadError, match="is a gemma3 model, not Medusa heads"):
        MedusaDrafter(model_path)
    with pytest.raises(ModelLoadError, match="is an EAGLE-3 head, not Medusa heads"):
        MedusaDrafter(random_head_path)


def test_heads_for_another_target_are_refused(model, tmp_path, rng):
    from localspec.drafters.base import TargetHandle

    target = TargetHandle(model, n_ctx=512, n_threads=1)
    d = MedusaDrafter(_synthetic_weights(rng, e=64))
    with pytest.raises(ModelLoadError, match="hidden states of size 64, the target has 640"):
        d.attach(target)
    w = untrained_heads(model.path, np.arange(100, 110), n_heads=2)
    w.target_vocab_size = model.n_vocab + 1
    with pytest.raises(ModelLoadError, match="trained for a target with"):
        MedusaDrafter(w).attach(target)
    w.target_vocab_size = model.n_vocab
    w.target_vocab_sha256 = "0" * 64
    with pytest.raises(VocabMismatchError, match="texts differ"):
        MedusaDrafter(w).attach(target)



def test_a_refused_switch_keeps_the_drafter_and_the_conversation(engine, rng):
    """Switching from the n-gram drafter to heads that need another feature tap (the final
    norm) used to recreate the target context before the heads were checked: a refused
    switch left the engine with no drafter and an empty cache. Now the check comes first."""
    assert engine.drafter_name == "ngram"
    engine.reset()
    prompt = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n"
    engine.generate(prompt, max_tokens=4, sampling=SamplingParams.greedy())
    ctx = engine.ctx
    with pytest.raises(ModelLoadError, match="hidden states of size 64"):
        engine.set_drafter(MedusaDrafter(_synthetic_weights(rng, e=64)))
    assert engine.drafter_name == "ngram" and engine.ctx is ctx
    r = engine.generate(prompt, max_tokens=4, sampling=SamplingParams.greedy())
    assert r.stats.n_cached_tokens > 0

# -- the final hidden states ---------------------------------------------------------------------


def test_engine_hands_the_heads_the_verification_rows(model, tmp_path):
    """After every step the drafter holds the target's final-norm row of the position before
    the root -- the row whose logits produced the root -- and it equals the row of a
    teacher-forced prefill of the same tokens (the training recorder's), up to the rounding
    of batched vs single decodes."""
    from localspec.models.training.medusa_data import FinalNormRecorder

    heads = write_medusa_gguf(tmp_path / "u.gguf", untrained_heads(model.path, np.arange(1000, 1300), n_heads=2))
    e = Engine(model, drafter="medusa", medusa=heads, n_ctx=1024, cost_model=frozen_cost_model())
    seen = []
    d = e.drafter
    inner = d.set_final_hidden

    def spy(pos, row):
        seen.append((pos, len(d.history), row.copy()))
        inner(pos, row)

    d.set_final_hidden = spy
    try:
        prompt = e.tokenize("The history of the printing press begins in the fifteenth century, when")
        res = e.generate(prompt, max_tokens=12, sampling=GREEDY)
    finally:
        e.close()
    assert len(seen) == res.stats.n_steps
    assert all(pos == n - 2 for pos, n, _ in seen)  # the row before the root
    toks = prompt + res.token_ids
    rec = FinalNormRecorder(model.path, n_batch=64, n_threads=1)
    try:
        h = rec.record(toks)
    finally:
        rec.close()
    for pos, _, row in seen:
        rel = np.abs(row - h[pos]).max() / np.abs(h[pos]).max()
        assert rel < 0.02, (pos, rel)
    # and it is the row of that position, not of a neighbour
    assert np.abs(seen[-1][2] - h[seen[-1][0] - 1]).max() / np.abs(h[seen[-1][0]]).max() > 0.1


# -- exactness of rejection sampling through the propose path -------------------------------------

HISTORY = [1, 2, 3, 0, 1, 2, 0, 3, 1, 2]
REJECTION = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, verify="rejection")


FULL_TREE = TreeShape(2, 2, 64, min_score=0.0)


def synthetic_drafter(seed=3, shape=FULL_TREE) -> MedusaDrafter:
    """Two heads on a hidden size of 8 over the 4-token world of test_verify, with a draft
    vocabulary of 2 of the 4 tokens (tokens 1 and 2 cannot be drafted); every step drafts
    the full tree of 2 x 2 children (pruned to the engine's node budget) unless ``shape`` is
    None (the policy's plan)."""
    rng = np.random.default_rng(seed)
    d = MedusaDrafter(_synthetic_weights(rng, e=8, v=2, k=2, d2t=[0, 3]), width=2, shape=shape)
    d.attach(SimpleNamespace(model=SimpleNamespace(n_embd=8, n_vocab=VS, suppress_tokens=np.zeros(0, np.int32))))
    d.begin(HISTORY)
    d.set_final_hidden(len(HISTORY) - 2, rng.standard_normal(8).astype(np.float32))
    return d


def proposed(d, chooser, max_nodes):
    d.sampler = EnumeratedDraftSampler(REJECTION.with_seed(0), VS, (), chooser, d.d2t)
    return engine_propose(engine_shim(max_nodes), d, HISTORY[-1], 8, 1000)


def law_error(d, max_nodes):
    trees = oracle.enumerate_trees(lambda ch: proposed(d, ch, max_nodes).tree)
    law = oracle.step_law(trees, walk)
    assert abs(sum(law.values()) - 1) < 1e-12
    m = max(len(t) for t in law)
    return oracle.max_abs_diff(oracle.extended_law(law, target_cond, m), oracle.target_law(target_cond, m)), trees


@pytest.mark.parametrize("max_nodes", [4, 64])
def test_rejection_sampling_through_the_propose_path_is_exact(max_nodes):
    """Every draw of the heads' sparse tree enumerated (2 i.i.d. children per node, depth 2:
    2^6 trees), each verified with enumerated uniforms on the target rows of its paths: the
    step's tokens, extended by plain decoding, follow the target's law to 1e-12 -- with a node
    budget of 4 (7 drawn nodes pruned by ``best_subtree``) or 64. Every node of a depth carries its head's distribution
    (conditioned on the hidden state only)."""
    d = synthetic_drafter()
    err, trees = law_error(d, max_nodes)
    assert err < 1e-12
    p = proposed(d, oracle.Chooser([0, 1, 0, 1, 0, 1]), max_nodes)  # distinct draws (equal ones merge)
    assert p.tree.n_nodes == min(7, max_nodes)  # pruned by expand_tree's best_subtree to the budget
    q = [np.asarray(d.sampler.processor.candidates(r).probs()) for r in d.head_logits(d._h)]
    t = p.candidate
    for node, dist in t.draft_dists.items():
        dense = np.asarray(dist.dense(VS) if hasattr(dist, "dense") else dist, dtype=np.float64)
        assert np.allclose(dense[d.d2t], q[int(t.depth[node])], atol=1e-12)  # head depth+1's q
        assert dense[[1, 2]].sum() == 0


def test_pruning_sampled_children_by_head_probability_is_caught(monkeypatch):
    """The paper's pruning by head probability applied to *sampled* children (scores from
    the draws' probabilities): ``verify`` refuses the trees it reorders, and without that
    check the law is off the target's."""
    det = MedusaCalibration.bucket

    def by_probability(self, mode, confidence, depth):  # the mutation: confidence buckets for draws
        return det(self, 0, confidence, depth)

    monkeypatch.setattr(MedusaCalibration, "bucket", by_probability)
    d = synthetic_drafter()
    monkeypatch.setattr(verify_mod, "check_sampled_siblings", lambda tree: None)
    err, _ = law_error(d, 4)
    assert err > 1e-3


# -- the policy plans the step before the heads run ------------------------------------------------


def _steps_with_heads(costs_us: dict, n_steps: int = 100) -> tuple[int, int]:
    """``n_steps`` adaptive steps of the step's ``propose_one`` with the synthetic heads and a cost
    model of ``costs_us``, the target accepting the first drafted child of every tree; the
    head computations made and the steps the drafter counts as drafted."""
    from localspec.costmodel import CostModel
    from localspec.policy import SpeculationPolicy

    d = synthetic_drafter(shape=None)
    cost = CostModel(dict(costs_us))
    eng = SimpleNamespace(max_tree_nodes=8, adaptive=True, policy=SpeculationPolicy(cost, max_nodes=8),
                          cost_model=cost)  # fmt: skip
    calls = []
    real = d.heads.logits
    d.heads.logits = lambda h: (calls.append(1), real(h))[1]
    g = np.random.default_rng(0)
    for _ in range(n_steps):
        p = engine_propose(eng, d, d.history[-1], 8, 1000)
        emitted = ([int(p.tree.token_ids[1])] if p.tree.n_nodes > 1 else []) + [int(g.integers(VS))]
        d.observe(p.candidate, emitted)
        d.accept(emitted)
        d.set_final_hidden(len(d.history) - 2, g.standard_normal(8).astype(np.float32))
    return len(calls), d.stats.n_steps


def test_a_step_the_policy_does_not_draft_runs_no_head():
    """Where a tree of b nodes costs 2.5 b plain decodes (no tree can pay), the heads run only
    on the policy's probes -- the first, then after a gap whose plain steps' time pays 100
    times for a probe's rows (132 steps here): 1 of 100 -- and build no tree on the others
    (before the two-phase step every step ran the heads: 100). Where a tree costs what one
    token costs and the target accepts its drafts, they run on every step."""
    calls, drafted = _steps_with_heads({1: 10_000.0, 2: 25_000.0, 4: 50_000.0, 8: 100_000.0})
    assert calls == drafted == 1
    calls, drafted = _steps_with_heads({1: 1e6, 2: 1e6, 4: 1e6, 8: 1e6})
    assert calls == drafted == 100


def test_auto_takes_one_model_drafter():
    from localspec.drafters import make_drafter
    from localspec.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="not several"):
        make_drafter("auto", eagle="head.gguf", medusa="heads.gguf")


# -- the real model ------------------------------------------------------------------------------


def _shipped(model):
    from localspec.models.eagle3_heads import shipped_head

    return shipped_head(model.path, kind="medusa")


def test_shipped_heads_greedy_equal_plain_over_160_tokens_of_long_context(model):
    """Temperature 0, a 620-token prompt (past Gemma 3's 512-token window), 160 tokens: the
    shipped heads (found without a path) draft and are accepted, and the output is plain
    decoding's (``assert_greedy_is_target_argmax``). The heads read only the target's final
    hidden state, so the length that matters is the target's context, past the window from
    the first step. (Trees of 8 nodes on every step: 300 tokens took 54 s of the suite, 500
    tokens and 16 nodes 3 minutes; the EAGLE-3 head, which keeps a context of its own, is
    checked over 300 tokens after 820 in test_head_runtime.py.)"""
    assert _shipped(model) is not None
    e = Engine(model, drafter="none", n_ctx=2048, cost_model=frozen_cost_model(), max_tree_nodes=8)
    try:
        prompt = e.tokenize(PROSE * 30)[:620]
        e.set_drafter("medusa")
        e.drafter.fixed_shape = TreeShape(4, 2, 8, min_score=0.0)
        e.reset()
        e.adaptive = False  # verify every tree: the heads' drafts meet the target on every step
        res = e.generate(prompt, max_tokens=160, sampling=GREEDY)
        assert res.stats.n_generated_tokens == 160
        assert res.stats.token_sources.get("medusa", 0) > 0
        assert_greedy_is_target_argmax(e, prompt, res.token_ids)
    finally:
        e.close()


def test_auto_with_medusa_heads_merges_them_with_ngrams(model):
    """``--drafter auto --medusa PATH``: the n-gram tree every step and the heads' tree (every
    step here: not adaptive), merged into one verified tree. Greedy output equals plain
    decoding, and tokens of both sources are accepted."""
    e = Engine(model, drafter="auto", medusa=_shipped(model), n_ctx=1024, cost_model=frozen_cost_model(),
               adaptive=False, max_tree_nodes=16)  # fmt: skip
    try:
        assert e.drafter.name == "auto" and e.drafter.model.name == "medusa"
        prompt = e.tokenize(PROSE * 3)
        ref = e.generate(prompt, max_tokens=80, sampling=GREEDY, speculative=False)
        res = e.generate(prompt, max_tokens=80, sampling=GREEDY)
        assert_same_as_plain(e, prompt, ref.token_ids, res.token_ids)
        src = res.stats.token_sources
        assert src.get("medusa", 0) > 0 and src.get("ngram", 0) > 0, src
    finally:
        e.close()


def test_seeded_gumbel_and_rejection_on_the_real_model(model):
    """Seeded Gumbel: the same tokens as plain decoding with that seed. Rejection sampling:
    runs, drafts and accepts (its exactness is the enumeration test above)."""
    e = Engine(model, drafter="none", n_ctx=1024, cost_model=frozen_cost_model(), adaptive=False, max_tree_nodes=16)
    try:
        prompt = e.tokenize(PROSE * 3)
        gum = SamplingParams(temperature=0.8, seed=7, verify="gumbel")
        ref = e.generate(prompt, max_tokens=60, sampling=gum, speculative=False)
        e.set_drafter("medusa")
        e.reset()
        res = e.generate(prompt, max_tokens=60, sampling=gum)
        assert_same_as_plain(e, prompt, ref.token_ids, res.token_ids, sampling=gum)
        assert res.stats.n_spec_steps > 0
        rej = SamplingParams(temperature=1.0, seed=3, verify="rejection")
        out = e.generate(prompt, max_tokens=60, sampling=rej)
        assert out.stats.n_generated_tokens == 60 and out.stats.n_spec_steps > 0
    finally:
        e.close()


# -- the command line -------------------------------------------------------------------------------


def test_cli_medusa_flag_and_errors(capsys, tmp_path, model_path):
    from localspec.cli.main import main

    def one_line_error(argv) -> str:
        rc = main(argv)
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.startswith("localspec: error: ")]
        assert rc != 0 and len(lines) == 1 and "Traceback" not in err, err
        return lines[0]

    assert "none.gguf" in (msg0 := one_line_error(
        ["generate", "Hi", "--drafter", "medusa", "--medusa", str(tmp_path / "none.gguf"), "-n", "2"])) and "not found" in msg0
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    msg = one_line_error(["generate", "Hi", "--drafter", "medusa", "--medusa", str(bad), "-n", "2"])
    assert "bad.gguf is not a GGUF file" in msg
    assert main(["generate", "The capital of France is", "--drafter", "medusa", "-n", "8", "--temperature", "0", "--json"]) == 0
    out = capsys.readouterr().out
    assert '"drafter": "medusa"' in out


MEDUSA_SAMPLING = SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0, verify="rejection")


def test_shipped_heads_trees_through_the_engine_propose_path_are_exact(model):
    """The shipped heads draft 3 i.i.d. children of the root from head 1 at temperature 1
    (top-k 2, classic rejection sampling) through the step's ``propose_one`` with a node budget that
    keeps 2 of them; every draw enumerated (8 trees), each verified on the target's real rows
    (restricted to the tokens with probability > 0, which changes no decision): the step's
    tokens, extended by plain decoding, follow the target's law to 1e-12 (as the EAGLE-3
    head's test in test_propose_rejection.py)."""
    from test_propose_rejection import compress
    from localspec.request_state import RequestState
    from localspec.tree import TokenSource, TreeBuilder
    from localspec.verify import verify_rejection
    from conftest import FakeModel

    heads = _shipped(model)
    assert heads is not None
    eng = Engine(model, drafter="none", n_ctx=512, cost_model=frozen_cost_model(), adaptive=False)
    try:
        eng.set_drafter("medusa")
        d = eng.drafter
        d.width = 3
        d.fixed_shape = TreeShape(1, 3, 3, min_score=0.0)
        eng.adaptive = False
        eng.max_tree_nodes = 3
        prompt = model.tokenize("Question: What is the capital of France?\nAnswer: The capital of France is")
        eng.reset()
        d.begin(prompt)
        eng.cache.prefill(prompt[:-1])
        # any hidden state gives a valid draft distribution; take the true one of position len - 2
        from localspec.models.training.medusa_data import FinalNormRecorder

        rec = FinalNormRecorder(model.path, n_batch=64, n_threads=1)
        try:
            d.set_final_hidden(len(prompt) - 2, rec.record(prompt[:-1])[-1])
        finally:
            rec.close()

        def build(ch):
            d.sampler = EnumeratedDraftSampler(MEDUSA_SAMPLING.with_seed(0), model.n_vocab, model.suppress_tokens, ch, d.d2t)
            prop = engine_propose(eng, d, prompt[-1], 2, 256)  # depth 1
            assert prop.tree.n_nodes == 3 and prop.tree.is_stochastic(1)
            return prop.tree

        trees = oracle.enumerate_trees(build)
        assert len(trees) == 8 and abs(sum(p for p, _ in trees) - 1) < 1e-12
        pos = len(prompt)
        tcur = RequestState(MEDUSA_SAMPLING.with_seed(0), model, prompt).cursor(pos)
        draft_support = np.flatnonzero(np.asarray(trees[0][1].draft_dists[0].dense(model.n_vocab)
                                                  if hasattr(trees[0][1].draft_dists[0], "dense") else trees[0][1].draft_dists[0]))
        _, lg = eng.cache.decode_tree(TokenTree.root_only(prompt[-1]))
        root_row = lg[0].copy()
        eng.cache.truncate(len(prompt) - 1)
        p_root = tcur.target_probs(root_row)
        first = np.union1d(np.flatnonzero(p_root), draft_support)
        tb = TreeBuilder(prompt[-1])
        for t in first:
            tb.add(0, int(t), source=TokenSource.NGRAM)
        t1 = tb.build()
        _, lg = eng.cache.decode_tree(t1)
        eng.cache.truncate(len(prompt) - 1)
        rows_after = {int(t1.token_ids[i]): lg[i].copy() for i in range(1, t1.n_nodes)}
        cond_after = {
            t: RequestState(MEDUSA_SAMPLING.with_seed(0), model, prompt + [t]).cursor(pos + 1).target_probs(r)
            for t, r in rows_after.items()
        }
        ids = np.unique(np.concatenate([first] + [np.flatnonzero(c) for c in cond_after.values()]))
        local_root = root_row[ids]
        local_after = {t: r[ids] for t, r in rows_after.items()}
        lc = RequestState(MEDUSA_SAMPLING.with_seed(0), FakeModel(ids.size, eog=()), []).cursor(pos)
        assert np.allclose(lc.target_probs(local_root), p_root[ids], rtol=0, atol=1e-12)

        def cond(prefix):
            if not prefix:
                return lc.target_probs(local_root)
            return lc.target_probs(local_after[int(ids[prefix[0]])])

        def walk_local(tree, ch):
            rows = np.stack([local_root] + [local_after[int(tree.token_ids[i])] for i in range(1, tree.n_nodes)])
            t = compress(tree, ids)
            req = RequestState(MEDUSA_SAMPLING.with_seed(0), FakeModel(ids.size, eog=()), [])
            return tuple(verify_rejection(t, rows, oracle.branching_cursor(req.cursor(pos), ch)).tokens)

        law = oracle.step_law(trees, walk_local)
        assert oracle.max_abs_diff(oracle.extended_law(law, cond, 2), oracle.target_law(cond, 2)) < 1e-12
    finally:
        eng.set_drafter(None)
        eng.close()


def test_chi_square_of_sampled_steps_through_the_propose_path(rng):
    """Not enumerated: 4,000 real rejection-sampling steps (the drafter's own seeded draws, the
    engine's propose path, ``verify``) on the 4-token world, seeds 0..3999. The first two
    emitted tokens (extended by the target where a step emitted one) follow the target's law:
    chi-square over the 16 cells, p > 1e-3."""
    from conftest import FakeModel, chisquare_pvalue
    from localspec.request_state import RequestState
    from test_propose_rejection import rows_of

    d = synthetic_drafter()
    counts = np.zeros((VS, VS))
    g = np.random.default_rng(5)
    n = 4000
    for seed in range(n):
        req = RequestState(REJECTION.with_seed(seed), FakeModel(VS, eog=()), [])
        d.set_sampling(req)
        p = engine_propose(engine_shim(5), d, HISTORY[-1], 8, 1000)
        cur = req.cursor(10)
        toks = verify_mod.verify(p.tree, rows_of(p.tree), cur).tokens
        cur.close()
        if len(toks) == 1:
            toks = [toks[0], int(g.choice(VS, p=target_cond((toks[0],))))]
        counts[toks[0], toks[1]] += 1
    expect = [target_cond(())[a] * target_cond((a,))[b] for a in range(VS) for b in range(VS)]
    assert chisquare_pvalue(counts.ravel(), expect) > 1e-3


def test_train_medusa_smoke_record_train_export_draft(model, model_path, tmp_path, capsys):
    """The recipe end to end on a tiny plan: two 96-token chunks recorded (final-norm rows equal
    to a full decode's), 4 training steps, held-out accuracies reported, an F16 GGUF with a
    shared readout that the engine loads and drafts with (greedy output = plain decoding)."""
    pytest.importorskip("torch")
    from localspec.cli.main import main
    from localspec.models.training.eagle3_data import DataPlan

    toks = model.tokenize(PROSE * 12)
    plan = DataPlan([[("text", toks[:96])], [("text", [toks[0]] + toks[96:191])]], 0, {})
    plan.save(tmp_path / "plan.npz")
    out = tmp_path / "h.gguf"
    rc = main(["train-medusa", "--plan", str(tmp_path / "plan.npz"), "--out", str(out), "--work", str(tmp_path / "w"),
               "--steps", "4", "--batch", "16", "--vocab-size", "256", "--threads", "1", "--json"])  # fmt: skip
    assert rc == 0
    import json

    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["recorded_tokens"] == 192 and res["steps"] == 4 and len(res["val_acc_full_top1"]) == 4
    w = read_medusa_gguf(out)
    assert w.out.shape == (1, 256, 640) and w.n_heads == 4 and w.training["val_acc_full_top1"] == [round(a, 4) for a in res["val_acc_full_top1"]]
    e = Engine(model, drafter="medusa", medusa=out, n_ctx=512, cost_model=frozen_cost_model(), adaptive=False)
    try:
        prompt = e.tokenize(PROSE)
        spec = e.generate(prompt, max_tokens=24, sampling=GREEDY)
        plain = e.generate(prompt, max_tokens=24, sampling=GREEDY, speculative=False)
        assert spec.stats.n_spec_steps > 0
        assert_same_as_plain(e, prompt, plain.token_ids, spec.token_ids)
    finally:
        e.close()
