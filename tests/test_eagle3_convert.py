"""EAGLE-3 heads as people have them: Hugging Face checkpoints in the upstream layouts (the
EAGLE repo's ``midlayer.*``, SpecForge's ``model.layers.0.*`` with its own token embeddings),
converted with the vendored llama.cpp's ``convert_hf_to_gguf.py HEAD_DIR --target-model-dir
TARGET_DIR``, for a tiny random Llama target converted by the same script. No downloads: the
checkpoints are written here (``hf_eagle3``), the converter comes from the llama-cpp-python
sdist in build/sdist."""

import json

import numpy as np
import pytest

from conftest import frozen_cost_model
from hf_eagle3 import (
    TargetSpec, convert, converter, reference_head_logits, sdist_path, write_head, write_target,
)
from helpers import REJECTION_SAMPLING, REJECTION_SHAPES, assert_rejection_sampling_exact, assert_same_as_plain
from localspec import Engine, SamplingParams
from localspec.backend import Model
from localspec.drafters.base import TargetHandle
from localspec.drafters.eagle3 import Eagle3Drafter
from localspec.errors import ModelLoadError, VocabMismatchError
from localspec.policy import TreeShape
from localspec.request_state import RequestState
from localspec.tree import TokenSource, TreeBuilder

GREEDY = SamplingParams.greedy()
PROMPT = "The red apple and the blue river. The green garden and the"
HEADS = {  # name -> (checkpoint layout, write_head options, converter --outtype)
    "eagle": ("eagle", {}, "f16"),  # fc on the host (F16)
    "specforge": ("specforge", {"aux_layers": (1, 4, 6)}, "bf16"),  # own embeddings; fc in llama.cpp (BF16)
    "norms": ("eagle", {"norm_before_fc": True, "norm_before_residual": True}, "f16"),  # fc in llama.cpp (norm)
}
MISFITS = {  # a head converted for another target -> what the refusal names
    "wide": (TargetSpec(hidden=96), ModelLoadError, r"features of hidden size 96 \(the target has 64\)"),
    "deep": (TargetSpec(layers=16), ModelLoadError, r"target layers 8, 13 of \[2, 8, 13\] \(the target has 8 layers"),
    "vocab": (TargetSpec(vocab=400, tokenizer_seed=1), ModelLoadError, r"a vocabulary of 400 tokens \(the target has 320"),
    "tokenizer": (TargetSpec(tokenizer_seed=1), VocabMismatchError, r"token \d+ differs: .*carries another tokenizer"),
}


@pytest.fixture(scope="module")
def conv(tmp_path_factory):
    """The target GGUF, the ``HEADS``, and the misfit heads, all converted."""
    if not sdist_path().exists():
        pytest.skip(f"no llama-cpp-python sdist at {sdist_path()} (make env downloads it): the converter comes from it")
    d = tmp_path_factory.mktemp("hf")
    script = converter(d / "llama.cpp")
    target = write_target(d / "target")
    heads = {name: write_head(d / f"head-{name}", target, layout, **opts) for name, (layout, opts, _) in HEADS.items()}
    jobs = [[target, "--outfile", d / "target.gguf", "--outtype", "f32"]]
    jobs += [[h.path, "--outfile", d / f"head-{name}.gguf", "--target-model-dir", target, "--outtype", HEADS[name][2]]
             for name, h in heads.items()]  # fmt: skip
    for name, (spec, _, _) in MISFITS.items():
        other = write_target(d / f"target-{name}", spec, weights=False)
        h = write_head(d / f"head-{name}", other, "eagle")
        jobs.append([h.path, "--outfile", d / f"misfit-{name}.gguf", "--target-model-dir", other])
    convert(script, *jobs)
    return d, heads


@pytest.fixture(scope="module")
def target(conv):
    m = Model(conv[0] / "target.gguf")
    yield m
    m.close()


def engine(target, head, shape=None, **kw):
    return Engine(target, drafter="eagle3", eagle=head, n_ctx=512, cost_model=frozen_cost_model(),
                  adaptive=shape is None, draft_shape=shape, **kw)  # fmt: skip


@pytest.mark.parametrize("layout", HEADS)
def test_a_converted_head_loads_with_its_layers_and_vocabulary_map(conv, target, layout, monkeypatch):
    """The feature layers and ``d2t`` come from the converted GGUF: the config's
    ``eagle_aux_hidden_state_layer_ids`` (SpecForge) or the converter's default
    ``(2, n // 2, n - 3)`` (EAGLE repo), and the checkpoint's ``d2t`` offsets as absolute ids,
    which llama.cpp's rows agree with (finite exactly there)."""
    d, heads = conv
    info = heads[layout]
    monkeypatch.setenv("LOCALSPEC_EAGLE3_RUNTIME", "llama")  # it reads llama.cpp's target-wide row
    e = engine(target, d / f"head-{layout}.gguf")
    try:
        h = e.drafter
        assert isinstance(h, Eagle3Drafter)
        assert h.target_feature_layers == info.target_layers == HEADS[layout][1].get("aux_layers", (2, 4, 5))
        assert tuple(e._tap.layers) == info.target_layers  # the target context captures them
        assert np.array_equal(h.d2t, info.d2t)
        assert h.own_token_embd == (layout == "specforge") and h.target_vocab_size == target.n_vocab == 320
        assert (h.fc is None) == (layout != "eagle")  # a BF16 fc, or a norm before it, stays in llama.cpp
        prompt = target.tokenize(PROMPT)
        h.begin(prompt)
        e.cache.prefill(prompt[:-1])
        h.add_target_features(0, e._tap.take())
        rows = h.decode_level(TreeBuilder(prompt[-1]), [0])
        raw = h.ctx.logits()[-1]  # llama.cpp's target-wide row: -inf outside the draft vocabulary
        assert rows.shape == (1, info.d2t.size)
        assert np.array_equal(np.flatnonzero(np.isfinite(raw)), info.d2t)
        assert np.array_equal(raw[info.d2t], rows[0])
    finally:
        e.close()


