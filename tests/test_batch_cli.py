"""`localspec batch`: outputs equal one-at-a-time generation at T=0, errors recorded per line,
resumable by id (ids already in OUT are skipped; a half-written last line is cut)."""

import json
import os

import pytest

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
    assert "error" in by_id["line 2"] and "error" in by_id["empty"]
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
    assert by_id["ok"]["seed"] == 3


def test_out_the_input_file_or_parallel_0_is_refused_before_anything_is_written(tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    text = json.dumps({"id": "a", "prompt": "Hi"}) + "\n{not json\n"
    inp.write_text(text)
    with pytest.raises(SystemExit) as e:
        main(["batch", str(inp), "--out", str(tmp_path / "." / "in.jsonl"), "--no-progress"])
    assert "is the input file" in str(e.value)
    out = tmp_path / "out.jsonl"
    for n in ("0", "255"):  # 255 was refused only once the run had started, in the scheduler's words
        with pytest.raises(SystemExit) as e:
            main(["batch", str(inp), "--out", str(out), "--parallel", n, "--no-progress"])
        assert str(e.value) == f"localspec: error: --parallel must be in 1..254 (llama.cpp's 256 sequence ids), got {n}"
    assert inp.read_text() == text and not out.exists()  # nothing written, nothing loaded


def test_n_ctx_gives_each_request_its_context_past_4096(tmp_path, capsys):
    """``--n-ctx N`` is each request's context, past 4096 too; a prompt longer than N is that
    line's error, naming ``batch --n-ctx``."""
    with pytest.raises(SystemExit):
        main(["batch", "--help"])
    assert "tokens each request may hold" in " ".join(capsys.readouterr().out.split())
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps({"id": "long", "prompt": "word " * 4100}) + "\n"
                   + json.dumps({"id": "over", "prompt": "word " * 4300}) + "\n")  # fmt: skip
    assert main(["batch", str(inp), "--out", str(out), "-n", "2", "--parallel", "2", "--no-progress",
                 "--n-ctx", "4200"]) == 0  # fmt: skip
    by_id = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert "error" not in by_id["long"], by_id["long"]
    assert by_id["long"]["usage"]["prompt_tokens"] > 4096 and by_id["long"]["usage"]["completion_tokens"] == 2
    err = by_id["over"]["error"]
    assert err.startswith("the prompt has ") and "holds 4200" in err and "batch --n-ctx" in err, err
    assert "\n" not in err


def test_out_that_cannot_be_read_or_written_is_one_error_line_before_the_model_loads(tmp_path, capsys):
    """``--out`` a directory, or a path that cannot be created: one error line before the
    model loads, nothing created."""
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": "a", "prompt": "Hi"}) + "\n")
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("x")
    cases = {tmp_path / "dir": "cannot read --out", tmp_path / "file" / "out.jsonl": "cannot write --out",
             tmp_path / "nope" / "out.jsonl": "cannot write --out"}  # fmt: skip
    for out, want in cases.items():
        with pytest.raises(SystemExit) as e:
            main(["batch", str(inp), "--out", str(out), "--no-progress"])
        msg = str(e.value)
        assert msg.startswith(f"localspec: error: {want} {out}: ") and "\n" not in msg, msg
        assert capsys.readouterr().err == ""  # the one line only: no count of prompts, no load
    assert list((tmp_path / "dir").iterdir()) == [] and not (tmp_path / "nope").exists()
    with pytest.raises(SystemExit, match="--out is empty"):  # Path("") is ".", a directory
        main(["batch", str(inp), "--out", "", "--no-progress"])


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes read-only files: no permission error to see")
def test_out_without_write_permission_is_one_error_line_and_keeps_the_file(tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps({"id": "a", "prompt": "Hi"}) + "\n" + json.dumps({"id": "b", "prompt": "Yo"}) + "\n")
    for done in (json.dumps({"id": "a", "text": "x"}) + "\n", json.dumps({"id": "a", "text": "x"}) + '\n{"id": "b"'):
        out.write_text(done)  # the second: a half-written line to cut
        out.chmod(0o444)
        with pytest.raises(SystemExit) as e:
            main(["batch", str(inp), "--out", str(out), "--no-progress"])
        assert str(e.value).startswith(f"localspec: error: cannot write --out {out}: "), str(e.value)
        assert out.read_text() == done and "loading model" not in capsys.readouterr().err
        out.chmod(0o644)


