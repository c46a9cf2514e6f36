"""EAGLE-3 heads on the real Gemma 3 270M: the GGUF writer, target feature capture through
the eval callback, and an untrained head drafting end to end, losslessly."""

import numpy as np
import pytest

from conftest import frozen_cost_model
from helpers import (
    REJECTION_SAMPLING, REJECTION_SHAPES, PlainReferences, assert_rejection_sampling_exact, assert_same_as_plain,
)
from localspec import Engine, SamplingParams, native
from localspec.backend import Batch, Context, Model, SequenceCache
from localspec.backend.features import FeatureTap
from localspec.drafters.draft_model import DraftModelDrafter
from localspec.drafters.eagle3 import Eagle3Drafter, head_target_layers
from localspec.errors import ModelLoadError
from localspec.policy import TreeShape
from localspec.request_state import RequestState
from localspec.tree import TokenSource, TreeBuilder

GREEDY = SamplingParams.greedy()
PROMPT = "The three primary colours are red, yellow and blue. The three primary colours are"


@pytest.fixture(scope="module")
def head(random_head_path):
    m = Model(random_head_path)
    yield m
    m.close()


@pytest.fixture(scope="module")
def eng(model):
    e = Engine(model, drafter="none", n_ctx=2048, cost_model=frozen_cost_model())
    yield e
    e.close()


def test_random_head_gguf_is_an_eagle3_model(head, model):
    assert head.architecture == "eagle3" and head.n_layer == 1 and head.n_embd == model.n_embd
    assert head_target_layers(head) == (2, 9, 15)
    assert head.n_vocab == model.n_vocab  # the head carries the target's tokenizer
    with pytest.raises(ModelLoadError, match="not an EAGLE-3 head"):
        Eagle3Drafter(model)


def test_head_files_that_cannot_draft_are_refused_at_load_in_one_line(model_path, random_head_path, tmp_path):
    """Found by a new user's run (2026-12-06): a head whose ``d2t`` repeats a target id loaded
    and failed mid-generation with a traceback (``SparseDist``), one with negative ids failed
    in the decode with an error blaming the batch, one whose ``eagle3.target_layers`` repeat a
    layer crashed every speculative path ("feature layers captured different row counts"), a
    missing head was "model file not found", and a Medusa heads file given as the head, or a
    head given as the model, got llama.cpp's "truncated or corrupt file" message. Each is now
    one ``ModelLoadError`` at load that says what the file is or what is wrong in it."""
    import shutil

    from gguf import GGUFValueType

    from localspec.models.gguf_edit import copy_gguf
    from localspec.models.gguf_index import GGUFIndex

    def with_d2t(name, edit):
        dst = tmp_path / name
        shutil.copy(random_head_path, dst)
        t = GGUFIndex(dst).tensors["d2t"]
        d2t = np.memmap(dst, dtype="<i8", mode="r+", offset=t.offset, shape=(t.shape[0],))
        edit(d2t)
        d2t.flush()
        del d2t
        return dst

    def refused(path, match):
        with pytest.raises(ModelLoadError, match=match) as e:
            Eagle3Drafter(path).close()
        assert "\n" not in str(e.value)

    refused(with_d2t("dup.gguf", lambda d: d.__setitem__(1, d[0])), r"\(d2t\) holds 1 target ids twice")
    refused(with_d2t("neg.gguf", lambda d: d.__setitem__(5, -5)), r"\(d2t\) holds negative target ids \(-5\)")
    layers = copy_gguf(random_head_path, tmp_path / "layers.gguf",
                       set_kv={"eagle3.target_layers": ([2, 9, 9], GGUFValueType.ARRAY, GGUFValueType.INT32)})  # fmt: skip
    refused(layers, r"reads target layers \[2, 9, 9\]: a layer twice")
    medusa = copy_gguf(random_head_path, tmp_path / "medusa.gguf", set_kv={"general.architecture": "medusa"})
    refused(medusa, r"is a Medusa heads file, not an EAGLE-3 head: use it with --drafter medusa --medusa .* \(Python: drafter='medusa', medusa=\.\.\.\)$")
    refused(model_path, r"is a gemma3 model, not an EAGLE-3 head .*--drafter draft --draft-model .* \(Python: drafter='draft', draft_model=\.\.\.\)$")
    refused(tmp_path / "nope.gguf", "EAGLE-3 head file not found")
    with pytest.raises(ModelLoadError, match="is an EAGLE-3 head, not a model to generate with: .*--eagle"):
        Engine(random_head_path, drafter="none", n_ctx=256, cost_model=frozen_cost_model())
    with pytest.raises(ModelLoadError, match="is a Medusa heads file, not a model to generate with"):
        Engine(medusa, drafter="none", n_ctx=256, cost_model=frozen_cost_model())
    # given as a draft model: the same line, before llama.cpp's "eagle3 requires ctx_other"
    with pytest.raises(ModelLoadError, match="is an EAGLE-3 head, not a draft model: .*--drafter eagle3 --eagle"):
        DraftModelDrafter(random_head_path)
    with pytest.raises(ModelLoadError, match="is a Medusa heads file, not a draft model: .*--drafter medusa --medusa"):
        DraftModelDrafter(medusa)


