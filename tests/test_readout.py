"""The lm_head readout (``backend.readout``): logits computed from the final-norm rows with
ggml's own dot products must be llama.cpp's logits bit for bit, for every batch shape the
engine decodes, and the decodes it stops at ``result_norm`` must leave the KV cache as whole
decodes do; drafter taps chained behind it see the same rows; a readout that would compute
other numbers is refused by its check."""

import json
import os
import platform

import numpy as np
import pytest

from localspec import Engine, SamplingParams
from localspec.backend import Batch, Context
from localspec.backend import readout as ro
from localspec.backend.features import FeatureTap, FinalNormTap

TEXT = "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable type. "


def _pair(model, **kw):
    a = Context(model, readout=True, **kw)
    b = Context(model, readout=False, **kw)
    return a, b


def test_readout_is_on_for_the_default_model_on_the_cpu(model):
    c = Context(model, n_ctx=256, readout=True)
    try:
        assert c.readout is not None, c.readout_off_reason
        assert c.readout.weights.n_vocab == model.n_vocab
    finally:
        c.close()
    off = Context(model, n_ctx=256)
    assert off.readout is None and off.readout_off_reason == "not asked"
    off.close()


@pytest.mark.parametrize("kernel", [0, 1, 2])
def test_logits_equal_llamas_bit_for_bit_for_every_batch_shape(model, kernel):
    """Prefill (last row), single tokens, chains, a token tree in several sequences, a batch
    split into micro-batches, and one over ``max_rows`` (llama.cpp's lm_head): every row equal
    to the context that never uses the readout, decode after decode (the stopped decodes left
    the cache as the whole ones did); for ggml's vec_dot (kernel 0) and the written-out Q8_0
    kernels (1: AVX2, 2: AVX-512 VNNI), which the check picks where they run."""
    from localspec import native

    if not native.lib.ls_lm_head_kernel_available(kernel):
        pytest.skip(f"kernel {kernel} does not run on this CPU ({'AVX2/FMA/F16C' if kernel == 1 else 'AVX-512 F/BW/DQ/VL/VNNI'})")
    kw = dict(n_ctx=1024, n_batch=64, n_ubatch=4, n_seq_max=4)
    a, b = _pair(model, **kw)
    try:
        assert a.readout is not None, a.readout_off_reason
        written = [k for k in (1, 2) if native.lib.ls_lm_head_kernel_available(k)]
        if written:  # the default model's lm_head is Q8_0: the check chose a written-out kernel
            assert a.readout.kernel in written, a.readout.kernel
        a.readout.kernel = kernel
        a.readout.max_rows = 8
        toks = model.tokenize(TEXT * 3)[:60]
        batch = Batch(64, 4)

        def both(fill):
            out = []
            for c in (a, b):
                fill()
                c.decode(batch)
                out.append(c.logits().copy())
            np.testing.assert_array_equal(out[0], out[1])
            return out[0]

        both(lambda: batch.set_sequence(toks[:40], 0, output="last"))
        pos = 40
        used0 = a.readout.n_used
        for n in (1, 2, 3, 8, 12):
            t = toks[pos : pos + n]
            both(lambda: batch.set_sequence(t, pos, output="all"))
            for c in (a, b):
                c.seq_rm(0, pos + 1, -1)  # keep one token: the next decode reads the stopped one's KV
            pos += 1
        # a tree: root at pos, two branches in sequences 1 and 2 (sharing the root)
        tree_tok = np.array(toks[pos : pos + 5], dtype=np.int32)
        tree_pos = np.array([pos, pos + 1, pos + 2, pos + 1, pos + 2], dtype=np.int32)
        seqs = np.array([[0, 1, 2], [1, 0, 0], [1, 0, 0], [2, 0, 0], [2, 0, 0]], dtype=np.int32)
        n_seq = np.array([3, 1, 1, 1, 1], dtype=np.int32)
        for c in (a, b):
            c.seq_cp(0, 1, 0, pos)
            c.seq_cp(0, 2, 0, pos)
        both(lambda: batch.set_tree(tree_tok, tree_pos, seqs, n_seq))
        # the readout computed every decode of at most max_rows outputs (12 used llama.cpp's)
        assert a.readout.n_used - used0 == 5, a.readout.n_used
    finally:
        a.close()
        b.close()


