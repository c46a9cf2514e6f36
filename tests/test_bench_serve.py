"""``localspec bench serve`` end to end on the real default model: a real in-process OpenAI
server, the official ``openai`` client, 1 and 2 clients, speculative and plain batched."""

import json

from localspec.cli.main import main


def test_bench_serve_reports_wall_and_decode_phase_rates_on_the_same_prompts(tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["bench", "serve", "--dataset", "code", "--clients", "1,2", "--prompts", "3", "-n", "6", "--repeats", "2",
               "--out", str(out)])  # fmt: skip
    assert rc == 0
    data = json.loads((out / "serve.json").read_text())
    rows = data["rows"]
    assert data["meta"]["same_prompts"] == 3
    assert sorted((r["clients"], r["mode"], r["repeat"]) for r in rows) == [
        (c, m, k) for c in (1, 2) for m in ("plain", "spec") for k in (0, 1)]  # fmt: skip
    # ABBA: one client runs spec, plain, plain, spec; two clients plain, spec, spec, plain
    assert [r["mode"] for r in rows if r["clients"] == 1] == ["spec", "plain", "plain", "spec"]
    assert [r["mode"] for r in rows if r["clients"] == 2] == ["plain", "spec", "spec", "plain"]
    for summ in data["summary"]:
        rs = {(r["mode"], r["repeat"]): r["tokens_per_s"] for r in rows if r["clients"] == summ["clients"]}
        pairs = [rs["spec", k] / rs["plain", k] for k in (0, 1)]
        assert summ["pair_ratios"] == pairs and summ["ratio"] == (pairs[0] + pairs[1]) / 2  # the median of two
        assert summ["plain"] == (rs["plain", 0] + rs["plain", 1]) / 2
    for r in rows:
        assert r["tokens"] == 3 * 6  # the same three requests at every concurrency (a base model does not stop)
        assert r["identical"] is True  # T=0: speculation and batching change nothing
        assert r["prompt_ms"] > 0 and r["predicted_ms"] > 0
        # the decode-phase aggregate is the completion tokens over the decode time per client
        assert abs(r["decode_tokens_per_s"] - r["tokens"] / (r["predicted_ms"] / 1e3 / r["clients"])) < 1e-6
        # each client thread sends its requests one after another, and a request's prefill and
        # decode lie inside its round trip: per client they fit in the run's wall time
        assert (r["prompt_ms"] + r["predicted_ms"]) / 1e3 / r["clients"] <= r["seconds"]
    table = capsys.readouterr().out
    assert "| clients | requests | plain tok/s | speculative tok/s | ratio | pair ratios | decode phase: plain |" in table
    assert "| 1 | 3 |" in table and "| 2 | 3 |" in table
    # rounds over every concurrency (a drift of the host falls on all of them)
    assert [(r["clients"], r["repeat"]) for r in rows] == [(1, 0), (1, 0), (2, 0), (2, 0), (1, 1), (1, 1), (2, 1), (2, 1)]
    assert "2 clients speculative / one client plain:" in table and "per round" in table


def test_bench_serve_chat_turns_reuse_the_first_turns_cells(tmp_path, capsys):
    qs = [
        {"question_id": 1, "category": "writing", "turns": ["Write two sentences about a lighthouse.", "Now make them rhyme."]},
        {"question_id": 2, "category": "math", "turns": ["What is 12 times 7?", "And 12 times 8?"]},
    ]
    data = tmp_path / "q.jsonl"
    data.write_text("\n".join(json.dumps(q) for q in qs) + "\n")
    out = tmp_path / "out"
    rc = main(["bench", "serve", "--dataset", str(data), "--clients", "1", "--prompts", "1", "-n", "12",
               "--chat-turns", "2", "--out", str(out)])  # fmt: skip
    assert rc == 0
    chat = json.loads((out / "serve.json").read_text())["chat_turns"]
    assert len(chat) == 2
    for r in chat:
        # turn 2 = turn 1's prompt, its reply and the new question: most of it was in the cache
        assert 0.5 * r["prompt_tokens"] < r["cached_tokens"] < r["prompt_tokens"]
        assert r["identical"] is True  # the reused cells change nothing (T=0)
        assert r["prompt_ms_cached"] > 0 and r["prompt_ms_uncached"] > 0
    assert "chat turn 2 (2 conversations, T=0)" in capsys.readouterr().out
