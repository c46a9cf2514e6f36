"""`localspec batch`: outputs equal one-at-a-time generation at T=0, errors recorded per line,
resumable by id (ids already in OUT are skipped; a half-written last line is cut)."""

import json

from localspec import SamplingParams
from localspec.cli.main import main

PROMPTS = {"a": "The capital of France is", "b": "def add(x, y):", "c": "1, 2, 3,"}


def test_batch_matches_generate_and_resumes(tmp_path, engine, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [json.dumps({"id": k, "prompt": v}) for k, v in PROMPTS.items()]
    lines.insert(1, "{not json")
    lines.append(json.dumps({"id": "empty", "prompt": ""}))
    inp.write_text("\n".join(lines) + "\n")
    # a previous run was killed: "a" is done, a line for "b" was half written
    out.write_text(json.dumps({"id": "a", "text": "DONE BEFORE"}) + "\n" + '{"id": "b", "te')
    assert main(["batch", str(inp), "--out", str(out), "-n", "6", "--parallel", "2", "--no-progress",
                 "--n-ctx", "512"]) == 0
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    by_id = {r["id"]: r for r in recs}
    assert len(recs) == len(by_id) == 5  # a (kept), the bad line, empty, b, c
    assert by_id["a"]["text"] == "DONE BEFORE"  # not redone
    assert "error" in by_id["2"] and "error" in by_id["empty"]
    for k in ("b", "c"):
        engine.reset()
        ref = engine.generate(PROMPTS[k], max_tokens=6, sampling=SamplingParams.greedy())
        assert by_id[k]["text"] == ref.text and by_id[k]["usage"]["completion_tokens"] == 6
        assert set(by_id[k]["speculation"]) == {"drafter", "draft_n", "draft_n_accepted"}
    capsys.readouterr()
    assert main(["batch", str(inp), "--out", str(out), "--no-progress"]) == 0  # nothing left to do
    assert "0 to do" in capsys.readouterr().err
    assert len(out.read_text().splitlines()) == 5


def test_a_bad_field_on_one_line_is_that_lines_error_and_the_run_goes_on(tmp_path, engine, capsys):
    """Each bad line is its own error record; a prompt longer than the context fails alone,
    its record the error's own message (it was prefixed with the class name), and the summary
    line counts it (it counted only the input errors)."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    bad = {"mt": {"max_tokens": "abc"}, "null": {"max_tokens": None}, "frac": {"max_tokens": 1.5},
           "neg": {"max_tokens": -1}, "temp": {"temperature": "hot"}, "cold": {"temperature": -1},
           "seed": {"seed": "x"}, "bool": {"seed": True}}  # fmt: skip
    lines = [json.dumps({"id": k, "prompt": "Hi", **v}) for k, v in bad.items()]
    lines.append(json.dumps({"id": "ok", "prompt": PROMPTS["a"], "max_tokens": 4, "temperature": 0, "seed": 3}))
    lines.append(json.dumps({"id": "long", "prompt": "word " * 600, "max_tokens": 4}))
    lines.append(json.dumps({"id": "chat", "messages": [{"role": "user", "content": "Hi"}]}))
    inp.write_text("\n".join(lines) + "\n")
    capsys.readouterr()
    assert main(["batch", str(inp), "--out", str(out), "--no-progress", "--n-ctx", "512"]) == 0
    assert f"wrote {len(bad) + 3} results to {out} ({len(bad) + 1} input errors, 1 failed to generate)" in capsys.readouterr().err
    by_id = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(by_id) == {*bad, "ok", "long", "chat"}
    assert 'not chat "messages"' in by_id["chat"]["error"], by_id["chat"]
    assert by_id["long"]["error"].startswith("the prompt has ") and "--n-ctx" in by_id["long"]["error"], by_id["long"]
    for n, k in enumerate(bad, start=1):
        field = next(iter(bad[k]))
        assert by_id[k]["error"].startswith(f"line {n}: ") and f'"{field}"' in by_id[k]["error"], by_id[k]
    engine.reset()
    assert by_id["ok"]["text"] == engine.generate(PROMPTS["a"], max_tokens=4, sampling=SamplingParams.greedy()).text


def test_out_the_input_file_or_parallel_0_is_refused_before_anything_is_written(tmp_path, capsys):
    import pytest

    inp = tmp_path / "in.jsonl"
    text = json.dumps({"id": "a", "prompt": "Hi"}) + "\n{not json\n"
    inp.write_text(text)
    with pytest.raises(SystemExit) as e:
        main(["batch", str(inp), "--out", str(tmp_path / "." / "in.jsonl"), "--no-progress"])
    assert "is the input file" in str(e.value)
    out = tmp_path / "out.jsonl"
    with pytest.raises(SystemExit) as e:
        main(["batch", str(inp), "--out", str(out), "--parallel", "0", "--no-progress"])
    assert "--parallel must be >= 1, got 0" in str(e.value)
    assert inp.read_text() == text and not out.exists()  # nothing written, nothing loaded
