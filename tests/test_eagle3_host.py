"""The EAGLE-3 head's host runtime (``drafters/eagle3_host.py``, ``native/ls_head.c``) against
llama.cpp's ``eagle3`` graph (``Eagle3Drafter(runtime="llama")``, the reference): the
kernels against numpy, the same draft-vocabulary rows to a stated tolerance at level 0 (with
its catch-up) and deeper levels, the same greedy drafts, and output identical to plain
decoding."""

import os

import numpy as np
import pytest

from conftest import frozen_cost_model
from helpers import PROSE, assert_same_as_plain
from localspec import Engine, SamplingParams, native
from localspec.drafters.base import TargetHandle
from localspec.drafters.tree_expand import DraftCalibration, expand_tree
from localspec.policy import TreeShape
from localspec.tree import TokenSource

pytestmark = pytest.mark.skipif(not native.AVAILABLE, reason=f"native kernels not built: {native.LOAD_ERROR}")
GREEDY = SamplingParams.greedy()
ORDER_GAP = 0.01
"""Candidates further apart than 1% of the row's largest magnitude keep their order on both
runtimes (the shipped head's rows differ by 0.4-1.1%)."""
ROW_TOL = 0.03
"""Host rows match the graph's to 3% of the row's largest magnitude (measured on this test's
trees: 0.5-1.3% on the head shipped until 2026-12-05, 0.6-2.1% on the head of 2026-12-05,
whole or cut; both runtimes quantise the activations to Q8_0 the same way, the rest is the
order of float sums and llama.cpp's flash attention, which accumulates V in float16). The
faults the tests were checked against are off by far more (11% and 49%)."""


# -- kernels ---------------------------------------------------------------------------------