def test_written_out_kernels_equal_ggmls_vec_dot_for_every_row_count(model):
    """Kernels 1 (AVX2) and 2 (AVX-512 VNNI, two rows per register, 16 rows per pass) give
    ggml's vec_dot's logits (kernel 0) bit for bit for every row count from 1 to 18 and 35
    (odd counts leave half a register empty; more than 16 rows take a second pass), on rows
    of every scale, including ones that quantize to +-127 and to zero."""
    from localspec import native

    kernels = [k for k in (1, 2) if native.lib.ls_lm_head_kernel_available(k)]
    if not kernels:
        pytest.skip("no written-out kernel runs on this CPU")
    c = Context(model, n_ctx=256, n_batch=64, readout=True)
    try:
        r = c.readout
        assert r is not None, c.readout_off_reason
        rng = np.random.default_rng(7)
        for n in list(range(1, 19)) + [35]:
            h = rng.standard_normal((n, model.n_embd)).astype(np.float32) * rng.choice([1e-3, 1.0, 50.0], (n, 1)).astype(np.float32)
            h[0, :32] = 0.0  # an all-zero block
            h[-1, 32:64] = np.where(np.arange(32) % 2, 1.0, -1.0)  # a block of +-127 after quantizing
            r.kernel = 0
            ref = r._compute(h, 2).copy()
            for k in kernels:
                r.kernel = k
                np.testing.assert_array_equal(r._compute(h, 2), ref, err_msg=f"kernel {k}, {n} rows")
    finally:
        c.close()


@pytest.mark.parametrize("kernel", [0, 1, 2])
def test_decodes_of_more_rows_than_checked_equal_llamas(model, kernel):
    """A decode of more output rows than the check decoded (40 > ``CHECK_ROWS``; kernel 2's
    own limit is 64) computed by the readout gives llama.cpp's logits bit for bit."""
    from localspec import native

    if not native.lib.ls_lm_head_kernel_available(kernel):
        pytest.skip(f"kernel {kernel} does not run on this CPU")
    a, b = _pair(model, n_ctx=256, n_batch=64)
    try:
        assert a.readout is not None, a.readout_off_reason
        a.readout.kernel, a.readout.max_rows = kernel, 64
        toks = model.tokenize(TEXT * 4)[:48]
        batch = Batch(64)
        out = []
        for c in (a, b):
            batch.set_sequence(toks[:8], 0, output="last")
            c.decode(batch)
            batch.set_sequence(toks[8:48], 8, output="all")
            c.decode(batch)
            out.append(c.logits().copy())
        np.testing.assert_array_equal(out[0], out[1])
        assert a.readout.n_used == 2  # both decodes were the readout's
    finally:
        a.close()
        b.close()


