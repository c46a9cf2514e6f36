"""The C kernels (localspec.native) against the numpy / Python reference on the same inputs:
identical candidate sets, token choices, accepted paths and emitted tokens; probabilities
to 1e-6 (in practice ~1e-15); the n-gram index and drafter node for node."""

import math
import os

import numpy as np
import pytest

from conftest import FakeModel
from localspec import native
from localspec.bench.kernels import gemma_like_rows, spine_tree
from localspec.drafters.ngram import NgramDrafter
from localspec.drafters.ngram_index import NgramIndex
from localspec.errors import GrammarError, InvalidRequestError
from localspec.request_state import RequestState
from localspec.sampling import LogitsProcessor, SamplingParams, gumbel_noise, stream_key, uniforms
from localspec.tree import TokenSource, TreeBuilder
from localspec.verify import sample_from, verify
from test_sampling import CASES

needs_native = pytest.mark.skipif(not native.AVAILABLE, reason=f"native kernels not built: {native.LOAD_ERROR}")
WIDE = 262144


def test_native_library_is_built():
    """A checkout built with the README's commands has the kernels (LOCALSPEC_NATIVE=0
    is the only way to run without them)."""
    if os.environ.get("LOCALSPEC_NATIVE", "1") == "0":
        pytest.skip("LOCALSPEC_NATIVE=0")
    assert native.AVAILABLE, native.LOAD_ERROR
    assert native.enabled()


def test_a_library_older_than_its_sources_is_named(tmp_path):
    """``stale_sources``: the sources and headers written after the library, by name (a
    failed compile keeps the previous library, and ``load`` warns with these); none when the
    library is newer."""
    from localspec.native._lib import stale_sources

    lib, old_c, new_h, other = (tmp_path / n for n in ("lib.so", "a.c", "b.h", "notes.txt"))
    for p in (lib, old_c, new_h, other):
        p.write_text("x")
    os.utime(old_c, (1_000, 1_000))
    os.utime(lib, (2_000, 2_000))
    os.utime(new_h, (3_000, 3_000))
    os.utime(other, (3_000, 3_000))
    assert stale_sources(lib, tmp_path) == ["b.h"]
    os.utime(lib, (4_000, 4_000))
    assert stale_sources(lib, tmp_path) == []


# -- streams and row kernels ----------------------------------------------------------------


@needs_native
def test_streams_are_bit_exact():
    from localspec.native import lib, rows

    for seed, pos, stream in [(0, 0, 0), (7, 123, 1), (2**63 + 5, 10**6, 2)]:
        key = stream_key(seed, pos, stream)
        assert lib.ls_stream_key(seed, pos, stream) == key
        c = np.arange(0, 300000, 7)
        assert np.array_equal(rows.uniforms(key, c), uniforms(key, c))  # bit for bit
    ids = np.arange(WIDE)
    np.testing.assert_allclose(rows.gumbel_noise(9, 4, ids), gumbel_noise(9, 4, ids), rtol=1e-14, atol=1e-14)


@needs_native
def test_row_reductions_match_numpy(rng):
    from localspec.native import rows

    block = gemma_like_rows(rng, 4)
    block[1, rng.integers(0, WIDE, 100)] = -np.inf
    block[2, 77] = block[2].max()  # a tie: the first index wins
    block[2, 5] = block[2].max()
    block[3, [200000, 7000, 262143]] = block[3].max() + 1  # ties in different blocks
    for row in (np.full(WIDE, -np.inf, dtype=np.float32), np.full(1030, -np.inf, dtype=np.float32)):
        assert rows.argmax(row) == 0 == int(np.argmax(row))
    tail = np.zeros(1030, dtype=np.float32)
    tail[1029] = 1.0  # the maximum after the last whole block
    assert rows.argmax(tail) == 1029
    for row in block:
        assert rows.argmax(row) == int(np.argmax(row))
        x = row.astype(np.float64)
        fin = np.isfinite(x)
        m = x[fin].max()
        lse = m + np.log(np.exp(x[fin] - m).sum())
        assert rows.logsumexp(row) == pytest.approx(lse, rel=1e-14)
    np.testing.assert_allclose(rows.rows_logsumexp(block, [3, 0], n_threads=2), [rows.logsumexp(block[3]), rows.logsumexp(block[0])])
    for u in (0.0, 0.3, 0.999999):
        probs = np.array([0.0, 0.2, 0.0, 0.5, 0.3, 0.0])
        assert rows.sample_from(probs, u) == sample_from(probs, u)