@pytest.mark.parametrize("layout", HEADS)
def test_a_converted_head_computes_the_upstream_head(conv, target, layout):
    """The head's level-0 rows (the catch-up entries decoded with outputs, the root's last)
    equal the EAGLE-3 layer computed in float64 numpy from the Hugging Face checkpoint
    (``reference_head_logits``: Hugging Face RoPE, GQA, the norms and residual the config
    names) on the same target features, to the rounding of the GGUF's matrices (F16: 1%, BF16:
    3% of the largest logit; measured 0.05-0.09% and 0.3%). Feeding each entry the token at
    its own position instead of the next one is off by 9-18% of it."""
    d, heads = conv
    h = Eagle3Drafter(d / f"head-{layout}.gguf", context_window=None, runtime="llama")  # every entry, as the reference
    e = Engine(target, drafter=h, n_ctx=512, cost_model=frozen_cost_model())
    try:
        prompt = target.tokenize(PROMPT)
        assert len(prompt) > 20  # a catch-up longer than CATCH_UP_OUTPUTS: two calls
        h.begin(prompt)
        e.cache.prefill(prompt[:-1])
        feats = e._tap.take()
        h.add_target_features(0, feats)
        root = h.decode_level(TreeBuilder(prompt[-1]), [0])[0]
        got = h._level_rows(h.ctx.logits())  # the entries decoded with outputs, the root's last
        ref = reference_head_logits(heads[layout].path, d / "target", feats, prompt[1:])[-got.shape[0] :]
        tol = {"f16": 0.01, "bf16": 0.03}[HEADS[layout][2]] * np.abs(ref).max()
        assert np.array_equal(root, got[-1])
        assert np.abs(got - ref).max() < tol
        assert np.argmax(root) == np.argmax(ref[-1])
    finally:
        e.close()


@pytest.mark.parametrize("layout", HEADS)
def test_a_converted_head_on_the_host_runtime_computes_the_upstream_head(conv, target, layout):
    """The host runtime (``eagle3_host``: F16 / BF16 matrices as float32, the encoder's norm,
    ``norm_before_residual``, the SpecForge head's own embeddings) gives the root's row of the
    float64 reference to the same tolerance as the graph, and the graph's row to 1% of its
    largest logit."""
    d, heads = conv
    h = Eagle3Drafter(d / f"head-{layout}.gguf", context_window=None, runtime="host")
    g = Eagle3Drafter(d / f"head-{layout}.gguf", context_window=None, runtime="llama")
    e = Engine(target, drafter=g, n_ctx=512, cost_model=frozen_cost_model())
    try:
        h.attach(TargetHandle(target, n_ctx=e.ctx.n_ctx, n_threads=e.ctx.n_threads, tensor_source=e.ctx, features=e._tap))
        assert h.runtime == "host" and h.ctx is None
        prompt = target.tokenize(PROMPT)
        for x in (h, g):
            x.begin(prompt)
        e.cache.prefill(prompt[:-1])
        feats = e._tap.take()
        for x in (h, g):
            x.add_target_features(0, feats)
        root = h.decode_level(TreeBuilder(prompt[-1]), [0])[0]
        root_graph = g.decode_level(TreeBuilder(prompt[-1]), [0])[0]
        ref = reference_head_logits(heads[layout].path, d / "target", feats, prompt[1:])[-1]
        tol = {"f16": 0.01, "bf16": 0.03}[HEADS[layout][2]] * np.abs(ref).max()
        assert np.abs(root - ref).max() < tol
        assert np.argmax(root) == np.argmax(ref)
        assert np.abs(root - root_graph).max() < 0.01 * np.abs(root_graph).max()
    finally:
        h.close()
        e.close()