def test_the_default_feature_layers_are_three_distinct_readable_layers(model_path, tmp_path):
    """``default_target_layers``: the usual ``(2, n // 2, n - 3)`` where those are distinct
    (the default model's 18 layers: ``(2, 9, 15)``), else the first, middle and last readable
    layer (a 6-layer target got ``(2, 3, 3)``, whose head crashed every speculative path); a
    target of fewer than 4 layers has no three, and the writer refuses repeated layers."""
    from localspec.models.eagle3_gguf import default_target_layers, random_eagle3, read_eagle3_gguf, write_eagle3_gguf

    assert default_target_layers(18) == (2, 9, 15) and default_target_layers(8) == (2, 4, 5)
    assert default_target_layers(6) == (1, 3, 5) and default_target_layers(4) == (1, 2, 3)
    for n in range(4, 64):
        ks = default_target_layers(n)
        assert len(set(ks)) == 3 and all(1 <= k < n for k in ks), (n, ks)
    with pytest.raises(ValueError, match="needs 4 or more"):
        default_target_layers(3)
    head = random_eagle3(model_path, tmp_path / "h.gguf", draft_vocab=256)
    cfg, w = read_eagle3_gguf(head)
    from dataclasses import replace

    with pytest.raises(ValueError, match="three distinct layers"):
        write_eagle3_gguf(tmp_path / "bad.gguf", model_path, replace(cfg, target_layers=(2, 9, 9)), w)


def test_feature_rows_equal_an_independent_computation(model, derived_draft):
    """The input of layer 12 captured from the full model equals the final hidden state of the
    model truncated to 12 layers (computed by llama.cpp on its own, with embeddings=true,
    where it comes out through the final RMSNorm: compare after the same norm)."""
    from localspec.backend.model import gguf_tensor

    prompt = model.tokenize(PROMPT)
    tap = FeatureTap([12], n_layer=model.n_layer, n_embd=model.n_embd)
    ctx = Context(model, n_ctx=256, cb_eval=tap.callback, cb_eval_user_data=tap.user_data)
    ref = Context(derived_draft, n_ctx=256, embeddings=True)
    try:
        b = Batch(len(prompt))
        b.set_sequence(prompt, 0, output="last")
        ctx.decode(b)
        rows = tap.take()  # [n, 640]: every token, not only the output one
        assert rows.shape == (len(prompt), model.n_embd)
        b.set_sequence(prompt, 0, output="all")
        ref.decode(b)
        w = gguf_tensor(derived_draft.path, "output_norm.weight").astype(np.float64)
        eps = 1e-6
        x = rows.astype(np.float64)
        normed = x / np.sqrt((x * x).mean(axis=1, keepdims=True) + eps) * w
        got = np.stack([ref.embeddings_ith(i, model.n_embd) for i in range(len(prompt))])
        assert np.allclose(normed, got, rtol=1e-3, atol=1e-3 * np.abs(got).max())
    finally:
        ctx.close()
        ref.close()