@needs_native
@pytest.mark.parametrize("params", CASES, ids=lambda p: repr(p)[15:80])
@pytest.mark.parametrize("n_vocab", [600, WIDE])
def test_candidates_and_choices_match_reference(params, n_vocab, rng):
    ref = LogitsProcessor(params, n_vocab, use_native=False)
    nat = LogitsProcessor(params, n_vocab, use_native=True)
    for trial in range(4 if n_vocab == WIDE else 20):
        if n_vocab == WIDE:
            row = gemma_like_rows(rng, 1)[0]
        else:
            row = (rng.standard_normal(n_vocab) * rng.uniform(0.5, 4)).astype(np.float32)
        counts = {int(t): int(c) for t, c in zip(rng.integers(0, n_vocab, 5), rng.integers(1, 4, 5))}
        a, b = ref.candidates(row, counts), nat.candidates(row, counts)
        assert np.array_equal(a.ids, b.ids)
        assert np.array_equal(a.logits, b.logits)
        np.testing.assert_allclose(b.probs(), a.probs(), rtol=0, atol=1e-12)
        for pos in range(3):
            assert nat.choose(row, pos, trial, counts) == ref.choose(row, pos, trial, counts)


@needs_native
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, top_k=0, top_p=0.95, min_p=0.0),
        SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
        SamplingParams(temperature=0.8, top_k=0, top_p=0.5, min_p=0.0, logit_bias={1: -math.inf}),
        SamplingParams(temperature=0.8, top_k=3, top_p=1.0, min_p=0.0, logit_bias={1: -math.inf}),
        SamplingParams(temperature=0.8, top_k=0, top_p=1.0, min_p=0.1, logit_bias={1: -math.inf}),
    ],
    ids=lambda p: repr(p)[15:80],
)
def test_edge_rows_match_reference(params, rng):
    """Ties, banned tokens, flat rows, tiny vocabularies."""
    for n_vocab in (1, 2, 3, 17, 100):
        ref = LogitsProcessor(params, max(n_vocab, 2), use_native=False)
        nat = LogitsProcessor(params, max(n_vocab, 2), use_native=True)
        for row in (
            np.zeros(max(n_vocab, 2), dtype=np.float32),
            np.round(rng.standard_normal(max(n_vocab, 2))).astype(np.float32),
            (rng.standard_normal(max(n_vocab, 2)) * 20).astype(np.float32),
        ):
            try:
                a = ref.candidates(row)
            except InvalidRequestError as e:
                with pytest.raises(type(e)):
                    nat.candidates(row)
                continue
            b = nat.candidates(row)
            assert np.array_equal(a.ids, b.ids) and np.array_equal(a.logits, b.logits)
            for pos in range(5):
                assert nat.choose(row, pos, 3) == ref.choose(row, pos, 3)


@needs_native
def test_banned_rows_raise_the_reference_errors():
    n = 50
    row = np.zeros(n, dtype=np.float32)
    every = {t: -math.inf for t in range(n)}
    for params, err in [
        (SamplingParams.greedy(logit_bias=every), InvalidRequestError),
        (SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, logit_bias=every), GrammarError),
        (SamplingParams(temperature=1.0, logit_bias=every), InvalidRequestError),
    ]:
        for use in (False, True):
            proc = LogitsProcessor(params, n, use_native=use)
            with pytest.raises(err):
                proc.choose(row, 0, 0)