@pytest.mark.parametrize("layout", HEADS)
@pytest.mark.parametrize("shape", [TreeShape(4, 1, 5, 0.0), TreeShape(3, 3, 10, 0.0)], ids=["chain", "tree"])
@pytest.mark.parametrize("runtime", ["host", "llama"])
def test_a_converted_head_drafts_losslessly_greedy(conv, target, layout, shape, runtime, monkeypatch):
    d, _ = conv
    monkeypatch.setenv("LOCALSPEC_EAGLE3_RUNTIME", runtime)
    e = engine(target, d / f"head-{layout}.gguf", shape)
    try:
        prompt = target.tokenize(PROMPT)
        spec = e.generate(prompt, max_tokens=40, sampling=GREEDY)
        e.drafter.check_cache()
        assert e.drafter.runtime == runtime
        e.reset()
        plain = e.generate(prompt, max_tokens=40, sampling=GREEDY, speculative=False)
        assert len(plain.token_ids) == 40
        assert_same_as_plain(e, prompt, plain.token_ids, spec.token_ids)
        assert spec.stats.num_draft_tokens >= 3 * spec.stats.n_steps  # the head drafted at every step
    finally:
        e.close()


@pytest.mark.parametrize("layout", HEADS)
def test_a_converted_head_drafts_losslessly_seeded_sampling(conv, target, layout):
    """Seeded sampling (temperature 0.8, top-k 0): the speculative output is the plain one,
    token for token, as the exact kernels guarantee (``assert_same_as_plain``)."""
    d, _ = conv
    sp = SamplingParams(temperature=0.8, top_k=0, seed=11)
    e = engine(target, d / f"head-{layout}.gguf", TreeShape(3, 2, 7, 0.0))
    try:
        prompt = target.tokenize(PROMPT)
        spec = e.generate(prompt, max_tokens=40, sampling=sp)
        e.reset()
        plain = e.generate(prompt, max_tokens=40, sampling=sp, speculative=False)
        assert len(set(plain.token_ids)) > 5  # sampled, not a greedy loop
        assert_same_as_plain(e, prompt, plain.token_ids, spec.token_ids, sampling=sp)
        assert spec.stats.num_draft_tokens > 0
    finally:
        e.close()


@pytest.mark.parametrize("layout", HEADS)
def test_a_converted_head_rejection_sampling_is_exact(conv, target, layout):
    """Drafts sampled from the converted head's own draft-vocabulary distribution (a tree),
    verified by classic rejection sampling on the target's real rows: chi-square on the
    first two emitted tokens (``assert_rejection_sampling_exact``)."""
    d, _ = conv
    e = engine(target, d / f"head-{layout}.gguf", REJECTION_SHAPES[1])
    h = e.drafter
    try:
        prompt = target.tokenize(PROMPT)
        h.begin(prompt)
        e.cache.prefill(prompt[:-1])
        h.add_target_features(0, e._tap.take())
        b = TreeBuilder(prompt[-1])
        root_row = h.target_rows(h.decode_level(b, [0]))[0]
        support = RequestState(REJECTION_SAMPLING.with_seed(0), target, prompt).processor.candidates(root_row).ids
        kids = [b.add(0, int(t), source=TokenSource.EAGLE3) for t in support]
        after = h.target_rows(h.decode_level(b, kids))
        draft_after = {int(t): after[i].copy() for i, t in enumerate(support)}
        h.release_tree()
        assert set(support) <= set(h.d2t.tolist())

        def target_rows(p, toks):
            e.cache.truncate(len(p) - 1)
            t = TreeBuilder(p[-1])
            for tok in toks:
                t.add(0, int(tok), source=TokenSource.NGRAM)
            tree = t.build()
            lay, lg = e.cache.decode_tree(tree)
            rows = lg.copy()
            e.cache.commit(tree, lay, [])
            e.cache.truncate(len(p) - 1)
            e._tap.clear()
            return rows[0], {int(tree.token_ids[i]): rows[i] for i in range(1, tree.n_nodes)}

        assert_rejection_sampling_exact(target, prompt, root_row, draft_after, REJECTION_SHAPES[1], target_rows)
    finally:
        e.close()


@pytest.mark.parametrize("misfit", MISFITS)
def test_a_head_converted_for_another_target_is_refused_in_one_line(conv, target, misfit):
    d, _ = conv
    _, err, msg = MISFITS[misfit]
    with pytest.raises(err, match=msg) as ex:
        engine(target, d / f"misfit-{misfit}.gguf")
    text = str(ex.value)
    assert "\n" not in text and "--target-model-dir" in text


def test_the_documented_commands(conv, target, capsys):
    """``localspec generate ... -m target.gguf --drafter eagle3 --eagle head.gguf``, as
    docs/drafters.md gives it, and its one-line refusal of a misfit head."""
    from localspec.cli.main import main

    d, _ = conv
    args = ["generate", PROMPT, "-m", str(d / "target.gguf"), "--drafter", "eagle3", "-n", "24", "--temperature", "0"]
    assert main([*args, "--eagle", str(d / "head-eagle.gguf"), "--compare", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["identical_to_plain"] is True and len(out["token_ids"]) == 24
    assert main([*args, "--eagle", str(d / "misfit-deep.gguf")]) == 1
    err = capsys.readouterr().err.strip().splitlines()  # a progress line, then the error
    assert err[-1].startswith("localspec: error: the EAGLE-3 head") and "target layers 8, 13" in err[-1]
    assert not any(line.startswith(("Traceback", "  File")) for line in err)