def test_a_line_sets_sampling_as_the_command_line_does_and_names_what_it_cannot_set(tmp_path, engine):
    """A line takes the command line's common sampling settings, checked by the same rules;
    ``"seed": -1`` is a random seed as ``--seed -1`` is; a sampling setting a line cannot set is
    that line's error, naming what it takes; other keys are the user's own and change nothing."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    p = PROMPTS["a"]
    lines = {"top_p": {"top_p": 7}, "top_k": {"top_k": 1.5}, "seed": {"seed": -2},
             "grammar": {"grammar": 'root ::= "a"'}, "stop": {"stop": ["."]},
             "random": {"temperature": 0.8, "seed": -1}, "sampled": {"temperature": 0.8, "top_k": 1, "seed": 7},
             "meta": {"meta": {"source": "x"}, "category": "qa"}}  # fmt: skip
    inp.write_text("".join(json.dumps({"id": k, "prompt": p, "max_tokens": 6, **v}) + "\n" for k, v in lines.items()))
    assert main(["batch", str(inp), "--out", str(out), "--no-progress", "--n-ctx", "512"]) == 0
    by_id = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert by_id["top_p"]["error"] == 'line 1: "top_p": top_p must be in [0, 1], got 7.0'
    assert by_id["top_k"]["error"].startswith('line 2: "top_k" must be an integer')
    seed_err = by_id["seed"]["error"]
    assert seed_err.startswith('line 3: "seed" must be in 0..') and "-1 for a random seed" in seed_err, seed_err
    for n, k in ((4, "grammar"), (5, "stop")):
        assert by_id[k]["error"].startswith(f'line {n}: "{k}" cannot be set per line; a line takes "id", "prompt"')
        assert '"top_p"' in by_id[k]["error"] and '"seed"' in by_id[k]["error"]
    assert by_id["random"]["usage"]["completion_tokens"] == 6
    engine.reset()
    greedy = engine.generate(p, max_tokens=6, sampling=SamplingParams.greedy()).text
    engine.reset()
    assert by_id["sampled"]["text"] == greedy == engine.generate(
        p, max_tokens=6, sampling=SamplingParams(temperature=0.8, top_k=1, seed=7)).text  # fmt: skip
    assert by_id["meta"]["text"] == greedy
    assert by_id["sampled"]["seed"] == 7  # the drawn seed of "seed": -1 is recorded, and reproduces the line
    engine.reset()
    drawn = SamplingParams(temperature=0.8, seed=by_id["random"]["seed"])
    assert by_id["random"]["text"] == engine.generate(p, max_tokens=6, sampling=drawn).text


def test_a_line_that_is_not_utf8_is_that_lines_error_and_the_run_goes_on(tmp_path, engine, capsys):
    """Bytes that are not UTF-8 (a Latin-1 export, a stray binary line) fail their own line, as
    a line that is not JSON does: they made the whole run a UnicodeDecodeError traceback. Such
    a line's record has the id "line N", so it cannot hide the prompt whose id is N. A byte
    order mark at the start is skipped; a duplicate id is counted once in "to do" as in what
    is written, and the warning names it."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    good = json.dumps({"id": "ok", "prompt": PROMPTS["a"], "max_tokens": 3}).encode()
    three = json.dumps({"id": 3, "prompt": PROMPTS["c"], "max_tokens": 3}).encode()  # not the bad line 3's id
    inp.write_bytes(b"\xef\xbb\xbf" + good + b"\n" + b'{"id": "latin", "prompt": "caf\xe9"}\n\xff\xfe garbage\n' + good + b"\n"
                    + three + b"\n")  # fmt: skip
    capsys.readouterr()
    assert main(["batch", str(inp), "--out", str(out), "--no-progress", "--n-ctx", "512"]) == 0
    err = capsys.readouterr().err
    assert "5 prompts, 0 already in" in err and "4 to do" in err and f"wrote 4 results to {out} (2 input errors)" in err, err
    assert "1 duplicate ids in" in err and "('ok')" in err, err
    by_id = {r["id"]: r for r in map(json.loads, out.read_text(encoding="utf-8").splitlines())}
    assert by_id["line 2"]["error"] == "line 2 is not UTF-8 text (byte 30: b'\\xe9')", by_id["line 2"]
    assert by_id["line 3"]["error"] == "line 3 is not UTF-8 text (byte 0: b'\\xff')", by_id["line 3"]
    engine.reset()
    assert by_id["ok"]["text"] == engine.generate(PROMPTS["a"], max_tokens=3, sampling=SamplingParams.greedy()).text
    assert "text" in by_id["3"], by_id["3"]


def test_ids_that_are_not_strings_or_integers_and_lone_surrogates_are_that_lines_error(tmp_path, engine, capsys):
    """Ids were written as Python's ``str``: null became "None", true "True", [1] "[1]". A null
    id is now the line number (as no id); other kinds fail their line. A lone surrogate in a
    prompt was an exception text counted as a generation failure, and one in an id ended the
    whole run (UnicodeEncodeError writing OUT); both are now their line's error, as the servers
    answer them."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = ['{"id": null, "prompt": "Hi", "max_tokens": 2}', '{"id": true, "prompt": "Hi"}', '{"id": [1], "prompt": "Hi"}',
             '{"id": 1.5, "prompt": "Hi"}', '{"id": 7, "prompt": "Hi", "max_tokens": 2}', '{"id": "s", "prompt": "\\ud800x"}',
             '{"id": "\\udc00", "prompt": "Hi"}']  # fmt: skip
    inp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    capsys.readouterr()
    assert main(["batch", str(inp), "--out", str(out), "--no-progress", "--n-ctx", "256"]) == 0
    assert "(5 input errors)" in capsys.readouterr().err
    by_id = {r["id"]: r for r in map(json.loads, out.read_text(encoding="utf-8").splitlines())}
    assert set(by_id) == {"1", "line 2", "line 3", "line 4", "7", "s", "line 7"}
    assert by_id["1"]["text"] == by_id["7"]["text"] == engine.generate("Hi", max_tokens=2, sampling=SamplingParams.greedy()).text
    assert by_id["line 2"]["error"] == 'line 2: "id" must be a string or an integer, got true'
    assert by_id["line 3"]["error"] == 'line 3: "id" must be a string or an integer, got [1]'
    assert by_id["line 4"]["error"] == 'line 4: "id" must be a string or an integer, got 1.5'
    surrogate = "holds a lone UTF-16 surrogate (not valid Unicode text); send UTF-8 text"
    assert by_id["s"]["error"] == f'line 6: "prompt" {surrogate}'
    assert by_id["line 7"]["error"] == f'line 7: "id" {surrogate}'
