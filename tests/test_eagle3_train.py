"""EAGLE-3 training: the torch head computes what llama.cpp's eagle3 graph computes (parity),
and a tiny end-to-end run (record -> train -> resume -> export -> draft) works offline."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from conftest import frozen_cost_model  # noqa: E402
from localspec import Engine, SamplingParams  # noqa: E402
from localspec.backend import Batch, Context, Model  # noqa: E402
from localspec.backend._llama import ext  # noqa: E402
from localspec.backend.batch_ext import ExtBatch  # noqa: E402
from localspec.backend.features import FeatureTap  # noqa: E402
from localspec.models.eagle3_gguf import Eagle3Config, write_eagle3_gguf  # noqa: E402
from localspec.models.training.eagle3_torch import Eagle3Head  # noqa: E402
from localspec.models.training.eagle3_train import TrainConfig, read_target, train_eagle3  # noqa: E402

LAYERS = (2, 9, 15)
TEXT = (
    "def add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n    return a + b\n\n"
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog again.\n"
)
# Largest |logit difference| torch vs llama.cpp measured on this CPU (this random head's
# logits reach +-11): f32 matrices with an F32 KV cache 0.014; with the runtime's BF16 K /
# F16 V cache 0.099; Q8_0 matrices (llama.cpp quantises activations too) 0.31. The bounds
# below leave room for other CPUs' rounding.
GGML_F32 = 0
CASES = {"f32-kv-f32": ("f32", GGML_F32, 0.05), "f32": ("f32", None, 0.25), "q8_0": ("q8_0", None, 0.6)}


@pytest.fixture(scope="module")
def target_tensors(model_path):
    return read_target(model_path)


def _features(model, tokens):
    """Target features of ``tokens`` ([n, 3 * n_embd] float32) through the runtime's tap."""
    tap = FeatureTap(LAYERS, model.n_layer, model.n_embd)
    ctx = Context(model, n_ctx=512, n_batch=256, cb_eval=tap.callback, cb_eval_user_data=tap.user_data)
    b = Batch(256)
    b.set_sequence(tokens, 0, output="last")
    ctx.decode(b)
    return tap.take(), ctx, tap


def _random_head(model, tt, n_draft=512, seed=0):
    cfg = Eagle3Config(target_layers=LAYERS, n_embd_target=model.n_embd, n_embd=model.n_embd, n_head=4, n_head_kv=1,
                       head_dim=64, n_ff=256, rms_eps=tt.rms_eps)  # fmt: skip
    rng = np.random.default_rng(seed)
    d2t = np.sort(rng.choice(model.n_vocab, size=n_draft, replace=False)).astype(np.int64)
    torch.manual_seed(seed)
    table = tt.embedding_table(np.asarray(model.tokenize(TEXT)))
    head = Eagle3Head(cfg, table, d2t, np.full(3 * model.n_embd, 100.0, np.float32))
    with torch.no_grad():  # larger weights than at init: logits spread out, few near-ties
        for p in (head.wq, head.wk, head.wv, head.wo, head.w_gate, head.w_up, head.w_down, head.output):
            p.weight.normal_(0, 0.1)
        for p in (head.attn_norm, head.hidden_norm, head.ffn_norm, head.output_norm):
            p.uniform_(0.5, 1.5)
    return cfg, head