@needs_native
def test_results_do_not_depend_on_threads(rng):
    params = SamplingParams(temperature=0.8, top_k=0, top_p=0.95, min_p=0.0)
    proc = LogitsProcessor(params, WIDE, use_native=True)
    rows = gemma_like_rows(rng, 3)
    out = []
    for n in (1, 2, 4):
        native.set_threads(n)
        try:
            out.append([(proc.candidates(r).probs().tolist(), proc.choose(r, 5, 1)) for r in rows])
            out[-1].append(LogitsProcessor(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0), WIDE).choose(rows[0], 9, 2))
        finally:
            native.set_threads(native._default_threads())
    assert out[0] == out[1] == out[2]


# -- tree verification ----------------------------------------------------------------------


def random_tree(rng, n_vocab, n_nodes, stochastic, f64):
    """A random tree; with ``stochastic``, some parents get a draft distribution and their
    first children are drawn from it (then deterministic children follow)."""
    b = TreeBuilder(int(rng.integers(n_vocab)))
    while len(b) < n_nodes:
        p = int(rng.integers(0, len(b)))
        if stochastic and p not in b.draft_dists and rng.random() < 0.5:
            q = rng.dirichlet(np.full(n_vocab, 0.3))
            q = q.astype(np.float64 if f64 else np.float32)
            b.set_draft_dist(p, q)
            for _ in range(int(rng.integers(1, 4))):
                q64 = q.astype(np.float64)
                x = int(rng.choice(n_vocab, p=q64 / q64.sum()))
                b.add(p, x, source=TokenSource.DRAFT_MODEL, draft_prob=float(q[x]))
        else:
            b.add(p, int(rng.integers(n_vocab)), source=TokenSource.NGRAM)
    return b.build()


def run_both(tree, logits, params, history=(), pos=10, n_vocab=None):
    model = FakeModel(n_vocab or logits.shape[1], eog=())
    out = []
    for use in (False, True):
        with native.use(use):
            req = RequestState(params, model, list(history))
            cur = req.cursor(pos)
            res = verify(tree, logits, cur)
            out.append((res, cur.pos))
    return out


def assert_same(a, b):
    (ra, pa), (rb, pb) = a, b
    assert ra.path == rb.path
    assert ra.tokens == rb.tokens
    assert ra.rows == rb.rows and ra.sources == rb.sources and ra.depths == rb.depths
    assert pa == pb  # the cursor advanced past the same accepted tokens


VERIFY_CASES = [
    SamplingParams.greedy(seed=1),
    SamplingParams(temperature=0.8, top_k=0, top_p=0.95, min_p=0.0),
    SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    SamplingParams(),
    SamplingParams(temperature=0.8, top_k=0, top_p=0.95, min_p=0.0, verify="rejection"),
    SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, verify="rejection"),
    SamplingParams(verify="rejection"),
    SamplingParams(temperature=0.7, repeat_penalty=1.4, frequency_penalty=0.3, presence_penalty=0.2, penalty_last_n=6, verify="rejection"),
    SamplingParams(temperature=0.7, repeat_penalty=1.4, presence_penalty=0.5, penalty_last_n=-1),
    SamplingParams.greedy(repeat_penalty=1.5, penalty_last_n=4, logit_bias={2: 3.0, 5: -math.inf}),
]


@needs_native
@pytest.mark.parametrize("params", VERIFY_CASES, ids=lambda p: repr(p)[15:90])
def test_small_vocab_trees_match_reference(params, rng):
    """Many random trees over an 8-token vocabulary: every branch of both walks is taken
    (acceptances, rejections, residual updates, point-mass exhaustion, bonus tokens)."""
    V = 8
    for trial in range(150):
        tree = random_tree(rng, V, int(rng.integers(1, 14)), stochastic="rejection" == params.verify, f64=trial % 2 == 0)
        # peaked rows so that walks go deep
        logits = (rng.standard_normal((tree.n_nodes, V)) * 2.5).astype(np.float32)
        for i in range(1, tree.n_nodes):
            logits[int(tree.parents[i]), int(tree.token_ids[i])] += rng.uniform(0, 3)
        history = rng.integers(0, V, 10).tolist()
        assert_same(*run_both(tree, logits, params.with_seed(trial), history))