def test_the_tap_only_reads(model):
    """Logits of a tree decode are bit-identical with and without the feature tap."""
    prompt = model.tokenize(PROMPT)
    out = []
    for with_tap in (False, True):
        tap = FeatureTap([2, 9, 15], model.n_layer, model.n_embd) if with_tap else None
        ctx = Context(model, n_ctx=256, n_seq_max=4, cb_eval=tap.callback if tap else None,
                      cb_eval_user_data=tap.user_data if tap else None)
        cache = SequenceCache(ctx, max_tree_nodes=8)
        try:
            cache.prefill(prompt[:-1])
            b = TreeBuilder(prompt[-1])
            a = b.add(0, 9405, source=TokenSource.NGRAM)
            b.add(a, 236761, source=TokenSource.NGRAM)
            b.add(0, 532, source=TokenSource.NGRAM)
            _, lg = cache.decode_tree(b.build())
            out.append(lg.copy())
            if tap:
                assert tap.take().shape[0] == len(prompt) + 3  # prefill rows + tree rows
        finally:
            ctx.close()
    assert np.array_equal(out[0], out[1])


@pytest.mark.skipif(not native.AVAILABLE, reason="native kernels not built")
def test_the_c_taps_capture_the_python_taps_rows(model):
    """The C eval callback (``native.tap``) and the Python one (the reference) capture the
    same rows, bit for bit and in the same order, in a decode split into micro-batches
    (4 splits of 16 tokens) and in a tree decode: the three layer inputs of ``FeatureTap``
    for every token, the final-norm rows of ``FinalNormTap`` for the output rows only. The
    C callback is asked about every graph node, answers yes only for the named ones, and
    copies each of them once per split."""
    from localspec.backend.features import FinalNormTap

    prompt = (model.tokenize(PROMPT) * 8)[:64]
    got = {}
    for use_c in (False, True):
        taps = (FeatureTap([2, 9, 15], model.n_layer, model.n_embd, native=use_c), FinalNormTap(model.n_embd, native=use_c))
        assert all(t.native == use_c for t in taps)
        for k, tap in enumerate(taps):
            ctx = Context(model, n_ctx=256, n_batch=64, n_ubatch=16, n_seq_max=4, cb_eval=tap.callback,
                          cb_eval_user_data=tap.user_data)  # fmt: skip
            try:
                b = Batch(len(prompt))
                b.set_sequence(prompt, 0, output="all" if k else "none")
                ctx.decode(b)
                first = tap.take()
                b.set_sequence(prompt[:5], len(prompt), output="last")
                ctx.decode(b)
                got[use_c, k] = (first, tap.take())
                if use_c:
                    c = tap._c
                    assert c.n_asked > 100 and c.n_copied == (3 * 5 if k == 0 else 5)
            finally:
                ctx.close()
    for k, n_first in ((0, 64), (1, 64)):
        (pf, pl), (cf, cl) = got[False, k], got[True, k]
        assert pf.shape[0] == n_first and pl.shape[0] == (5 if k == 0 else 1)
        assert np.array_equal(pf, cf) and np.array_equal(pl, cl)


def test_a_native_tap_refuses_a_tensor_of_another_width(model):
    """A named tensor that is not float32 of the tap's width is skipped and reported at
    ``take`` (the decode itself goes on: the callback never cancels it)."""
    if not native.AVAILABLE:
        pytest.skip("native kernels not built")
    from localspec.backend.features import FinalNormTap

    tap = FinalNormTap(model.n_embd + 1, native=True)
    ctx = Context(model, n_ctx=256, cb_eval=tap.callback, cb_eval_user_data=tap.user_data)
    try:
        b = Batch(4)
        b.set_sequence(model.tokenize(PROMPT)[:4], 0, output="last")
        ctx.decode(b)
        assert ctx.logits().shape[-1] == model.n_vocab
        with pytest.raises(TypeError, match="not an F32 tensor of width"):
            tap.take()
        assert tap.take().shape == (0, model.n_embd + 1)  # the error is cleared with the rows
    finally:
        ctx.close()