def test_kernels_equal_ggmls_vec_dot_on_a_synthetic_lm_head():
    """``ls_lm_head`` on a made-up Q8_0 matrix whose row count is not a multiple of the
    64-row block, with weight bytes of -128 and 127, scales of every size, 1 and 2 threads,
    and 1-18, 33, 35, 63 and 64 rows: kernels 1 and 2 give kernel 0's (ggml's vec_dot)
    logits bit for bit."""
    from localspec import native
    from localspec.native._lib import ERR_ARG

    kernels = [k for k in (1, 2) if native.lib.ls_lm_head_kernel_available(k)]
    if not kernels:
        pytest.skip("no written-out kernel runs on this CPU")
    g = ro._ggml()
    tt = g.ggml_get_type_traits_cpu(ro.GGML_TYPE_Q8_0).contents
    qt = g.ggml_get_type_traits_cpu(int(tt.vec_dot_type)).contents
    n_vocab, n_embd = 100, 96
    nb = n_embd // 32
    rng = np.random.default_rng(3)
    blocks = np.zeros((n_vocab, nb), dtype=[("d", "<f2"), ("qs", "i1", 32)])
    blocks["d"] = (rng.uniform(0.5, 2.0, (n_vocab, nb)) * 10.0 ** rng.integers(-4, 2, (n_vocab, nb))).astype(np.float16)
    blocks["qs"] = rng.integers(-128, 128, (n_vocab, nb, 32))
    blocks["qs"][0] = -128
    blocks["qs"][1] = 127
    w = np.ascontiguousarray(blocks).view(np.uint8)
    assert w.nbytes == n_vocab * nb * 34
    row = int(g.ggml_row_size(ro.GGML_TYPE_Q8_0, n_embd))
    qrow = int(g.ggml_row_size(int(tt.vec_dot_type), n_embd))
    for nr in list(range(1, 19)) + [33, 35, 63, 64]:
        h = (rng.standard_normal((nr, n_embd)) * rng.choice([1e-3, 1.0, 40.0], (nr, 1))).astype(np.float32)
        for threads in (1, 2):
            outs = {}
            for k in [0] + kernels:
                out = np.full((nr, n_vocab), np.nan, dtype=np.float32)
                rc = native.lib.ls_lm_head(w.ctypes.data, n_vocab, row, n_embd, h.ctypes.data, nr, qt.from_float, qrow,
                                           tt.vec_dot, out.ctypes.data, threads, k)  # fmt: skip
                assert rc == 0, (k, rc)
                outs[k] = out
            assert np.isfinite(outs[0]).all()
            for k in kernels:
                np.testing.assert_array_equal(outs[k], outs[0], err_msg=f"kernel {k}, {nr} rows, {threads} threads")
    # an unknown kernel, or one this CPU cannot run, is refused
    out = np.zeros((1, n_vocab), dtype=np.float32)
    h = np.zeros((1, n_embd), dtype=np.float32)
    for k in [3] + [k for k in (1, 2) if k not in kernels]:
        assert native.lib.ls_lm_head(w.ctypes.data, n_vocab, row, n_embd, h.ctypes.data, 1, qt.from_float, qrow,
                                     tt.vec_dot, out.ctypes.data, 1, k) == ERR_ARG  # fmt: skip


def test_drafter_taps_behind_the_readout_see_the_same_rows(model):
    """A FeatureTap (EAGLE-3) and a FinalNormTap (Medusa) chained behind the readout capture
    the rows they capture alone."""
    toks = model.tokenize(TEXT * 2)[:30]
    for make in (lambda: FeatureTap([2, 9], model.n_layer, model.n_embd), lambda: FinalNormTap(model.n_embd)):
        rows, logits = [], []
        for readout in (True, False):
            tap = make()
            c = Context(model, n_ctx=256, n_batch=64, cb_eval=tap.callback, cb_eval_user_data=tap.user_data, readout=readout)
            try:
                assert (c.readout is not None) == readout, c.readout_off_reason
                tap.clear()
                b = Batch(64)
                b.set_sequence(toks[:24], 0, output="last")
                c.decode(b)
                b.set_sequence(toks[24:28], 24, output="all")
                c.decode(b)
                rows.append(tap.take())
                logits.append(c.logits().copy())
            finally:
                c.close()
        assert rows[0].shape[0] > 0
        np.testing.assert_array_equal(rows[0], rows[1])
        np.testing.assert_array_equal(logits[0], logits[1])


def _six_token_logits(model, contexts) -> list[np.ndarray]:
    """Each context's logits ``[6, n_vocab]`` for the same six tokens of ``TEXT`` (from an
    empty cache, every row an output)."""
    b = Batch(8)
    toks = model.tokenize(TEXT)[:6]
    out = []
    for x in contexts:
        b.set_sequence(toks, 0, output="all")
        x.decode(b)
        out.append(x.logits().copy())
    return out