@pytest.mark.parametrize("case", list(CASES))
def test_torch_head_and_llama_cpp_head_agree(model, model_path, target_tensors, tmp_path, case):
    """Encoder, one level of entries over real target features, and a second unroll step
    (the entry of origin P at position P + 1 reading the first step's pre-norm state, in a
    sequence that shares the step-0 entries <= P): same top-1, logits within LOGIT_TOL."""
    matrix_type, kv_type, tol = CASES[case]
    cfg, head = _random_head(model, target_tensors)
    w = head.to_weights()
    path = write_eagle3_gguf(tmp_path / "head.gguf", model_path, cfg, w, matrix_dtype=matrix_type)
    if matrix_type == "q8_0":  # compare against the weights as stored
        from gguf.quants import dequantize, quantize
        from gguf import GGMLQuantizationType as Q

        with torch.no_grad():
            for lin in (head.wq, head.wk, head.wv, head.wo, head.w_gate, head.w_up, head.w_down, head.output):
                lin.weight.copy_(torch.from_numpy(dequantize(quantize(lin.weight.numpy(), Q.Q8_0), Q.Q8_0)))
    tokens = model.tokenize(TEXT)
    n = len(tokens)
    feats, tctx, _ = _features(model, tokens)
    hm = Model(path)
    kv = {} if kv_type is None else dict(type_k=kv_type, type_v=kv_type)
    hctx = Context(hm, n_ctx=512, n_batch=256, n_seq_max=4, ctx_other=tctx, **kv)
    ext.llama_set_embeddings_nextn(hctx.handle, True, True)
    b = ExtBatch(hctx.handle)
    try:
        with torch.no_grad():
            outs = head(torch.tensor(tokens)[None], torch.from_numpy(feats)[None], n_steps=2)
            g_ref = head.encode(torch.from_numpy(feats)).numpy()
        # encoder
        for i in range(n):
            b.add(token=None, pos=i, seq_id=0, output=True, embd=feats[i])
        hctx.process(b, encode=True)
        g = np.ctypeslib.as_array(ext.llama_get_embeddings_nextn(hctx.handle), shape=(n, cfg.n_embd)).copy()
        assert np.allclose(g, g_ref, rtol=1e-4, atol=1e-3 * np.abs(g_ref).max())
        # step 0: entries (t[P+1], g_P) at positions P = 0 .. n-2
        b.clear()
        for p in range(n - 1):
            b.add(token=tokens[p + 1], pos=p, seq_id=0, output=True, embd=g[p])
        hctx.process(b)
        lg0 = hctx.logits()[:, w.d2t].copy()
        h0 = np.stack([np.ctypeslib.as_array(ext.llama_get_embeddings_nextn_ith(hctx.handle, i), shape=(cfg.n_embd,)) for i in range(n - 1)])
        ref0 = head.logits(outs[0][0, : n - 1]).detach().numpy()
        # step 1 for a few origins P: entry (t[P+2], h0_P) at position P + 1 over step-0 entries <= P
        lg1, ref1 = [], []
        for p in (0, n // 3, n - 3):
            hctx.seq_rm(1)
            hctx.seq_cp(0, 1, 0, p + 1)
            b.clear()
            b.add(token=tokens[p + 2], pos=p + 1, seq_id=1, output=True, embd=h0[p])
            hctx.process(b)
            lg1.append(hctx.logits()[0, w.d2t].copy())
            ref1.append(head.logits(outs[1][0, p]).detach().numpy())
    finally:
        b.close()
        hctx.close()
        hm.close()
        tctx.close()
    for got, ref in ((lg0, ref0), (np.stack(lg1), np.stack(ref1))):
        diff = np.abs(got - ref).max()
        print(f"parity {case}: max |logit diff| {diff:.4f}, |logit| <= {np.abs(ref).max():.1f}")
        assert diff < tol, diff
        top_ref = np.sort(ref, axis=-1)
        gap = top_ref[:, -1] - top_ref[:, -2]
        same = got.argmax(-1) == ref.argmax(-1)
        assert (same | (gap < 2 * diff)).all()
        assert same.mean() >= 0.9


def test_train_smoke_record_train_resume_export_draft(model, model_path, tmp_path):
    """A tiny run without network: record 2 text chunks + 2 self-distilled sequences, train 4
    steps, resume to 6, export Q8_0; the head drafts through the engine, output = plain greedy."""
    from localspec.models.training.eagle3_data import load_shard, prepare_data

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_text(TEXT * 6)
    (corpus / "b.txt").write_text("Speculative decoding drafts tokens and the target checks them. " * 20)
    shards = prepare_data(model_path, tmp_path / "data", [corpus], LAYERS, max_tokens=96, seq_len=48,
                          self_distill=2, prompt_tokens=16, gen_tokens=8, shard_tokens=64, topk=4, n_seq=2,
                          progress=False)  # fmt: skip
    assert shards and sum(load_shard(p).n_tokens for p in shards) > 96
    s = load_shard(shards[0])
    assert s.feats.dtype == np.float16 and np.isfinite(s.features(0, s.n_tokens)).all()
    again = prepare_data(model_path, tmp_path / "data", [corpus], LAYERS, progress=False)  # resumes: nothing to do
    assert again == shards
    cfg = TrainConfig(steps=4, batch=2, seq_len=32, unroll=2, vocab_size=256, warmup=1, log_every=2, ckpt_every=2,
                      head=dict(n_head=2, n_head_kv=1, head_dim=64, n_ff=64))  # fmt: skip
    work = tmp_path / "work"
    out = tmp_path / "head.gguf"
    r1 = train_eagle3(model_path, shards, work, out, cfg, target_layers=LAYERS, progress=False)
    assert r1.steps == 4 and len(r1.train_accuracy) == 2
    cfg.steps = 6
    r2 = train_eagle3(model_path, shards, work, out, cfg, target_layers=LAYERS, progress=False)
    assert r2.steps == 6
    log = [json.loads(x) for x in (work / "train_log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in log if "loss" in x] == [2, 4, 6] and all(len(x["loss"]) == 2 for x in log if "loss" in x)
    head = Model(out)
    assert head.architecture == "eagle3"
    head.close()
    eng = Engine(model, drafter="eagle3", eagle=out, n_ctx=1024, cost_model=frozen_cost_model())
    try:
        prompt = eng.tokenize("def add(a, b):")
        spec = eng.generate(prompt, max_tokens=12, sampling=SamplingParams.greedy())
        plain = eng.generate(prompt, max_tokens=12, sampling=SamplingParams.greedy(), speculative=False)
    finally:
        eng.close()
    assert spec.token_ids == plain.token_ids


def test_teacher_forced_record_matches_the_full_row_path(model, model_path):
    """The fast text recorder (final-norm tap, graph stopped before the lm_head, logits over
    the draft vocabulary in float32) against ``FeatureRecorder.record_text`` (every row's full
    262k logits from llama.cpp) on the same tokens: identical features; the same top-k where
    the draft vocabulary holds the full top-k, logits equal up to llama.cpp's quantised product
    (its activations are rounded to 8 bits; measured max |delta| 0.20 on this CPU)."""
    from localspec.models.training.eagle3_data import FeatureRecorder, TeacherForcedRecorder

    tokens = [model.bos] + model.tokenize(TEXT * 2, add_special=False)
    full = FeatureRecorder(model_path, LAYERS, topk=16, n_seq=1, n_ctx=512)
    try:
        a = full.record_text(tokens)
    finally:
        full.close()
    rng = np.random.default_rng(0)
    d2t = np.unique(np.concatenate([a.topk_ids.ravel(), rng.integers(0, model.n_vocab, 2000)])).astype(np.int64)
    tf = TeacherForcedRecorder(model_path, LAYERS, d2t, topk=4, n_batch=256)
    try:
        b = tf.record_text(tokens)
        again = tf.record_text(tokens)  # a stopped graph leaves nothing behind
    finally:
        tf.close()
    assert np.array_equal(a.feats, b.feats) and np.array_equal(b.feats, again.feats)
    assert np.abs(a.topk_logits[:, :4] - b.topk_logits).max() < 0.5
    # top-1 differs only where llama.cpp's own top-2 are within the quantisation error
    gap = a.topk_logits[:, 0] - a.topk_logits[:, 1]
    differ = a.topk_ids[:, 0] != b.topk_ids[:, 0]
    assert not (differ & (gap > 0.5)).any()
    assert differ.mean() < 0.1


def test_text_recording_smoke_resume_and_restricted_training(model, model_path, tmp_path):
    """The teacher-forced path end to end: plan text chunks, record them over a draft
    vocabulary (shards marked restricted, top-k ids inside d2t), resume is a no-op, a changed
    vocabulary is refused, and the trainer takes the fixed d2t and reports validation per source."""
    from localspec.models.training.eagle3_data import (
        iter_text_files, load_shard, make_plan, prepare_data, record_text_plan, text_token_counts,
    )  # fmt: skip

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(12):
        (corpus / f"d{i}.txt").write_text(f"Document {i}. " + TEXT * 3)
    plan = make_plan(model, iter_text_files([corpus]), max_tokens=1200, seq_len=64, shard_tokens=256, seed=0)
    counts = text_token_counts(plan, model.n_vocab)
    d2t = np.sort(np.argsort(-counts, kind="stable")[:200]).astype(np.int64)
    text = record_text_plan(model_path, tmp_path / "text", plan, LAYERS, d2t, topk=4, progress=False)
    assert len(text) == len(plan.shards) >= 4
    s = load_shard(text[0])
    assert s.restricted and np.isin(s.topk_ids, d2t).all() and (np.diff(s.topk_logits.astype(np.float32), axis=1) <= 0).all()
    assert record_text_plan(model_path, tmp_path / "text", plan, LAYERS, d2t, progress=False) == text
    with pytest.raises(ValueError, match="another draft vocabulary"):
        record_text_plan(model_path, tmp_path / "text", plan, LAYERS, d2t[1:], progress=False)
    gen = prepare_data(model_path, tmp_path / "gen", [corpus], LAYERS, max_tokens=0, self_distill=24, prompt_tokens=16,
                       gen_tokens=6, shard_tokens=64, topk=4, n_seq=8, progress=False)  # fmt: skip
    assert not load_shard(gen[0]).restricted
    cfg = TrainConfig(steps=3, batch=2, seq_len=32, unroll=2, vocab_size=200, warmup=1, log_every=3, ckpt_every=3,
                      val_frac=0.3, head=dict(n_head=2, n_head_kv=1, head_dim=64, n_ff=64))  # fmt: skip
    r = train_eagle3(model_path, [*gen, *text], tmp_path / "work", tmp_path / "h.gguf", cfg, target_layers=LAYERS,
                     d2t=d2t, progress=False)  # fmt: skip
    assert set(r.val_by_source) == {"generated", "text", "gen/", "text/"}  # by kind of target, by folder
    assert all(len(v["acc"]) == 2 for v in r.val_by_source.values())
    assert r.val_by_source["gen/"] == r.val_by_source["generated"] and r.val_by_source["text/"] == r.val_by_source["text"]
    head = Model(tmp_path / "h.gguf")
    try:
        assert head.architecture == "eagle3"
    finally:
        head.close()


def _note_shards(model_path, tmp_path, n: int, **gen):
    """Self-distillation shards (prompt + greedy answer, ``n_prompt`` kept) from ``n`` short
    notes: ``prepare_data`` with ``gen`` (prompt_tokens, gen_tokens, n_seq, seed)."""
    from localspec.models.training.eagle3_data import prepare_data

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(n):
        (corpus / f"d{i}.txt").write_text(f"Note {i}: " + TEXT * 2)
    return prepare_data(model_path, tmp_path / "data", [corpus], LAYERS, max_tokens=0, self_distill=n,
                        shard_tokens=4096, topk=4, progress=False, **gen)  # fmt: skip


def test_held_out_accuracy_scores_any_head_on_the_sequences_training_held_out(model_path, tmp_path):
    """The recipe ships a new head only when it beats the shipped one on held-out data
    (``held_out_accuracy``): scored from its GGUF, the new head gets what training reported
    for the same held-out sequences, and a head with another draft vocabulary is scored too."""
    from localspec.models.eagle3_heads import shipped_head
    from localspec.models.training.eagle3_data import load_shard
    from localspec.models.training.eagle3_train import held_out_accuracy, split_sequences

    shards = _note_shards(model_path, tmp_path, 42, prompt_tokens=12, gen_tokens=20, n_seq=21, seed=3)
    cfg = TrainConfig(steps=3, batch=2, seq_len=32, unroll=3, vocab_size=256, warmup=1, log_every=3, ckpt_every=3,
                      val_frac=0.05, bf16=False, head=dict(n_head=2, n_head_kv=1, head_dim=64, n_ff=64))  # fmt: skip
    val, train = split_sequences([load_shard(p) for p in shards], cfg)
    assert len(val) == 2 and len(train) == 40
    out = tmp_path / "head.gguf"
    r = train_eagle3(model_path, shards, tmp_path / "work", out, cfg, target_layers=LAYERS, progress=False,
                     matrix_dtype="f32")  # fmt: skip
    new, shipped = held_out_accuracy(model_path, shards, [out, shipped_head(model_path)], cfg)
    assert new == pytest.approx(r.val_accuracy, abs=1e-9)
    assert len(shipped) == 3 and all(0.0 <= a <= 1.0 for a in shipped)


def test_answer_accuracy_scores_the_answers_only(model_path, tmp_path):
    """The recipe's ship gate (``answer_accuracy``) scores a head on the answers of recorded
    prompt + answer sequences: the target's labels inside the prompts do not count (corrupting
    them leaves the score as it was), those of the answers do (corrupting them changes it);
    shards without answers (teacher-forced text) are refused with a clear error."""
    from localspec.models.eagle3_heads import shipped_head
    from localspec.models.training.eagle3_train import answer_accuracy

    shards = _note_shards(model_path, tmp_path, 6, prompt_tokens=24, gen_tokens=24, n_seq=6, seed=5)
    cfg = TrainConfig(batch=4, unroll=3, bf16=False)
    head = shipped_head(model_path)
    (base,) = answer_accuracy(model_path, shards, [head], cfg)
    assert len(base) == 3 and all(0.0 <= a <= 1.0 for a in base) and base[0] > 0.0

    def corrupted(where: str):
        with np.load(shards[0]) as z:
            arrays = {k: z[k].copy() for k in z.files}
        starts = np.concatenate([[0], np.cumsum(arrays["lengths"])])
        ids = arrays["topk_ids"]
        for i, n_prompt in enumerate(arrays["n_prompt"]):
            lo, hi = int(starts[i]), int(starts[i + 1])
            span = slice(lo, lo + int(n_prompt)) if where == "prompt" else slice(lo + int(n_prompt), hi)
            ids[span, 0] = (ids[span, 0] + 1) % 1000  # another token as the target's top-1
        path = tmp_path / f"{where}.npz"
        np.savez(path, **arrays)
        return answer_accuracy(model_path, [path], [head], cfg)[0]

    assert corrupted("prompt") == pytest.approx(base, abs=1e-12)
    assert corrupted("answer") != pytest.approx(base, abs=1e-3)
    with np.load(shards[0]) as z:
        np.savez(tmp_path / "text.npz", **{k: z[k] for k in z.files if k != "n_prompt"})
    with pytest.raises(ValueError, match="no recorded answers"):
        answer_accuracy(model_path, [tmp_path / "text.npz"], [head], cfg)


def _answer_shard(path, seqs):
    """A recorded shard of ``(tokens' top-1 ids, n_prompt)`` sequences (no features needed)."""
    top1 = np.concatenate([np.asarray(s, dtype=np.int32) for s, _ in seqs])
    ids = np.zeros((top1.size, 8), dtype=np.int32)
    ids[:, 0] = top1
    np.savez(path, lengths=np.array([len(s) for s, _ in seqs]), n_prompt=np.array([k for _, k in seqs]),
             topk_ids=ids, restricted=np.array(False))  # fmt: skip
    return path


def test_the_recipe_draft_vocabulary_ranks_the_answers_first(tmp_path):
    """``answer_top1_counts`` counts the target's top-1 from each sequence's ``n_prompt`` on
    (answers), skipping restricted shards and text (no answer positions); the recipe's
    ``draft_vocab`` takes the tokens most frequent there, then the text plan's, always the
    eog ids. Counting prompt positions, or ranking by the text counts as before, fails here."""
    import sys
    from pathlib import Path

    from localspec.models.training.eagle3_data import answer_top1_counts

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from train_default_head import draft_vocab

    a = _answer_shard(tmp_path / "a.npz", [([9, 9, 9, 5, 5, 7], 3), ([9, 9, 6], 2)])
    text = _answer_shard(tmp_path / "t.npz", [([4, 4, 4, 4], 4)])  # text: n_prompt = its length
    r = _answer_shard(tmp_path / "r.npz", [([3, 3, 3], 0)])
    with np.load(r) as z:
        np.savez(r, **{**{k: z[k] for k in z.files}, "restricted": np.array(True)})
    counts = answer_top1_counts([a, text, r], 12)
    assert counts.tolist() == [0, 0, 0, 0, 0, 2, 1, 1, 0, 0, 0, 0]
    text_counts = np.zeros(12, dtype=np.int64)
    text_counts[[2, 8, 11]] = [1000, 500, 10]
    assert draft_vocab([a, text, r], text_counts, 5, eog=[1]).tolist() == [1, 2, 5, 6, 7]
    assert draft_vocab([a, text, r], text_counts, 6, eog=[1]).tolist() == [1, 2, 5, 6, 7, 8]
