"""Real-model tests of the llama.cpp layer: tree batches, rollbacks, cache checks."""

import numpy as np
import pytest

from helpers import NEAR_TIE, PROSE, chain, tree_of
from localspec.backend import Context, Model, SequenceCache, exact_kernels
from localspec.errors import ContextOverflowError, KVCacheError, ModelLoadError


@pytest.fixture(scope="module")
def ctx(model):
    c = Context(model, n_ctx=2048, n_seq_max=17)
    yield c
    c.close()


def long_prompt(model, n):
    toks = model.tokenize(PROSE * 60)
    assert len(toks) >= n
    return toks[:n]


def greedy_continue(cache, ctx, root, n, gaps=None):
    """Plain greedy decoding of n tokens from `root` (root not yet in the cache)."""
    out = []
    for _ in range(n):
        t = chain(root, [])
        lay, logits = cache.decode_tree(t)
        nxt = int(np.argmax(logits[0]))
        if gaps is not None:
            top2 = np.sort(logits[0])[-2:]
            gaps.append(float(top2[1] - top2[0]))
        cache.commit(t, lay, [])
        out.append(nxt)
        root = nxt
    return out


def test_tree_batch_logits_match_paths_decoded_alone(model, ctx):
    cache = SequenceCache(ctx, max_tree_nodes=32)
    cache.reset()
    prompt = model.tokenize("Paris is the capital of France. Berlin is the capital of")
    cache.prefill(prompt[:-1])
    root = prompt[-1]
    paths = [[9405, 236761, 669], [7001, 563], [532, 9405, 236761, 1599, 531]]
    tree = tree_of(*paths, root=root)
    lay, logits = cache.decode_tree(tree)
    tree_logits = logits.copy()
    assert lay.leaf_seq.size == 3
    cache.commit(tree, lay, [])
    cache.truncate(len(prompt) - 1)
    checked = 0
    for path in paths:
        nodes = [0]
        node = 0
        for t in path:
            node = next(c for c in tree.children(node) if tree.token_ids[c] == t)
            nodes.append(node)
        c = chain(root, path)
        lay2, lg = cache.decode_tree(c)
        for i, n in enumerate(nodes):
            a, b = int(np.argmax(lg[i])), int(np.argmax(tree_logits[n]))
            if exact_kernels():  # the exact kernels promise bit-identical rows on the CPU
                assert np.array_equal(lg[i], tree_logits[n]), f"node {n}: tree and chain rows differ"
            elif a != b:  # fast kernels: allowed only at a near-tie
                top2 = np.sort(lg[i])[-2:]
                assert top2[1] - top2[0] < NEAR_TIE
            checked += 1
        assert np.abs(lg - tree_logits[nodes]).max() < 2.0
        cache.commit(c, lay2, [])
        cache.truncate(len(prompt) - 1)
    assert checked == sum(len(p) + 1 for p in paths)


def test_rollback_of_hundreds_of_tokens_after_512_context(model, ctx):
    """Roll back 100 and then 399 tokens from ~1000 of context (beyond Gemma 3's 512-token
    window), the second back into the prompt, and regenerate: the cache positions must be
    exact and the regenerated tokens identical."""
    cache = SequenceCache(ctx, max_tree_nodes=8)
    cache.reset()
    prompt = long_prompt(model, 800)
    cache.prefill(prompt[:-1])
    first = greedy_continue(cache, ctx, prompt[-1], 200)
    assert cache.n_past == 999
    assert (ctx.pos_min(0), ctx.pos_max(0)) == (0, 998)
    cache.truncate(799 + 100)  # drop 100 generated tokens
    assert (ctx.pos_min(0), ctx.pos_max(0)) == (0, 898)
    again = greedy_continue(cache, ctx, first[99], 100)
    assert again == first[100:200]
    cache.truncate(600)  # 399 tokens back, 200 of them into the prompt
    assert (ctx.pos_min(0), ctx.pos_max(0)) == (0, 599)
    again2 = greedy_continue(cache, ctx, prompt[600], 40)
    # against a fresh cache holding the same 600 tokens
    cache.reset()
    cache.prefill(prompt[:600])
    gaps = []
    fresh = greedy_continue(cache, ctx, prompt[600], 40, gaps)
    if exact_kernels():  # prefill batches differ, which the exact kernels make irrelevant
        assert again2 == fresh
    for i, (a, b) in enumerate(zip(again2, fresh)):
        if a != b:  # fast kernels: only a near-tie may flip
            assert gaps[i] < NEAR_TIE
            break


def test_window_sized_cache_is_detected(model):
    """With a window-sized SWA cache, cells beyond the window are gone after a long decode;
    llama.cpp's seq_rm still returns True, but the position check catches it."""
    small = Context(model, n_ctx=2048, n_seq_max=1, swa_full=False)
    try:
        cache = SequenceCache(small, max_tree_nodes=4)
        prompt = long_prompt(model, 1200)
        with pytest.raises(KVCacheError):
            cache.prefill(prompt)
            cache.truncate(900)  # a rollback of 300 tokens
        assert small.seq_rm(0, 900, -1) is True  # the return value proves nothing
    finally:
        small.close()