@needs_native
@pytest.mark.parametrize("params", VERIFY_CASES[:7], ids=lambda p: repr(p)[15:90])
def test_wide_trees_match_reference(params, rng):
    """64-node trees over 262,144-token rows: same accepted path, tokens and sources."""
    rows = gemma_like_rows(rng, 64)
    for trial in range(2):
        seed = 100 + trial
        tree = spine_tree(rng, params, rows, 64, 12, seed, pos=50)
        a, b = run_both(tree, rows, params.with_seed(seed), pos=50)
        assert_same(a, b)
        if params.verify == "gumbel":
            assert a[0].accept_length == 12


@needs_native
def test_target_probs_match_reference(rng):
    """Dense target_probs of a row (the rejection walk's starting residual) to 1e-6."""
    rows = gemma_like_rows(rng, 2)
    for params in (SamplingParams(temperature=0.8, top_k=0, top_p=0.95, min_p=0.0), SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)):
        out = []
        for use in (False, True):
            with native.use(use):
                cur = RequestState(params.with_seed(1), FakeModel(WIDE, eog=()), []).cursor(0)
                out.append([cur.target_probs(r) for r in rows])
        for a, b in zip(*out):
            np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)
            assert np.array_equal(a > 0, b > 0)


@needs_native
def test_verify_errors_match_reference():
    V = 8
    rows = np.zeros((3, V), dtype=np.float32)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, verify="rejection", seed=0)
    b = TreeBuilder(0)
    q = np.full(V, 1.0 / V)
    q[3] = 0.0
    b.set_draft_dist(0, q)
    b.add(0, 3, source=TokenSource.DRAFT_MODEL, draft_prob=0.0)
    zero_prob = b.build()
    b = TreeBuilder(0)
    b.add(0, 3, source=TokenSource.DRAFT_MODEL, draft_prob=0.5)
    no_dist = b.build()
    for tree, err in [(zero_prob, ValueError), (no_dist, KeyError)]:
        for use in (False, True):
            with native.use(use):
                cur = RequestState(params, FakeModel(V, eog=()), []).cursor(0)
                with pytest.raises(err):
                    verify(tree, rows, cur)


# -- n-gram index and drafter ---------------------------------------------------------------


def _same_tree(a, b):
    return all(
        np.array_equal(getattr(a, f), getattr(b, f)) for f in ("token_ids", "parents", "depth", "source", "score", "feature")
    ) and np.array_equal(np.isnan(a.draft_probs), np.isnan(b.draft_probs))


@needs_native
@pytest.mark.parametrize("vocab", [2, 5, 40])
@pytest.mark.parametrize("max_n", [1, 3, 8])
def test_native_index_matches_reference(vocab, max_n, rng):
    from localspec.native.ngram import NativeNgramIndex

    a, b = NgramIndex(max_n), NativeNgramIndex(max_n)
    toks = rng.integers(0, vocab, 1500).tolist()
    for i, t in enumerate(toks):
        a.append(t)
        b.append(t)
        if i % 5 == 0:
            for mo in (0, 1, 4, 16):
                for mn in (1, 2):
                    ra, rb = a.lookup_all(min_n=mn, max_occurrences=mo), b.lookup_all(min_n=mn, max_occurrences=mo)
                    assert [(m.order, m.starts) for m in ra] == [(m.order, m.starts) for m in rb]
                    la, lb = a.lookup(min_n=mn, max_occurrences=mo), b.lookup(min_n=mn, max_occurrences=mo)
                    assert (la is None and lb is None) or (la.order, la.starts) == (lb.order, lb.starts)
        if i % 300 == 299:
            cut = int(rng.integers(0, i))
            a.truncate(cut)
            b.truncate(cut)
            assert b.tokens.tolist() == a.tokens and len(b) == len(a)
            other = a.tokens[: int(rng.integers(0, cut + 1))] + rng.integers(0, vocab, 40).tolist()
            a.reset(other)
            b.reset(other)
            assert b.tokens.tolist() == a.tokens == other