def _quantize_for_another_dot_product(model, monkeypatch) -> None:
    """Mutation: the readout's weight quantizes the rows for ggml's F16 dot product instead of
    the weight's Q8_0 partner (other numbers from the same rows)."""
    real = ro.LmHeadWeights.from_graph

    def wrong(*args):
        w = real(*args)
        if not isinstance(w, str):
            g = ro._ggml()
            w.vec_dot = g.ggml_get_type_traits_cpu(1).contents.vec_dot  # F16 x F16
            w.from_float = g.ggml_get_type_traits_cpu(1).contents.from_float
            w.q_row_bytes = int(g.ggml_row_size(1, model.n_embd))
        return w

    monkeypatch.setattr(ro.LmHeadWeights, "from_graph", staticmethod(wrong))


def test_a_readout_with_other_numbers_fails_its_check(model, monkeypatch):
    """Mutation: the readout quantizes the rows for another dot product (F16 instead of the
    weight's Q8_0 partner). The check must see different logits and keep llama.cpp's lm_head,
    whose logits then equal a plain context's."""
    _quantize_for_another_dot_product(model, monkeypatch)
    monkeypatch.setattr(model, "_readout_verdict", None, raising=False)  # check again; restored after
    monkeypatch.setattr(ro, "verdict_key", lambda ctx: None)  # and take no earlier process's verdict
    c = Context(model, n_ctx=256, readout=True)
    ref = Context(model, n_ctx=256)
    try:
        assert c.readout is None
        assert "differ" in c.readout_off_reason
        out = _six_token_logits(model, (c, ref))
        np.testing.assert_array_equal(out[0], out[1])
    finally:
        c.close()
        ref.close()


def _count_checks(monkeypatch) -> list[int]:
    """The ``n_batch`` of every context whose readout runs the whole check, in order."""
    calls = []
    real = ro.Readout.self_check

    def counted(self, ctx):
        calls.append(int(ctx.n_batch))
        return real(self, ctx)

    monkeypatch.setattr(ro.Readout, "self_check", counted)
    return calls


def test_the_verdict_is_checked_once_per_model(model, monkeypatch):
    """The first context of a model runs the check; a later one takes its verdict, with its
    own row limit, unless its own check would decode more rows than the verdict's (a small
    context first): then it checks, and its verdict replaces the model's."""
    monkeypatch.setattr(model, "_readout_verdict", None, raising=False)
    monkeypatch.setattr(ro, "verdict_key", lambda ctx: None)  # no earlier process's verdict
    calls = _count_checks(monkeypatch)
    for n_batch in (512, 64, 8, 32):
        c = Context(model, n_ctx=1024, n_batch=n_batch, readout=True)
        assert c.readout is not None and c.readout.check_rows == 16  # the model's verdict
        assert c.readout.max_rows == min(ro.DEFAULT_MAX_ROWS[c.readout.kernel], n_batch)
        c.close()
    assert calls == [512]
    # a small context first: a larger one checks again (16 rows), and its verdict replaces the 8-row one
    monkeypatch.setattr(model, "_readout_verdict", None, raising=False)
    calls.clear()
    for n_batch in (8, 512, 64):
        c = Context(model, n_ctx=1024, n_batch=n_batch, readout=True)
        assert c.readout is not None and c.readout.check_rows == min(16, n_batch)
        c.close()
    assert calls == [8, 512] and model._readout_verdict["check_rows"] == 16