def test_tree_commit_keeps_only_the_accepted_path(model, ctx):
    cache = SequenceCache(ctx, max_tree_nodes=16)
    cache.reset()
    prompt = model.tokenize("one two three four")
    cache.prefill(prompt[:-1])
    tree = tree_of([10, 11, 12], [20, 21], [10, 13], root=prompt[-1])
    lay, _ = cache.decode_tree(tree)
    path = [1, 2]  # 10 -> 11
    cache.commit(tree, lay, path)
    assert cache.tokens[-3:] == [prompt[-1], 10, 11]
    assert ctx.pos_max(0) == cache.n_past - 1
    for s in lay.leaf_seq:
        assert ctx.pos_max(int(s)) == -1


def test_tree_too_big_for_free_context_is_refused(model):
    c = Context(model, n_ctx=256, n_seq_max=2)
    try:
        cache = SequenceCache(c, max_tree_nodes=64)
        cache.prefill(list(range(1000, 1000 + 250)))
        with pytest.raises(ContextOverflowError):
            cache.decode_tree(chain(5, list(range(10))))
        cache.check()
        with pytest.raises(ContextOverflowError):
            cache.prefill(list(range(10)))
        assert cache.n_past == 250
    finally:
        c.close()


def test_missing_and_corrupt_gguf(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        Model(tmp_path / "nope.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOTGGUF" + b"\0" * 100)
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        Model(bad)
    trunc = tmp_path / "trunc.gguf"
    trunc.write_bytes(b"GGUF" + b"\x03\0\0\0" + b"\xff" * 64)
    with pytest.raises(ModelLoadError, match="could not load"):
        Model(trunc)
    with pytest.raises(ModelLoadError, match="directory"):
        Model(tmp_path)


def test_the_vocabulary_of_a_closed_model_is_an_error_not_a_crash(model_path):
    # after close() the vocabulary pointer dangles: llama_tokenize on it aborted the process
    # (std::out_of_range in llama_vocab::byte_to_token), e.g. Engine.generate("hi") after close()
    m = Model(model_path, vocab_only=True)
    m.close()
    with pytest.raises(ModelLoadError, match="model is closed"):
        m.tokenize("hi")
    with pytest.raises(ModelLoadError, match="model is closed"):
        m.token_bytes(9259)


def test_a_tree_batch_token_in_no_sequence_is_refused():
    # llama.cpp segfaulted on such a batch (a token with n_seq_id 0) instead of failing
    from localspec.backend import Batch

    b = Batch(8, 2)
    tok, pos, seqs = np.arange(4, dtype=np.int32), np.arange(4, dtype=np.int32), np.zeros((4, 2), np.int32)
    for bad in ([1, 1, 0, 1], [1, 3, 1, 1]):
        with pytest.raises(ValueError, match="sequence ids"):
            b.set_tree(tok, pos, seqs, np.array(bad, np.int32))
    b.set_tree(tok, pos, seqs, np.array([1, 2, 1, 1], np.int32))
    assert b.n_tokens == 4


FAST_BATCH = """
from localspec.backend import Batch, Context, Model
m = Model({path!r})
ctx = Context(m, n_ctx=256, n_seq_max=1)
b = Batch(64, 1)
b.set_sequence(m.tokenize("The history of the printing press begins in the fifteenth century.")[:8], 0, output="all")
ctx.decode(b)
print("repack", m.repack)
"""


def test_fast_kernels_never_hand_weights_to_llama_cpps_amx_matmul(model_path):
    # llama.cpp's AMX matmul segfaults on batched decodes (issue 20824; reproduced here on an
    # AMX Xeon with this model): LOCALSPEC_KERNELS=fast repacks weights except on such a CPU,
    # and an explicit repack=True there is a clear error, not a crash
    import os
    import subprocess
    import sys

    from localspec.backend import cpu_amx

    env = {**os.environ, "LOCALSPEC_KERNELS": "fast"}
    env.pop("GGML_CPU_TILED_MM", None)
    r = subprocess.run([sys.executable, "-c", FAST_BATCH.format(path=str(model_path))], env=env,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-1] == str(not cpu_amx())
    if cpu_amx():
        with pytest.raises(ModelLoadError, match="AMX"):
            Model(model_path, repack=True)


def test_calibration_measures_every_size_in_rounds(ctx):
    """``calibrate`` times every size ``reps`` times, round by round over all sizes, and leaves
    the context empty."""
    from localspec.costmodel import calibrate

    seen = []
    cm = calibrate(ctx, sizes=(1, 2, 4), reps=2, use_cache=False, progress=lambda done, total: seen.append((done, total)))
    table = cm.to_json()["table_us"]
    assert sorted(int(k) for k in table) == [1, 2, 4] and all(v > 0 for v in table.values())
    assert seen == [(i, 6) for i in range(1, 7)]
    assert ctx.pos_max(0) == -1