@needs_native
def test_native_drafter_builds_the_same_trees(rng):
    from localspec.bench.ngram import synthetic_history
    from localspec.native.ngram import NativeNgramIndex

    hist = synthetic_history(4000, seed=3)
    for kw in ({}, {"max_n": 3, "max_depth": 6}, {"max_occurrences": 40, "min_n": 2}):
        ref, nat = NgramDrafter(index=NgramIndex(kw.get("max_n", 8)), **kw), NgramDrafter(index=NativeNgramIndex(kw.get("max_n", 8)), **kw)
        ref.begin(hist[:800])
        nat.begin(hist[:800])
        for i in range(200):
            depth, nodes = int(rng.integers(0, 20)), int(rng.integers(1, 80))
            ta, tb = ref.propose(depth, nodes), nat.propose(depth, nodes)
            assert _same_tree(ta, tb), i
            emitted = hist[800 + i : 800 + i + 1 + i % 4]
            ref.observe(ta, emitted)
            nat.observe(tb, emitted)
            ref.accept(emitted)
            nat.accept(emitted)


@needs_native
def test_default_drafter_index_follows_the_switch():
    from localspec.native.ngram import NativeNgramIndex

    assert isinstance(NgramDrafter().index, NativeNgramIndex)
    with native.use(False):
        assert isinstance(NgramDrafter().index, NgramIndex)


# -- the engine ------------------------------------------------------------------------------

PROMPT = "The three primary colours are red, yellow and blue. The three primary colours are"


@needs_native
def test_engine_output_is_identical_with_and_without_native_kernels(engine):
    """Greedy: with the native kernels, speculative decoding (n-gram and random drafts) gives
    exactly the reference's plain greedy output. Seeded Gumbel sampling: native and
    reference speculative runs give the same tokens for a seed, and so does plain decoding."""
    from helpers import RandomDrafter

    def run(use, sampling, drafter=None):
        with native.use(use):
            engine.reset()
            if drafter is None:
                return engine.generate(PROMPT, max_tokens=32, sampling=sampling, speculative=False).token_ids
            engine.drafter = drafter() if callable(drafter) else drafter
            engine.adaptive = not isinstance(engine.drafter, RandomDrafter)
            return engine.generate(PROMPT, max_tokens=32, sampling=sampling).token_ids

    old_drafter, old_adaptive = engine.drafter, engine.adaptive
    try:
        greedy = SamplingParams.greedy()
        want = run(False, greedy)
        assert run(True, greedy) == want
        assert run(True, greedy, NgramDrafter) == want
        assert run(True, greedy, RandomDrafter(width=3, depth=4, seed=2)) == want
        sampled = SamplingParams(temperature=0.8, top_k=0, top_p=0.95, min_p=0.0, seed=11)
        ref = run(False, sampled, NgramDrafter)
        assert run(True, sampled, NgramDrafter) == ref
        assert run(True, sampled) == ref
    finally:
        engine.drafter, engine.adaptive = old_drafter, old_adaptive


def test_bench_host_measures_forced_trees(engine):
    """`localspec bench host`: every verified tree has the forced size, host and decode times
    are measured, and native and reference runs emit the same tokens."""
    from localspec.bench.host import SAMPLINGS, bench_host

    rows = bench_host(engine, n_nodes=6, max_tokens=10, prompts=(PROMPT,), samplings=SAMPLINGS)
    assert {(r.sampling, r.kernels) for r in rows} >= {(s, "reference") for s in SAMPLINGS}
    for r in rows:
        assert r.steps > 0 and r.t_decode_us_per_step > 0 and r.t_host_us_per_step > 0
        assert 3 < r.mean_tree_nodes <= 6  # 6 per step; the last steps may be cut by max_tokens
        assert r.identical_to_reference in (None, True)
    assert engine.drafter.name == "ngram" and engine.adaptive