_PLAIN = PlainReferences()


def plain_run(eng, prompt, n, sampling=GREEDY):
    """Plain decoding of ``prompt`` (``run`` without a drafter), once per module (``PlainReferences``)."""
    return _PLAIN.get(run, eng, prompt, n, sampling)


def run(eng, prompt, n, sampling=GREEDY, drafter=None):
    eng.set_drafter(drafter)
    eng.adaptive = drafter is None or not getattr(drafter, "fixed_shape", None)
    eng.reset()
    res = eng.generate(prompt, max_tokens=n, sampling=sampling, speculative=drafter is not None)
    if drafter is not None:
        drafter.check_cache()
        if drafter.ctx is not None:  # no scratch sequence left behind
            assert all(drafter.ctx.pos_max(s) == -1 for s in range(1, drafter.ctx.n_seq_max))
        else:  # the host runtime (eagle3_host): no tree node's keys left behind
            assert drafter.runtime == "host" and not drafter._node_row and drafter._tree_k is None
    return res


@pytest.mark.parametrize("runtime", ["host", "llama"])
@pytest.mark.parametrize("shape", [TreeShape(4, 1, 5, 0.0), TreeShape(3, 3, 10, 0.0)], ids=["chain", "tree"])
def test_random_head_greedy_output_is_the_target_argmax(eng, model, random_head_path, shape, runtime):
    prompt = model.tokenize(PROMPT)
    plain = plain_run(eng, prompt, 48)
    d = Eagle3Drafter(random_head_path, shape=shape, runtime=runtime)
    spec = run(eng, prompt, 48, drafter=d)
    assert_same_as_plain(eng, prompt, plain.token_ids, spec.token_ids)
    assert spec.stats.num_draft_tokens >= 40  # it drafted at every step
    assert d.kv_len >= len(prompt)  # the head's KV holds an entry for every prompt position
    eng.set_drafter(None)


def test_random_head_with_seeded_gumbel_and_kv_reuse(eng, model, random_head_path):
    sp = SamplingParams(temperature=0.8, seed=5)
    prompt = model.tokenize(PROMPT)
    plain = run(eng, prompt, 32, sp)
    d = Eagle3Drafter(random_head_path, shape=TreeShape(3, 2, 7, 0.0))
    a = run(eng, prompt, 32, sp, d)
    assert a.stats.n_generated_tokens == 32
    assert_same_as_plain(eng, prompt, plain.token_ids, a.token_ids, sampling=sp)
    # a second request sharing the prompt reuses the target's KV and the head's entries
    b = eng.generate(prompt + a.token_ids[:10], max_tokens=16, sampling=sp)
    assert b.stats.n_cached_tokens >= len(prompt)
    d.check_cache()
    ref = eng.generate(prompt + a.token_ids[:10], max_tokens=16, sampling=sp, speculative=False)
    assert b.stats.n_generated_tokens == 16
    assert_same_as_plain(eng, prompt + a.token_ids[:10], ref.token_ids, b.token_ids, sampling=sp)
    eng.set_drafter(None)


def test_auto_drafter_with_an_eagle3_head(eng, model, random_head_path):
    prompt = model.tokenize(PROMPT)
    plain = plain_run(eng, prompt, 48)  # the greedy tests' reference (48 tokens, as they run)
    eng.set_drafter("auto", eagle=random_head_path)
    assert eng._tap is not None and eng.drafter.target_feature_layers == (2, 9, 15)
    eng.reset()
    res = eng.generate(prompt, max_tokens=48, sampling=GREEDY)
    assert_same_as_plain(eng, prompt, plain.token_ids, res.token_ids)
    eng.set_drafter(None)
    assert eng._tap is None  # the target context no longer pays for the callback


