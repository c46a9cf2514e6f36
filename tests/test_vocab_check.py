"""The draft/target vocabulary check, on vocabulary-only GGUFs the tests write from the
default model (metadata only: they load with ``vocab_only=True`` in a fraction of a second)."""

import pytest

from localspec.backend import Model
from localspec.drafters.vocab_check import check_vocab
from localspec.errors import VocabMismatchError
from localspec.models.gguf_edit import copy_gguf, open_index

N_PAD = 64


@pytest.fixture(scope="module")
def vocab_files(model_path, tmp_path_factory):
    d = tmp_path_factory.mktemp("vocab")
    src = open_index(model_path)  # indexed once, copied seven times
    tokens = src.contents("tokenizer.ggml.tokens")
    no_tensors = dict(keep_tensor=lambda name: False)

    def edit_entry(array_key, i, value):
        def edit(key, val):
            if key == array_key:
                val = list(val)
                val[i] = value
            return val

        return edit

    def pad(token_type):
        def edit(key, val):
            if key == "tokenizer.ggml.tokens":
                return list(val) + [f"<pad_extra_{j}>" for j in range(N_PAD)]
            if key == "tokenizer.ggml.token_type":
                return list(val) + [token_type] * N_PAD
            if key == "tokenizer.ggml.scores":
                return list(val) + [-1000.0] * N_PAD
            return val

        return edit

    files = {
        "same": copy_gguf(src, d / "same.gguf", **no_tensors),
        "eos": copy_gguf(src, d / "eos.gguf", set_kv={"tokenizer.ggml.eos_token_id": 106}, **no_tensors),
        "unk": copy_gguf(src, d / "unk.gguf", set_kv={"tokenizer.ggml.unknown_token_id": 0}, **no_tensors),
        "text": copy_gguf(src, d / "text.gguf", edit_kv=edit_entry("tokenizer.ggml.tokens", 1000, tokens[1000] + "x"), **no_tensors),
        "type": copy_gguf(src, d / "type.gguf", edit_kv=edit_entry("tokenizer.ggml.token_type", 1000, 3), **no_tensors),
        "padded": copy_gguf(src, d / "padded.gguf", edit_kv=pad(5), **no_tensors),
        "padded_normal": copy_gguf(src, d / "padded_normal.gguf", edit_kv=pad(1), **no_tensors),
    }
    return files, tokens


@pytest.fixture(scope="module")
def target_vocab(model_path):
    m = Model(model_path, vocab_only=True)
    yield m
    m.close()


def load(path):
    return Model(path, vocab_only=True)


def test_identical_vocabularies_pass(vocab_files, target_vocab):
    files, _ = vocab_files
    with load(files["same"]) as d:
        res = check_vocab(target_vocab, d)
    assert res.n_common == target_vocab.n_vocab and res.n_padded_draft == res.n_padded_target == 0


def test_a_different_special_token_id_is_refused(vocab_files, target_vocab):
    files, tokens = vocab_files
    with load(files["eos"]) as d, pytest.raises(VocabMismatchError) as e:
        check_vocab(target_vocab, d)
    msg = str(e.value)
    assert "EOS" in msg and "1 ('<eos>')" in msg and f"106 ({tokens[106]!r})" in msg
    assert "same model family" in msg  # says what to do
    with load(files["unk"]) as d, pytest.raises(VocabMismatchError, match="unknown_token_id differs: target 3, draft 0"):
        check_vocab(target_vocab, d)


def test_a_different_token_text_is_refused_naming_it(vocab_files, target_vocab):
    files, tokens = vocab_files
    with load(files["text"]) as d, pytest.raises(VocabMismatchError) as e:
        check_vocab(target_vocab, d)
    assert f"token 1000 differs: target {tokens[1000]!r}, draft {tokens[1000] + 'x'!r}" in str(e.value)


def test_a_different_token_type_is_refused(vocab_files, target_vocab):
    files, _ = vocab_files
    with load(files["type"]) as d, pytest.raises(VocabMismatchError, match="token 1000 .* attributes"):
        check_vocab(target_vocab, d)


def test_a_padded_tail_of_unused_ids_is_accepted_both_ways(vocab_files, target_vocab):
    files, _ = vocab_files
    with load(files["padded"]) as d:
        assert d.n_vocab == target_vocab.n_vocab + N_PAD
        res = check_vocab(target_vocab, d)
        assert res.n_common == target_vocab.n_vocab and res.n_padded_draft == N_PAD
        res = check_vocab(d, target_vocab)  # the target may be the padded one
        assert res.n_padded_target == N_PAD


def test_extra_ids_that_are_real_tokens_are_refused(vocab_files, target_vocab):
    files, _ = vocab_files
    with load(files["padded_normal"]) as d, pytest.raises(VocabMismatchError, match="not an unused padding token"):
        check_vocab(target_vocab, d)


def test_engine_refuses_a_mismatched_draft_model_and_keeps_its_drafter(vocab_files, model):
    from conftest import frozen_cost_model
    from localspec import Engine, SamplingParams
    from localspec.drafters.draft_model import DraftModelDrafter

    files, _ = vocab_files
    e = Engine(model, drafter="ngram", n_ctx=512, cost_model=frozen_cost_model())
    try:
        with pytest.raises(VocabMismatchError, match="token 1000 differs"):
            e.set_drafter(DraftModelDrafter(load(files["text"])))
        assert e.drafter_name == "ngram"
        assert len(e.generate("Hello", max_tokens=3, sampling=SamplingParams.greedy()).token_ids) == 3
        with pytest.raises(VocabMismatchError, match="EOS"):
            Engine(model, drafter=DraftModelDrafter(load(files["eos"])), n_ctx=512, cost_model=frozen_cost_model())
    finally:
        e.close()
