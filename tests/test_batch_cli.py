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