def test_a_passed_check_is_kept_for_the_next_process_which_confirms_it(model, monkeypatch, tmp_path):
    """A passed check is written to ``readout.json`` in the cache directory; the next process
    (here: the model's in-process verdict dropped) takes it without the whole check, after
    its short proof (``Readout.confirm``: 2 rows and 1 row against llama.cpp's lm_head), and
    computes llama.cpp's logits bit for bit. Mutations: where the weight's numbers change
    after the verdict was kept (the readout quantizes for another dot product), the proof
    fails, the whole check runs and refuses the readout, and the kept verdict is dropped; a
    context whose check would be of another size takes no stored verdict."""
    monkeypatch.setenv("LOCALSPEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(model, "_readout_verdict", None, raising=False)
    calls = _count_checks(monkeypatch)
    c = Context(model, n_ctx=1024, readout=True)
    kernel = c.readout.kernel
    c.close()
    assert calls == [512]
    stored = json.loads((tmp_path / "readout.json").read_text())
    assert [v["kernel"] for v in stored.values()] == [kernel]
    monkeypatch.setattr(model, "_readout_verdict", None, raising=False)  # the next process
    c, ref = Context(model, n_ctx=1024, readout=True), Context(model, n_ctx=1024)
    try:
        assert calls == [512] and c.readout is not None and c.readout.kernel == kernel
        out = _six_token_logits(model, (c, ref))
        assert c.readout.n_used == 1
        np.testing.assert_array_equal(out[0], out[1])
    finally:
        c.close()
        ref.close()
    monkeypatch.setattr(model, "_readout_verdict", None, raising=False)
    c = Context(model, n_ctx=1024, n_batch=8, readout=True)  # a check of 8 rows: not the verdict kept
    c.close()
    assert calls == [512, 8]
    _quantize_for_another_dot_product(model, monkeypatch)
    monkeypatch.setattr(model, "_readout_verdict", None, raising=False)
    c = Context(model, n_ctx=1024, readout=True)
    try:
        assert calls == [512, 8, 512]  # the proof failed: the whole check ran
        assert c.readout is None and "differ" in c.readout_off_reason
        assert len(json.loads((tmp_path / "readout.json").read_text())) == 1  # the failed one dropped, the 8-row kept
    finally:
        c.close()


def test_a_kernel_can_be_asked_for_where_the_check_proved_it(model, monkeypatch, caplog):
    """``LOCALSPEC_READOUT_KERNEL`` picks a kernel the check proved (0, ggml's vec_dot, is
    then checked too); one it cannot run, or a bad value, is named in a warning and the
    check's own choice is used."""
    from localspec import native

    monkeypatch.setattr(model, "_readout_verdict", None, raising=False)
    monkeypatch.setattr(ro, "verdict_key", lambda ctx: None)  # no earlier process's verdict
    monkeypatch.setenv("LOCALSPEC_READOUT_KERNEL", "0")
    c = Context(model, n_ctx=256, n_batch=64, readout=True)
    try:
        assert c.readout is not None and c.readout.kernel == 0 and 0 in c.readout.passed
    finally:
        c.close()
    if all(native.lib.ls_lm_head_kernel_available(k) for k in (1, 2)):  # a proved kernel other than the choice
        other = 1 if model._readout_verdict["kernel"] == 2 else 2
        monkeypatch.setenv("LOCALSPEC_READOUT_KERNEL", str(other))
        c = Context(model, n_ctx=256, n_batch=512, readout=True)
        try:
            assert c.readout.kernel == other and c.readout.max_rows == ro.DEFAULT_MAX_ROWS[other]
        finally:
            c.close()
    missing = [k for k in (1, 2) if not native.lib.ls_lm_head_kernel_available(k)]
    for raw in ["7"] + [str(k) for k in missing]:
        monkeypatch.setenv("LOCALSPEC_READOUT_KERNEL", raw)
        caplog.clear()
        with caplog.at_level("WARNING", logger="localspec.readout"):
            c = Context(model, n_ctx=256, n_batch=64, readout=True)
        try:
            assert c.readout is not None and c.readout.kernel == model._readout_verdict["kernel"]
            assert "LOCALSPEC_READOUT_KERNEL" in caplog.text
        finally:
            c.close()


def test_unavailable_says_why(model):
    class M:
        vocab_only = False
        on_local_gpu = False
        _load_args = {"rpc": None}

    m = M()
    assert ro.unavailable(m) is None
    assert ro.unavailable(model) is None
    m.on_local_gpu = True
    assert "GPU" in ro.unavailable(m)
    m.on_local_gpu, m._load_args = False, {"rpc": "127.0.0.1:5000"}
    assert "RPC" in ro.unavailable(m)
    # per-sequence KV streams: llama.cpp splits batches out of order and reorders its outputs
    assert "reorder" in ro.unavailable(model, kv_unified=False, n_seq_max=4)
    c = Context(model, n_ctx=256, n_seq_max=2, kv_unified=False, readout=True)
    try:
        assert c.readout is None and "reorder" in c.readout_off_reason
    finally:
        c.close()


@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_engine_output_is_the_same_with_llamas_lm_head(model, monkeypatch, drafter):
    """Greedy generation through the engine (prefill, plain steps, verified trees) gives the
    same tokens with the readout as with llama.cpp's lm_head, and the readout did the work."""
    prompt = "def fibonacci(n):\n    " + "# compute the sequence\n" * 3
    outs = []
    for mode in ("own", "llama"):
        monkeypatch.setenv("LOCALSPEC_READOUT", mode)
        eng = Engine(model, drafter=drafter, n_ctx=1024)
        try:
            assert (eng.ctx.readout is not None) == (mode == "own"), eng.ctx.readout_off_reason
            r = eng.generate(prompt, max_tokens=48, sampling=SamplingParams.greedy())
            outs.append(r.token_ids)
            if mode == "own":
                assert eng.ctx.readout.n_used >= (40 if drafter == "none" else 1)
        finally:
            eng.close()
    assert outs[0] == outs[1]


def test_readout_rows_capture_failure_is_a_clear_error(model):
    """A decode whose final-norm rows did not all arrive has no logits (its lm_head was
    skipped): a DecodeError, the readout off for that context, and the context still usable."""
    from localspec.errors import DecodeError

    c = Context(model, n_ctx=256, n_batch=8, readout=True)
    try:
        rd = c.readout
        assert rd is not None
        b = Batch(8)
        toks = model.tokenize(TEXT)[:6]
        b.set_sequence(toks[:3], 0, output="all")
        orig = rd.finish
        rd.finish = lambda n_out, nt: orig(n_out + 1, nt)  # expects a row more than captured
        with pytest.raises(DecodeError, match="final-norm rows"):
            c.decode(b)
        assert c.readout is None and "final-norm rows" in c.readout_off_reason
        c.seq_rm(0, 0, -1)
        b.set_sequence(toks[:3], 0, output="all")
        c.decode(b)
        assert c.logits().shape == (3, model.n_vocab) and np.isfinite(c.logits()).all()
    finally:
        c.close()


def test_bad_settings_are_named_not_raised(monkeypatch, caplog):
    monkeypatch.setenv("LOCALSPEC_READOUT_MAX_ROWS", "many")
    assert ro._max_rows_from_env() is None  # each kernel's DEFAULT_MAX_ROWS
    assert "LOCALSPEC_READOUT_MAX_ROWS='many'" in caplog.text
    monkeypatch.setenv("LOCALSPEC_READOUT_MAX_ROWS", "4")
    assert ro._max_rows_from_env() == 4
    monkeypatch.setenv("LOCALSPEC_READOUT", "fast")
    assert ro.wanted() is True
    assert "LOCALSPEC_READOUT='fast'" in caplog.text
    monkeypatch.setenv("LOCALSPEC_READOUT", "LLAMA")
    assert ro.wanted() is False


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or not os.path.exists("/proc/cpuinfo"),
                    reason="reads the x86 feature flags that Linux reports")  # fmt: skip
def test_the_written_out_kernels_are_offered_exactly_where_the_cpu_has_their_instructions():
    """``ls_cpu_has`` (one CPUID / XCR0 probe for every kernel) against the flags Linux
    reports for the same CPU (which it lists only where the OS saves their state): kernel 1
    needs AVX2, FMA and F16C; kernel 2 AVX-512 F/BW/DQ/VL/VNNI too (and a compiler that knows
    VNNI: GCC or clang 8 or later, which every supported toolchain is)."""
    from localspec import native

    if not native.enabled():
        pytest.skip("the C kernels are not built")
    flags = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    k1 = {"avx2", "fma", "f16c"} <= flags
    k2 = k1 and {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni"} <= flags
    assert bool(native.lib.ls_lm_head_kernel_available(1)) == k1
    assert bool(native.lib.ls_lm_head_kernel_available(2)) == k2