def _ref_quantize(x):
    """ggml's quantize_row_q8_0 in numpy: d = amax / 127 as float16, q = rint(x * 127 / amax)."""
    b = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(b).max(-1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    q = np.rint(b * inv[..., None]).astype(np.int8).reshape(x.shape)
    d = (amax / np.float32(127.0)).astype(np.float16).astype(np.float32)
    return q, d


def test_q8_kernels_match_numpy(rng):
    """``ls_q8_quantize_rows`` is ggml's Q8_0 quantisation (ids and float16 scales exactly);
    ``ls_gemm_q8`` is the block-scaled integer product of the quantised rows and the matrix,
    for any thread count and rows of any count (a wrong block scale, rounding or row stride
    fails)."""
    from localspec.native.head import Q8Matrix, quantize_rows

    for m, k, nr in [(70, 64, 1), (257, 640, 5), (33, 1280, 9), (8, 32, 13)]:
        x = (rng.standard_normal((nr, k)) * rng.uniform(0.1, 30, (nr, 1))).astype(np.float32)
        x[0, :32] = 0.0  # an all-zero block
        q, d = quantize_rows(x)
        rq, rd = _ref_quantize(x)
        assert np.array_equal(q, rq) and np.array_equal(d, rd)
        w = Q8Matrix(rng.integers(-127, 128, (m, k)).astype(np.int8), rng.uniform(1e-4, 1e-2, (m, k // 32)).astype(np.float32))
        qi = rq.reshape(nr, k // 32, 32).astype(np.int64)
        wi = w.q.reshape(m, k // 32, 32).astype(np.int64)
        ref = np.einsum("rbj,mbj->rmb", qi, wi).astype(np.float64) * (rd[:, None, :] * w.d[None, :, :])
        ref = ref.sum(-1)
        for threads in (1, 3):
            y = w.apply(x, threads)
            np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
        # against the float product: the quantisation error of x only
        np.testing.assert_allclose(y, x @ w.dense().T, atol=0.02 * np.abs(ref).max())
    with pytest.raises(ValueError, match="k % 32"):
        Q8Matrix(np.zeros((2, 40), np.int8), np.zeros((2, 1), np.float32))


def _ref_pack4(q, d):
    """``ls_q8_pack4`` in numpy: per group of four rows, each block pair's 64 bytes of the four
    rows side by side, then an odd last block of the four rows; the scales in the same order."""
    m, k = q.shape
    nb, g = k // 32, m // 4
    qb, db = q[: 4 * g].reshape(g, 4, nb, 32), d[: 4 * g].reshape(g, 4, nb)
    npair = nb // 2
    pairs = qb[:, :, : 2 * npair].reshape(g, 4, npair, 64).transpose(0, 2, 1, 3).reshape(g, -1)
    odd = qb[:, :, 2 * npair :].reshape(g, -1)
    dpairs = db[:, :, : 2 * npair].reshape(g, 4, npair, 2).transpose(0, 2, 1, 3).reshape(g, -1)
    return np.concatenate([pairs, odd], 1), np.concatenate([dpairs, db[:, :, 2 * npair :].reshape(g, -1)], 1)


def test_q8_products_are_the_same_bits_packed_alone_or_batched(rng):
    """The packed copy (``ls_q8_pack4``) holds the rows in the documented order, and the product
    that reads it (four rows at once, where the CPU has AVX-512 VNNI or AVX2) gives every output bit
    for bit what the row-by-row product (``ls_gemm_q8``, unpacked) gives; and an activation row
    gets the same bits alone as among others (a request's draft does not depend on the
    requests drafting beside it), for any thread count. Shapes: tail rows (m % 4), an odd last
    block after pairs (k = 96), a lone block (k = 32), more than four activation rows."""
    from localspec.native import lib
    from localspec.native.head import Q8Matrix

    for m, k, nr in [(70, 64, 1), (13, 96, 6), (8, 32, 5), (257, 640, 9), (4, 1280, 3)]:
        w = Q8Matrix(rng.integers(-127, 128, (m, k)).astype(np.int8), rng.uniform(1e-4, 1e-2, (m, k // 32)).astype(np.float32))
        q4, d4 = _ref_pack4(w.q, w.d)
        assert np.array_equal(w.q4, q4) and np.array_equal(w.d4, d4)
        x = (rng.standard_normal((nr, k)) * rng.uniform(0.1, 30, (nr, 1))).astype(np.float32)
        for threads in (1, 2, 3):
            y = w.apply(x, threads)
            rows = np.empty_like(y)
            assert lib.ls_gemm_q8(w.q.ctypes.data, w.d.ctypes.data, m, k, x.ctypes.data, nr, rows.ctypes.data, threads) == 0
            assert np.array_equal(y, rows)
            assert np.array_equal(y, np.concatenate([w.apply(x[r : r + 1], threads) for r in range(nr)]))


def _check_attention(rng, attention):
    """``attention`` against numpy: head sizes with and without a whole 64-wide slice or a
    whole vector (20: a scalar remainder after the 16- and 8-wide steps), grouped query heads,
    entries of 1 to 400 keys (the last two cases long enough to split over threads), keys in
    any order, scores far beyond exp's float32 range (the softmax must subtract the maximum);
    every thread count gives the same bits."""
    for H, Hkv, hd, pool, lens, q_scale in [(4, 2, 16, 11, [1, 3, 11, 2], 1.0), (4, 1, 128, 300, [300, 1, 65, 130], 1.0),
                                            (2, 2, 80, 200, [200, 7], 1.0), (4, 2, 20, 400, [400, 300, 250], 30.0)]:  # fmt: skip
        kpool = rng.standard_normal((pool, Hkv * hd)).astype(np.float32)
        vpool = rng.standard_normal((pool, Hkv * hd)).astype(np.float32)
        keys = [rng.permutation(pool)[:c] for c in lens]
        q = (rng.standard_normal((len(keys), H * hd)) * q_scale).astype(np.float32)
        off = np.cumsum([0] + lens)
        got = attention(q, H, Hkv, hd, kpool, vpool, off, np.concatenate(keys), 0.25)
        for e, ks in enumerate(keys):
            for h in range(H):
                kh = slice(h // (H // Hkv) * hd, (h // (H // Hkv) + 1) * hd)
                sc = kpool[ks, kh].astype(np.float64) @ q[e, h * hd : (h + 1) * hd] * 0.25
                p = np.exp(sc - sc.max())
                p /= p.sum()
                np.testing.assert_allclose(got[e, h * hd : (h + 1) * hd], p @ vpool[ks, kh], rtol=1e-4, atol=1e-5)
        for threads in (2, 3):
            assert np.array_equal(attention(q, H, Hkv, hd, kpool, vpool, off, np.concatenate(keys), 0.25, threads), got)


def test_attention_kernel_matches_numpy(rng):
    """``ls_head_attn``: each entry's softmax over its own key rows, query head h reading kv
    head h // (H / Hkv), the same for any thread count; a key outside the pool is refused."""
    from localspec.native.head import attention

    _check_attention(rng, attention)
    kpool = vpool = np.zeros((3, 16), np.float32)
    with pytest.raises(ValueError):
        attention(np.zeros((1, 16), np.float32), 1, 1, 16, kpool, vpool, np.array([0, 2]), np.array([0, 3]), 0.25)


# -- host rows vs the graph's rows -------------------------------------------------------------


class _Tee:
    """A level decoder that asks the graph (``ref``) and the host (``host``) for every level of
    the same tree; drafts follow the graph's rows."""

    def __init__(self, ref, host) -> None:
        self.ref, self.host, self.levels = ref, host, []

    def decode_level(self, tree, nodes):
        a = self.ref.decode_level(tree, nodes)
        b = self.host.decode_level(tree, nodes)
        self.levels.append((list(nodes), a, b))
        return a


def _pair(model, head, n_ctx=1024, **options):
    """An engine whose drafter is the graph runtime, and a host-runtime drafter attached to the
    same target context."""
    from localspec.drafters.eagle3 import Eagle3Drafter

    ref = Eagle3Drafter(head, runtime="llama", **options)
    e = Engine(model, drafter=ref, n_ctx=n_ctx, cost_model=frozen_cost_model())
    host = Eagle3Drafter(head, runtime="host", **options)
    host.attach(TargetHandle(model, n_ctx=e.ctx.n_ctx, n_threads=e.ctx.n_threads, tensor_source=e.ctx, features=e._tap))
    assert (ref.runtime, host.runtime) == ("llama", "host")
    return e, ref, host


def _start(e, drafters, prompt):
    for d in drafters:
        d.begin(prompt)
        d.set_sampling(None)
    e.cache.prefill(prompt[:-1])
    feats = e._tap.take()
    for d in drafters:
        d.add_target_features(0, feats)


def _grow(d, prompt, shape, decoder=None):
    tree = expand_tree(prompt[-1], len(prompt) - 1, shape, decoder or d, d.sampler, DraftCalibration(), TokenSource.EAGLE3)
    return tree


def _done(*drafters):
    for d in drafters:
        d.release_tree()
        d.check_cache()


@pytest.mark.parametrize("n_prompt", [9, 60], ids=["short", "past-the-window"])
def test_host_rows_match_the_graph_at_every_level(model, n_prompt):
    """Level 0 (a catch-up of 8 entries, or a prompt past the 16-entry window) and three deeper
    levels of a tree 3 wide: the host's draft-vocabulary rows equal the graph's to ``ROW_TOL``
    of the row's largest magnitude, the same width ([n, len(d2t)]), and the same best child at
    level 0. Feeding the host the token at the entry's own position (instead of the next one)
    or dropping the committed entries from a deeper level's keys is off by far more (checked:
    11% and 49%)."""
    from localspec.models.eagle3_heads import shipped_head

    e, ref, host = _pair(model, shipped_head(model.path))
    try:
        prompt = e.tokenize(PROSE * 3)[:n_prompt]
        _start(e, (ref, host), prompt)
        tee = _Tee(ref, host)
        _grow(ref, prompt, TreeShape(4, 3, 12, 0.0), tee)
        _done(ref, host)
        assert len(tee.levels) == 4
        for depth, (nodes, a, b) in enumerate(tee.levels):
            assert a.shape == b.shape == (len(nodes), ref.d2t.size)
            err = np.abs(a - b).max(axis=1) / np.abs(a).max(axis=1)
            assert err.max() < ROW_TOL, (depth, err)
        a0, b0 = tee.levels[0][1], tee.levels[0][2]
        assert np.argmax(a0) == np.argmax(b0)
        assert host.kv_len == ref.kv_len and host.kv_first == ref.kv_first
    finally:
        host.close()
        e.close()


def _buckets(drafter, row, k):
    """The calibration buckets of a row's ``k`` greedy children (what their tree scores use)."""
    ch = drafter.sampler.children(row, 0, k)
    return [DraftCalibration.bucket(drafter.sampler.mode, float(c), 1) for c in ch.confidence]


def test_host_greedy_drafts_equal_the_graphs(model):
    """Greedy chains of 5 and trees 2 wide on twenty prompts: at every level the host ranks each
    node's best children as the graph does wherever the graph's row separates them by more
    than ``ORDER_GAP`` of its largest magnitude (the rows differ by up to 1.1%; closer
    candidates may swap: the head's near-ties), and those are most rows; the trees grown by
    the host alone equal the graph's whenever no level of the graph's tree had a near-tie.
    A child whose confidence falls in another calibration bucket on the two runtimes (a
    probability at an edge of ``CONF_EDGES``, e.g. 0.102 against 0.097) is a near-tie too:
    its score, and so which nodes the tree keeps across rows, differs."""
    from localspec.models.eagle3_heads import shipped_head

    e, ref, host = _pair(model, shipped_head(model.path))
    checked = ties = same_trees = 0
    try:
        words = e.tokenize(PROSE * 8)
        for i, n in enumerate(range(20, 220, 10)):
            prompt = words[i : i + n]
            for shape in (TreeShape(5, 1, 6, 0.0), TreeShape(3, 2, 7, 0.0)):
                e.reset()
                _start(e, (ref, host), prompt)
                tee = _Tee(ref, host)
                a = _grow(ref, prompt, shape, tee)
                _done(ref, host)
                tied = False
                for _, rows_a, rows_b in tee.levels:
                    for ra, rb in zip(rows_a, rows_b):
                        order = np.argsort(-ra, kind="stable")[: shape.width + 1]
                        sep = [ra[order[j]] - ra[order[j + 1]] > ORDER_GAP * np.abs(ra).max() for j in range(shape.width)]
                        k = sep.index(False) if False in sep else shape.width
                        got = np.argsort(-rb, kind="stable")[:k]
                        assert got.tolist() == order[:k].tolist()
                        checked += k == shape.width
                        ties += k < shape.width
                        edge = _buckets(ref, ra, shape.width) != _buckets(ref, rb, shape.width)
                        tied |= k < shape.width or edge
                if not tied:  # no near-tie: the host's own tree is the graph's, token for token
                    e.reset()
                    _start(e, (ref, host), prompt)
                    b = _grow(host, prompt, shape)
                    _done(ref, host)
                    assert a.token_ids.tolist() == b.token_ids.tolist() and a.parents.tolist() == b.parents.tolist()
                    same_trees += 1
        # not vacuous: most rows checked, some whole trees compared. Measured (checked, ties, same
        # trees): 149, 51, 7 on a 2-core AMD EPYC Zen 4; 121, 79, 2 on a 2-core Intel Xeon
        # (AVX-512 VNNI), where llama.cpp's graph rows have more near-ties or bucket edges
        assert checked >= ties and same_trees >= 2, (checked, ties, same_trees)
    finally:
        host.close()
        e.close()


# -- lossless on the host runtime --------------------------------------------------------------


@pytest.mark.parametrize(
    "sampling",
    [GREEDY, SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.0, seed=11)],
    ids=["greedy", "seeded"],
)
def test_host_runtime_output_equals_plain_decoding(model, sampling):
    """The shipped head on the host runtime (the default where the library is built):
    greedy and seeded sampled output equal plain decoding's, and the head drafted."""
    from localspec.drafters.eagle3 import Eagle3Drafter
    from localspec.models.eagle3_heads import shipped_head

    e = Engine(model, drafter="none", n_ctx=2048, cost_model=frozen_cost_model())
    try:
        prompt = e.tokenize(PROSE * 3)
        ref = e.generate(prompt, max_tokens=80, sampling=sampling, speculative=False)
        d = Eagle3Drafter(shipped_head(model.path), shape=TreeShape(4, 2, 8, 0.0))
        e.set_drafter(d)
        assert d.runtime == "host" and d.ctx is None  # no llama.cpp context for the head
        e.adaptive = False
        e.reset()
        res = e.generate(prompt, max_tokens=80, sampling=sampling)
        assert res.stats.token_sources.get("eagle3", 0) > 0
        assert_same_as_plain(e, prompt, ref.token_ids, res.token_ids, sampling=sampling)
    finally:
        e.close()


def test_runtime_option_is_checked(random_head_path):
    from localspec.drafters.eagle3 import Eagle3Drafter

    with pytest.raises(ValueError, match="runtime must be one of auto, host, llama"):
        Eagle3Drafter(random_head_path, runtime="gpu")


def test_elementwise_kernels_match_numpy(rng):
    """``ls_rms_norm_rows``, ``ls_rope_norm`` (partial rotary dims too) and ``ls_swiglu_rows``
    against the numpy definitions (``eagle3_host.rms_norm``, ``HeadWeights.rope``)."""
    from types import SimpleNamespace

    from localspec.drafters.eagle3_host import HeadWeights, rms_norm
    from localspec.native import head as nh

    x = (rng.standard_normal((5, 96)) * 3).astype(np.float32)
    w = rng.standard_normal(96).astype(np.float32)
    np.testing.assert_allclose(nh.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6), rtol=2e-6, atol=1e-6)
    pos = np.array([0, 3, 17, 400, 9999])
    for n_rot in (32, 16):
        fake = SimpleNamespace(head_dim=32, n_rot=n_rot, rope_inv=10000.0 ** (-np.arange(0, n_rot, 2) / n_rot) / 2.0)
        ref = HeadWeights.rope(fake, x, pos, 3)
        np.testing.assert_allclose(nh.rope_norm(x, pos, 3, 32, n_rot, fake.rope_inv), ref, rtol=1e-5, atol=1e-5)
    gu = rng.standard_normal((4, 2 * 24)).astype(np.float32)
    g, u = gu[:, :24], gu[:, 24:]
    np.testing.assert_allclose(nh.swiglu(gu, 24), g / (1 + np.exp(-g)) * u, rtol=1e-6, atol=1e-7)


def test_half_kernel_matches_numpy(rng):
    """``ls_gemm_h16``: float16 and bfloat16 matrices times float32 rows equal the float64
    product of the same values to float32 rounding, for rows and lengths that are not
    multiples of the kernel's widths (k = 47: a tail of 15) and any thread count. Reading
    bfloat16 bits as float16 (or the reverse) is off by orders of magnitude."""
    from localspec.native.head import HalfMatrix

    for m, k, nr in [(9, 47, 1), (70, 640, 5), (33, 1920, 2)]:
        x = (rng.standard_normal((nr, k)) * 1e3).astype(np.float32)  # large activations stay float32
        w32 = (rng.standard_normal((m, k)) * 0.05).astype(np.float32)
        for w in (HalfMatrix.from_float32(w32), HalfMatrix((w32.view(np.uint32) >> 16).astype(np.uint16), bf16=True)):
            ref = x.astype(np.float64) @ w.dense().astype(np.float64).T
            for threads in (1, 3):
                np.testing.assert_allclose(w.apply(x, threads), ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())
        np.testing.assert_allclose(HalfMatrix.from_float32(w32).dense(), w32, rtol=1e-3, atol=1e-7)
    with pytest.raises(ValueError, match="x has shape"):
        HalfMatrix.from_float32(w32).apply(np.zeros((1, k + 1), np.float32))
    # small weights (a trained fc divides by feature scales up to ~1e5) keep their precision:
    # the matrix is scaled by a power of two before rounding, so they are not float16 subnormals
    tiny = (rng.standard_normal((16, 64)) * 1e-6).astype(np.float32)
    tiny[0, 0] = 0.3
    np.testing.assert_allclose(HalfMatrix.from_float32(tiny).dense(), tiny, rtol=1e-3, atol=0)


def test_products_without_avx512_match_numpy():
    """The AVX2 paths (``LS_HEAD_NO_AVX512=1``: ``ls_gemm_q8`` without VNNI, ``ls_gemm_h16``
    with F16C, ``ls_head_attn``) give the same products, in a fresh process (the kernels pick
    their path once); the packed Q8_0 product (four rows at once) the same bits as the
    row-by-row one, alone or batched
    (``test_q8_products_are_the_same_bits_packed_alone_or_batched``)."""
    import subprocess
    import sys

    code = """
import numpy as np
from localspec.native.head import HalfMatrix, Q8Matrix
rng = np.random.default_rng(3)
for m, k, nr in [(9, 47, 1), (70, 640, 5)]:
    x = (rng.standard_normal((nr, k)) * 1e3).astype(np.float32)
    w32 = (rng.standard_normal((m, k)) * 0.05).astype(np.float32)
    for w in (HalfMatrix.from_float32(w32), HalfMatrix((w32.view(np.uint32) >> 16).astype(np.uint16), bf16=True)):
        ref = x.astype(np.float64) @ w.dense().astype(np.float64).T
        np.testing.assert_allclose(w.apply(x, 2), ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())
    if k % 32 == 0:
        q = Q8Matrix(rng.integers(-127, 128, (m, k)).astype(np.int8), rng.uniform(1e-4, 1e-2, (m, k // 32)).astype(np.float32))
        np.testing.assert_allclose(q.apply(x, 2), x @ q.dense().T, atol=0.02 * np.abs(x @ q.dense().T).max())
import sys
sys.path.insert(0, TESTS)
from localspec.native.head import attention
from test_eagle3_host import _check_attention, test_q8_products_are_the_same_bits_packed_alone_or_batched
_check_attention(rng, attention)
test_q8_products_are_the_same_bits_packed_alone_or_batched(rng)
print("ok")
"""
    env = {**os.environ, "LS_HEAD_NO_AVX512": "1"}
    code = code.replace("TESTS", repr(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_float32_matrices_run_in_float16_only_where_they_fit():
    """The host runtime keeps a float32 matrix (the shipped heads' ``fc``) in float16, half the
    bytes, unless a value is beyond float16's range: then it stays float32."""
    from localspec.drafters.eagle3_host import _Dense, _from_float32
    from localspec.native.head import HalfMatrix

    w = np.array([[0.5, -2.0], [1e-3, 300.0]], np.float32)
    assert isinstance(_from_float32(w), HalfMatrix)
    big = w.copy()
    big[0, 0] = 7e4
    kept = _from_float32(big)
    assert isinstance(kept, _Dense)
    np.testing.assert_array_equal(kept.apply(np.eye(2, dtype=np.float32)), big.T)


def test_a_bad_level_raises_and_changes_nothing(model):
    """A level whose keys point outside its context and entries is refused by ``ls_head_level``
    (ValueError) before the request's keys and values change; the next good level works."""
    from localspec.drafters.eagle3_host import HostPart, run_level
    from localspec.models.eagle3_heads import shipped_head

    e, ref, host = _pair(model, shipped_head(model.path))
    try:
        w = host.hub.weights
        g = np.zeros((1, w.n_embd), np.float32)
        ctx = np.zeros((2, w.n_kv), np.float32)
        seen = []
        good = HostPart([int(ref.d2t[5])], [2], g, ctx, ctx, [0], [(range(2), range(1))], lambda *a: seen.append(a) or a[0])
        bad = HostPart([int(ref.d2t[5])], [2], g, ctx, ctx, [0], [(range(5), range(1))], lambda *a: seen.append(a))
        with pytest.raises(ValueError):
            run_level(w, [bad])
        assert not seen
        rows = run_level(w, [good])[0]
        assert rows.shape == (1, ref.d2t.size) and np.isfinite(rows).all()
    finally:
        host.close()
        e.close()


def test_bench_drafters_reports_both_runtimes_in_one_run(model):
    """``localspec bench drafters``: per shape one result per head runtime, each with the
    drafted steps it saw (through ``DraftHub.extend_many``, what the engine calls), a time
    and a fraction of the plain decode per level, and one host call per level."""
    from localspec.bench.drafters import bench_drafters
    from localspec.models.eagle3_heads import shipped_head

    out = bench_drafters(model, shipped_head(model.path), shapes=[TreeShape(2, 1, 3, 0.0)], prompts=[PROSE],
                         max_tokens=8, rounds=1, n_threads=1)  # fmt: skip
    assert [r.runtime for r in out] == ["host", "llama"]
    for r in out:
        assert r.drafted_steps > 0 and [lv.level for lv in r.levels] == [0, 1]
        assert all(lv.t_median_us > 0 and lv.fraction_of_decode > 0 for lv in r.levels)
        assert r.head_calls_outside_drafting == 0
    assert [lv.calls_per_step for lv in out[0].levels] == [1.0, 1.0]


def test_bench_drafters_takes_its_prompts_from_a_dataset(model, tmp_path, monkeypatch, capsys):
    """``localspec bench drafters --dataset FILE`` measures the levels on the dataset's
    questions (``--per-category`` of each category), as text, or as the token ids of one user
    turn with ``--chat-format``; without ``--dataset`` on the built-in prompts."""
    import json

    import localspec.bench.drafters as bd
    from localspec.cli.main import main

    seen = []
    monkeypatch.setattr(bd, "bench_drafters", lambda model, head, **kw: seen.append(kw["prompts"]) or [])
    qs = tmp_path / "q.jsonl"
    qs.write_text("".join(json.dumps({"category": c, "turns": [t]}) + "\n" for c, t in
                          [("qa", "Name a river."), ("qa", "Name a lake."), ("math", "What is 2 + 2?")]))  # fmt: skip
    for argv in ([], ["--dataset", str(qs), "--per-category", "1"], ["--dataset", str(qs), "--per-category", "1", "--chat-format"]):
        assert main(["bench", "drafters", "-m", str(model.path), *argv]) == 0
    capsys.readouterr()
    assert seen[0] is None  # bench_drafters' default: the built-in prompts
    assert sorted(seen[1]) == ["Name a river.", "What is 2 + 2?"]
    assert all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in seen[2]) and len(seen[2]) == 2
    chat = sorted(model.detokenize(p) for p in seen[2])
    assert chat != sorted(seen[1]) and [q in c for q, c in zip(sorted(seen[1]), chat)] == [True, True]  # wrapped as a user turn



# -- a draft vocabulary cut to its frequent tokens -------------------------------------------


def _host_levels_beside(model, head, other, shape):
    """Grow a tree of ``shape`` with ``head`` on the host runtime and feed ``other`` (another
    head GGUF on the host runtime, attached to the same target context) the same levels:
    ``(prompt, [(nodes, head_rows, other_rows), ...])``, one entry per level."""
    from localspec.drafters.eagle3 import Eagle3Drafter

    whole = Eagle3Drafter(head, runtime="host")
    e = Engine(model, drafter=whole, n_ctx=1024, cost_model=frozen_cost_model())
    part = Eagle3Drafter(other, runtime="host")
    part.attach(TargetHandle(model, n_ctx=e.ctx.n_ctx, n_threads=e.ctx.n_threads, tensor_source=e.ctx, features=e._tap))
    try:
        prompt = e.tokenize(PROSE * 2)[:40]
        _start(e, (whole, part), prompt)
        tee = _Tee(whole, part)
        _grow(whole, prompt, shape, tee)
        _done(whole, part)
        return prompt, tee.levels
    finally:
        part.close()
        e.close()


def test_a_cut_draft_vocabulary_keeps_the_kept_rows(model, tmp_path):
    """``prune_draft_vocab``: the cut head keeps the ``size`` draft tokens that the counts rank
    highest (and the eos token, whatever its count), its ``output.weight`` rows are the whole
    head's Q8_0 rows byte for byte, and on the host runtime its rows at every level of a tree
    3 wide are the whole head's kept columns, bit for bit; llama.cpp's graph loads it and
    gives the same rows to ``ROW_TOL``. Checked by mutation: cutting ``d2t`` but not the
    readout's rows, or the rows in another order, fails here."""
    from localspec.models.eagle3_gguf import prune_draft_vocab, read_eagle3_gguf
    from localspec.models.eagle3_heads import shipped_head
    from localspec.models.gguf_index import GGUFIndex

    head = shipped_head(model.path)
    _, w = read_eagle3_gguf(head)
    rng = np.random.default_rng(7)
    counts = np.zeros(model.n_vocab)
    counts[w.d2t] = rng.random(w.d2t.size)
    counts[1] = 0.0  # eos: kept anyway
    size = 1000
    cut = prune_draft_vocab(head, tmp_path / "cut.gguf", model.path, counts, size)
    _, wc = read_eagle3_gguf(cut)
    keep = np.searchsorted(w.d2t, wc.d2t)
    assert wc.d2t.size == size and np.array_equal(w.d2t[keep], wc.d2t) and 1 in wc.d2t
    top = set(np.argsort(-counts[w.d2t], kind="stable")[: size - 1].tolist())
    assert set(keep.tolist()) == top | {int(np.searchsorted(w.d2t, 1))}

    # Q8_0 rows as stored: [rows, bytes] uint8
    assert np.array_equal(GGUFIndex(cut).data("output.weight"), GGUFIndex(head).data("output.weight")[keep])

    prompt, levels = _host_levels_beside(model, head, cut, TreeShape(4, 3, 12, 0.0))
    assert len(levels) == 4
    for nodes, a, b in levels:
        assert b.shape == (len(nodes), size)
        assert np.array_equal(b, a[:, keep])
    e, ref, host = _pair(model, cut)
    try:
        _start(e, (ref, host), prompt)
        tee = _Tee(ref, host)
        _grow(ref, prompt, TreeShape(2, 3, 6, 0.0), tee)
        _done(ref, host)
        for nodes, a, b in tee.levels:
            err = np.abs(a - b).max(axis=1) / np.abs(a).max(axis=1)
            assert a.shape == b.shape == (len(nodes), size) and err.max() < ROW_TOL
    finally:
        host.close()
        e.close()


def test_an_extended_draft_vocabulary_keeps_the_old_rows_and_reads_the_new_from_the_target(model, tmp_path):
    """``extend_draft_vocab``: the extended head's draft vocabulary is the old one plus the
    ``n_new`` tokens outside it that the counts rank highest (sorted), its old tokens' Q8_0
    ``output.weight`` rows are the old head's byte for byte, a new token's row is the target's
    lm_head row through ``readout_map`` (to Q8_0's rounding), a map that predicts the trained
    rows it was not fitted on far better than the target's rows as they are, and on the host
    runtime its rows at every level of a tree are the old head's at the old tokens' columns,
    bit for bit. Checked by mutation: appending the new rows without sorting them with
    ``d2t`` fails here, and so do the target's rows unmapped."""
    from localspec.models.eagle3_gguf import extend_draft_vocab, read_eagle3_gguf, readout_map
    from localspec.models.eagle3_heads import shipped_head
    from localspec.models.gguf_index import GGUFIndex
    from localspec.models.training.eagle3_train import read_target

    head = shipped_head(model.path)
    _, w = read_eagle3_gguf(head)
    rng = np.random.default_rng(3)
    counts = np.zeros(model.n_vocab)
    outside = np.setdiff1d(np.arange(model.n_vocab), w.d2t)
    counted = rng.choice(outside, 300, replace=False)
    counts[counted] = rng.random(counted.size) + 0.5
    counts[w.d2t] = 10.0  # already in: never added again
    n_new = 200
    ext = extend_draft_vocab(head, tmp_path / "ext.gguf", model.path, counts, n_new)
    _, we = read_eagle3_gguf(ext)
    added = np.sort(counted[np.argsort(-counts[counted], kind="stable")[:n_new]])
    assert np.array_equal(we.d2t, np.union1d(w.d2t, added))
    old = np.searchsorted(we.d2t, w.d2t)
    new = np.searchsorted(we.d2t, added)
    assert np.array_equal(GGUFIndex(ext).data("output.weight")[old], GGUFIndex(head).data("output.weight"))
    tt = read_target(model.path)
    target_rows = tt.lm_head_rows(w.d2t)
    ref = tt.lm_head_rows(added) @ readout_map(w.output, target_rows)
    assert np.abs(we.output[new] - ref).max() <= np.abs(ref).max() / 100

    def cosine(a, b):
        return float(np.mean(np.sum(a * b, 1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)))

    fit, rest = np.arange(w.d2t.size) % 8 != 0, np.arange(w.d2t.size) % 8 == 0
    mapped = target_rows[rest] @ readout_map(w.output[fit], target_rows[fit])
    assert cosine(mapped, w.output[rest]) > 0.85 > 0.65 > cosine(target_rows[rest], w.output[rest])

    _, levels = _host_levels_beside(model, head, ext, TreeShape(3, 2, 6, 0.0))
    assert len(levels) == 3
    for nodes, a, b in levels:
        assert b.shape == (len(nodes), we.d2t.size)
        assert np.array_equal(b[:, old], a)
    with pytest.raises(ValueError, match="at least 1"):
        extend_draft_vocab(head, tmp_path / "x.gguf", model.path, counts, 0)
    counts[counted] = 0.0
    with pytest.raises(ValueError, match="no token to add"):
        extend_draft_vocab(head, tmp_path / "x.gguf", model.path, counts, 5)
    with pytest.raises(ValueError, match="one entry per target token"):
        extend_draft_vocab(head, tmp_path / "x.gguf", model.path, counts[:10], 5)
    assert not (tmp_path / "x.gguf").exists()


def test_draft_vocabularies_keep_llama_cpps_end_of_generation_ids(model):
    """The end-of-generation ids that every draft vocabulary keeps (``frequent_draft_vocab``,
    the trainers' ``read_target``, ``prune_draft_vocab``) are llama.cpp's
    (``GGUFIndex.eog_ids``), among them Gemma's ``<end_of_turn>``, which ends every chat
    answer and which the file's eos/eot keys do not name. Reading only those keys (the rule
    before) fails here."""
    from localspec.models.eagle3_gguf import frequent_draft_vocab
    from localspec.models.gguf_index import GGUFIndex
    from localspec.models.training.eagle3_train import read_target

    (end_of_turn,) = model.tokenize("<end_of_turn>", add_special=False, parse_special=True)
    eog = GGUFIndex(model.path).eog_ids()
    assert eog == sorted(model.eog_ids) and end_of_turn in eog and len(eog) >= 2
    assert read_target(model.path).eog == eog
    assert set(eog) <= set(frequent_draft_vocab(model.path, 64).tolist())


def test_cutting_a_draft_vocabulary_refuses_bad_arguments(model, tmp_path):
    from localspec.models.eagle3_gguf import prune_draft_vocab, read_eagle3_gguf
    from localspec.models.eagle3_heads import shipped_head

    head = shipped_head(model.path)
    counts = np.ones(model.n_vocab)
    n = read_eagle3_gguf(head)[1].d2t.size
    for size in (0, n + 1):
        with pytest.raises(ValueError, match=f"can be cut to 1..{n} tokens"):
            prune_draft_vocab(head, tmp_path / "x.gguf", model.path, counts, size)
    with pytest.raises(ValueError, match="one entry per target token"):
        prune_draft_vocab(head, tmp_path / "x.gguf", model.path, counts[:10], 100)
    assert not (tmp_path / "x.gguf").exists()
