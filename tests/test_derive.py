"""Derived drafts (layer-truncated GGUFs) and the model-writing CLI commands."""

import json

import numpy as np
import pytest

from localspec.cli.main import main
from localspec.models.derive import derive_draft
from localspec.models.gguf_edit import copy_gguf, read_metadata


@pytest.fixture
def tiny_gguf(tmp_path):
    """A 4-block 'llama' GGUF with a per-layer metadata array (no real weights)."""
    from gguf import GGUFWriter

    p = tmp_path / "tiny.gguf"
    w = GGUFWriter(str(p), arch="llama")
    w.add_uint32("llama.block_count", 4)
    w.add_array("llama.attention.head_count", [8, 8, 4, 4])
    w.add_array("llama.attention.sliding_window_pattern", [True, False, True, False])
    w.add_array("llama.some_other_list", [1, 2, 3])  # not per layer: kept as is
    w.add_string("general.name", "tiny")
    w.add_tensor("token_embd.weight", np.zeros((16, 4), dtype=np.float32))
    for i in range(4):
        w.add_tensor(f"blk.{i}.attn_q.weight", np.full((4, 4), i, dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return p


def test_derive_keeps_the_first_blocks_and_fixes_metadata(tiny_gguf, tmp_path):
    from gguf import GGUFReader

    out = derive_draft(tiny_gguf, tmp_path / "d.gguf", 2)
    meta = read_metadata(out)
    assert meta["llama.block_count"] == 2
    assert meta["llama.attention.head_count"] == [8, 8]
    assert meta["llama.attention.sliding_window_pattern"] == [True, False]
    assert meta["llama.some_other_list"] == [1, 2, 3]
    assert "first 2 of 4 layers" in meta["general.name"]
    names = {t.name: t for t in GGUFReader(str(out)).tensors}
    assert set(names) == {"token_embd.weight", "blk.0.attn_q.weight", "blk.1.attn_q.weight", "output_norm.weight"}
    assert np.all(names["blk.1.attn_q.weight"].data == 1)
    with pytest.raises(ValueError, match="1..3"):
        derive_draft(tiny_gguf, tmp_path / "e.gguf", 4)


def test_copy_gguf_keeps_every_byte_edits_one_entry_and_names_a_truncated_file(tiny_gguf, tmp_path):
    """copy_gguf reads through GGUFIndex and copies unedited entries raw: without edits the
    copy is the same file; an edited entry is re-encoded with its own type; a file cut short
    is refused as truncated (naming it), not with a reshape error."""
    same = copy_gguf(tiny_gguf, tmp_path / "same.gguf")
    assert same.read_bytes() == tiny_gguf.read_bytes()
    edited = copy_gguf(tiny_gguf, tmp_path / "e.gguf", edit_kv=lambda k, v: [7, 8, 9] if k == "llama.some_other_list" else v)
    meta, orig = read_metadata(edited), read_metadata(tiny_gguf)
    assert meta["llama.some_other_list"] == [7, 8, 9]
    assert {k: v for k, v in meta.items() if k != "llama.some_other_list"} == {k: v for k, v in orig.items() if k != "llama.some_other_list"}
    from localspec.models.gguf_index import GGUFIndex

    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[: GGUFIndex(tiny_gguf).tensors["output_norm.weight"].offset + 8])
    with pytest.raises(ValueError, match=f"{cut} is a truncated or corrupt GGUF file"):
        copy_gguf(cut, tmp_path / "x.gguf")
    with pytest.raises(ValueError, match="truncated"):
        read_metadata(cut)


def test_the_derived_default_model_loads_as_a_real_draft(derived_draft, model):
    assert derived_draft.n_layer == 12 and derived_draft.n_vocab == model.n_vocab
    assert derived_draft.architecture == model.architecture


def test_cli_derive_draft_refuses_bad_layer_counts(capsys, tmp_path):
    with pytest.raises(SystemExit, match="--layers must be in 1..17"):
        main(["models", "derive-draft", "default", "--layers", "18", "--out", str(tmp_path / "x.gguf")])


def test_cli_generate_with_a_draft_model(capsys, derived_draft_path):
    """The CLI with a draft model: adaptive (the policy verifies what pays on this machine's
    measured costs, possibly nothing of a 12-layer draft's unsure trees) and with
    ``--no-adaptive`` (every drafted tree verified, so drafts reach the target), both equal to
    plain decoding."""
    args = ["generate", "def add(a, b):", "-n", "24", "--temperature", "0", "--compare", "--json"]
    for extra in ([], ["--no-adaptive"]):
        assert main([*args, "--drafter", "draft", "--draft-model", str(derived_draft_path), *extra]) == 0
        d = json.loads(capsys.readouterr().out)
        assert d["stats"]["drafter"] == "draft" and d["identical_to_plain"] is True
    assert d["stats"]["num_draft_tokens"] > 0


def test_cli_generate_with_an_eagle3_head(capsys, random_head_path):
    args = ["generate", "Once upon a time", "-n", "16", "--temperature", "0", "--json"]
    assert main([*args, "--drafter", "eagle3", "--eagle", str(random_head_path), "--no-adaptive"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["stats"]["drafter"] == "eagle3" and d["stats"]["num_draft_tokens"] > 0


def test_cli_drafter_without_its_model_is_a_clear_error(capsys, derived_draft_path):
    assert main(["generate", "hi", "-n", "2", "--drafter", "draft"]) == 1
    assert "--draft-model" in capsys.readouterr().err
    # an EAGLE-3 head ships only for the default model: another target needs --eagle
    assert main(["generate", "hi", "-n", "2", "--drafter", "eagle3", "-m", str(derived_draft_path)]) == 1
    assert "--eagle" in capsys.readouterr().err
    assert main(["generate", "hi", "-n", "2", "--drafter", "eagle3"]) == 0  # the shipped head


def test_cli_bench_with_a_model_drafter(tmp_path, capsys, derived_draft_path):
    ds = tmp_path / "q.jsonl"
    rows = [
        {"question_id": 1, "category": "qa", "turns": ["What is the capital of France?"]},
        {"question_id": 2, "category": "coding", "turns": ["Write hello world in C."]},
    ]
    ds.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "out"
    argv = ["bench", "--dataset", str(ds), "--per-category", "1", "-n", "8", "--out", str(out)]
    assert main([*argv, "--drafter", "auto", "--draft-model", str(derived_draft_path)]) == 0
    d = json.loads((out / "bench.json").read_text())
    assert d["config"]["drafter"] == "auto" and d["config"]["draft_model"] == str(derived_draft_path)
    for c in d["categories"].values():
        assert c["identical_fraction"] == 1.0 and c["mean_acceptance_length"] >= 1.0