@pytest.mark.parametrize("shape", REJECTION_SHAPES, ids=["chain", "tree"])
def test_random_head_rejection_sampling_is_exact(eng, model, random_head_path, shape):
    """Drafts sampled from the head's own (reduced-vocabulary) distribution, verified by
    classic rejection sampling on real target rows: chi-square on the first two tokens."""
    prompt = model.tokenize("My favourite fruit is the")
    d = Eagle3Drafter(random_head_path)
    eng.set_drafter(d)
    try:
        eng.reset()
        d.begin(prompt)
        eng.cache.prefill(prompt[:-1])
        d.add_target_features(0, eng._tap.take())
        b = TreeBuilder(prompt[-1])
        root_row = d.target_rows(d.decode_level(b, [0]))[0]  # draft-vocabulary rows, as target-wide rows
        support = RequestState(REJECTION_SAMPLING.with_seed(0), model, prompt).processor.candidates(root_row).ids
        kids = [b.add(0, int(t), source=TokenSource.EAGLE3) for t in support]
        after = d.target_rows(d.decode_level(b, kids))
        draft_after = {int(t): after[i].copy() for i, t in enumerate(support)}
        d.release_tree()
        assert set(support) <= set(np.flatnonzero(np.isfinite(root_row)))  # inside the draft vocabulary

        def target_rows(p, toks):
            eng.cache.truncate(len(p) - 1)
            t = TreeBuilder(p[-1])
            for tok in toks:
                t.add(0, int(tok), source=TokenSource.NGRAM)
            tree = t.build()
            lay, lg = eng.cache.decode_tree(tree)
            rows = lg.copy()
            eng.cache.commit(tree, lay, [])
            eng.cache.truncate(len(p) - 1)
            eng._tap.clear()
            return rows[0], {int(tree.token_ids[i]): rows[i] for i in range(1, tree.n_nodes)}

        assert_rejection_sampling_exact(model, prompt, root_row, draft_after, shape, target_rows)
    finally:
        eng.set_drafter(None)


def test_the_shipped_head_is_found_for_the_default_model_and_drafts_losslessly(model, derived_draft_path, random_head_path):
    """``--drafter eagle3`` without a path takes the head shipped for the default model; it is
    small enough to ship, stays lossless, and, on questions given as user turns (as ``chat``
    gives them), gets far more of its drafts accepted than an untrained head in the same chains
    (measured MAL 1.54 on one thread and 1.72 on two, against 1.0). Another target
    gets no shipped head and a clear error."""
    from localspec.errors import InvalidRequestError
    from localspec.models.eagle3_heads import shipped_head
    from localspec.tui.chat_format import chat_prompt_tokens

    head = shipped_head(model.path)
    assert head is not None and head.stat().st_size <= 30 * 2**20
    assert shipped_head(derived_draft_path) is None
    questions = ["What is the capital of France?", "Name three uses of copper.", "How do plants make sugar?"]
    prompts = [chat_prompt_tokens(model, q) for q in questions]
    mal, refs = {}, []
    for name, drafter in (("shipped", "eagle3"), ("random", Eagle3Drafter(random_head_path))):
        e = Engine(model, drafter=drafter, n_ctx=2048, cost_model=frozen_cost_model(), adaptive=False)
        try:
            lens = []
            for i, prompt in enumerate(prompts):
                e.reset()
                spec = e.generate(prompt, max_tokens=48, sampling=GREEDY)
                if len(refs) == i:  # plain decoding once per prompt, for both heads
                    e.reset()
                    refs.append(e.generate(prompt, max_tokens=48, sampling=GREEDY, speculative=False).token_ids)
                assert_same_as_plain(e, prompt, refs[i], spec.token_ids)
                lens.append(spec.stats.mean_acceptance_length)
            mal[name] = float(np.mean(lens))
        finally:
            e.close()
    assert mal["shipped"] > mal["random"] + 0.25, mal
    with pytest.raises(InvalidRequestError, match="needs an EAGLE-3 head"):
        Engine(derived_draft_path, drafter="eagle3", n_ctx=256)