def test_plain_c_loops_give_the_same_answers(tmp_path):
    """The library built without vector extensions, SIMD clones and OpenMP (what a compiler
    without GCC/Clang extensions, e.g. MSVC, compiles) passes the comparison tests too, the
    EAGLE-3 head's kernels included."""
    import shutil
    import subprocess
    import sys
    import sysconfig
    from pathlib import Path

    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if not shutil.which(cc):
        pytest.skip("no C compiler")
    root = Path(__file__).resolve().parent.parent
    lib = tmp_path / "libls_plain.so"
    sources = sorted(str(p) for p in (root / "native").glob("*.c"))
    subprocess.run(
        [cc, "-O2", "-std=c11", "-ffp-contract=off", "-fPIC", "-shared", "-DLS_NO_VEC", "-DLS_NO_CLONES", "-o", str(lib), *sources, "-lm"],
        check=True,
    )
    env = {**os.environ, "LOCALSPEC_NATIVE_LIB": str(lib)}
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(Path(__file__)),
         str(Path(__file__).parent / "test_eagle3_host.py"),
         "-k", "streams or reductions or edge_rows or small_vocab_trees or native_index_matches or native_drafter "
         "or q8_kernels or attention_kernel or half_kernel or elementwise_kernels"],
        env=env, cwd=root, capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "passed" in r.stdout and "skipped" not in r.stdout, r.stdout[-1000:]  # it really loaded that build


@needs_native
def test_token_logprobs_match_the_numpy_reference(rng):
    """token_logprobs on the C kernels (rows_logsumexp, top_k) equals the numpy reference:
    the same top ids in the same order (ties by id), values to 1e-9."""
    from localspec.results import token_logprobs

    logits = gemma_like_rows(rng, 4, 262_144)  # [4, n_vocab] float32
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1.0  # a tie at the top
    rows, tokens = [0, 2, 3], [5, 9, 11]
    with native.use(True):
        fast = token_logprobs(logits, rows, tokens, 5)
    with native.use(False):
        ref = token_logprobs(logits, rows, tokens, 5)
    for a, b in zip(fast, ref, strict=True):
        assert a.token == b.token
        assert a.logprob == pytest.approx(b.logprob, abs=1e-9)
        assert [i for i, _ in a.top] == [i for i, _ in b.top]
        assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-9)
    assert [i for i, _ in ref[1].top][:2] == [7, 9]


@needs_native
def test_one_top_k_rule_with_ties_at_the_kth_place():
    """Logits tied at the k-th place: the C kernel and the numpy reference both keep the lower
    ids (a plain argpartition + lexsort keeps whichever of the tied ids the partition left in,
    the defect this rule replaced); the logprobs' top lists agree with both."""
    from localspec.results import token_logprobs
    from localspec.sampling import _top_sorted, top_k

    x = np.full(1000, -5.0, dtype=np.float32)
    x[[3, 10]] = 4.0
    x[[900, 17, 500, 42]] = 2.0  # four ids tied at places 3..6
    want = [3, 10, 17, 42]  # top-4: the two largest, then the lowest tied ids
    with native.use(True):
        assert top_k(x, 4).tolist() == want
        fast = token_logprobs(x[None, :], [0], [3], 4)
    with native.use(False):
        assert top_k(x, 4).tolist() == want
        ref = token_logprobs(x[None, :], [0], [3], 4)
    assert _top_sorted(x, 4).tolist() == want
    assert [i for i, _ in fast[0].top] == [i for i, _ in ref[0].top] == want
