"""``localspec bench serve`` end to end on the real default model: real in-process OpenAI
servers, the official ``openai`` client, 1 and 2 clients, plain batched and each drafter."""

import json
import math
from pathlib import Path

import pytest

from localspec.bench.serve import mode_order, summarize
from localspec.cli.main import main

# short one-turn prompts (question.jsonl's format): what these tests check is the bench's
# bookkeeping, and the built-in code prompts' prefills took most of their time (4-7 s a row)
SHORT = [
    {"question_id": 1, "category": "code", "turns": ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]},
    {"question_id": 2, "category": "writing", "turns": ["The three largest cities of Europe are"]},
    {"question_id": 3, "category": "code", "turns": ["import os\n\n\ndef list_python_files(root):\n"]},
]


def short_dataset(tmp_path) -> str:
    path = tmp_path / "short.jsonl"
    path.write_text("\n".join(json.dumps(q) for q in SHORT) + "\n")
    return str(path)


def test_bench_serve_reports_wall_and_decode_phase_rates_on_the_same_prompts(tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["bench", "serve", "--dataset", short_dataset(tmp_path), "--clients", "1,2", "--prompts", "3", "-n", "6",
               "--repeats", "2", "--out", str(out)])  # fmt: skip
    assert rc == 0
    data = json.loads((out / "serve.json").read_text())
    rows = data["rows"]
    assert data["meta"]["same_prompts"] == 3
    assert sorted((r["clients"], r["mode"], r["repeat"]) for r in rows) == [
        (c, m, k) for c in (1, 2) for m in ("ngram", "plain") for k in (0, 1)]  # fmt: skip
    # ABBA: one client runs ngram, plain, plain, ngram; two clients plain, ngram, ngram, plain
    assert [r["mode"] for r in rows if r["clients"] == 1] == ["ngram", "plain", "plain", "ngram"]
    assert [r["mode"] for r in rows if r["clients"] == 2] == ["plain", "ngram", "ngram", "plain"]
    for summ in data["summary"]:
        rs = {(r["mode"], r["repeat"]): r["tokens_per_s"] for r in rows if r["clients"] == summ["clients"]}
        pairs = [rs["ngram", k] / rs["plain", k] for k in (0, 1)]
        assert summ["pair_ratios"] == pairs and summ["ratio"] == (pairs[0] + pairs[1]) / 2  # the median of two
        assert summ["plain"] == (rs["plain", 0] + rs["plain", 1]) / 2
        # the one-drafter keys are the first drafter's entry
        assert summ["drafter"] == "ngram" and summ["spec"] == summ["drafters"]["ngram"]["tokens_per_s"]
        assert summ["spec"] == (rs["ngram", 0] + rs["ngram", 1]) / 2
    for r in rows:
        assert r["tokens"] == 3 * 6  # the same three requests at every concurrency (a base model does not stop)
        assert r["identical"] is True  # T=0: speculation and batching change nothing
        assert r["texts_sha256"] == rows[0]["texts_sha256"]  # the same prompts at every concurrency
        assert r["prompt_ms"] > 0 and r["predicted_ms"] > 0
        # the decode-phase aggregate is the completion tokens over the decode time per client
        assert abs(r["decode_tokens_per_s"] - r["tokens"] / (r["predicted_ms"] / 1e3 / r["clients"])) < 1e-6
        # each client thread sends its requests one after another, and a request's prefill and
        # decode lie inside its round trip: per client they fit in the run's wall time
        assert (r["prompt_ms"] + r["predicted_ms"]) / 1e3 / r["clients"] <= r["seconds"]
    table = capsys.readouterr().out
    assert "| clients | requests | drafter | plain tok/s | speculative tok/s | ratio | pair ratios | decode phase: plain |" in table
    assert "| 1 | 3 | ngram |" in table and "| 2 | 3 | ngram |" in table
    # rounds over every concurrency (a drift of the host falls on all of them)
    assert [(r["clients"], r["repeat"]) for r in rows] == [(1, 0), (1, 0), (2, 0), (2, 0), (1, 1), (1, 1), (2, 1), (2, 1)]
    assert "2 clients ngram / one client plain:" in table and "per round" in table


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


def test_bench_serve_runs_every_drafter_beside_plain_with_identical_texts(tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["bench", "serve", "--dataset", short_dataset(tmp_path), "--drafters", "ngram,auto", "--clients", "1,2",
               "--prompts", "2", "-n", "8", "--repeats", "2", "--chat-turns", "0", "--out", str(out)])  # fmt: skip
    assert rc == 0
    data = json.loads((out / "serve.json").read_text())
    rows = data["rows"]
    assert data["meta"]["drafters"] == ["ngram", "auto"]
    # rounds over the concurrencies, within each the modes forward then backward, rotated
    assert [(r["clients"], r["repeat"], r["mode"]) for r in rows] == [
        (c, k, m) for k in (0, 1) for i, c in enumerate((1, 2)) for m in mode_order(["ngram", "auto"], i + k)]  # fmt: skip
    assert [r["mode"] for r in rows[:6]] == ["ngram", "auto", "plain", "plain", "auto", "ngram"]
    # T=0: every mode's texts are plain decoding's, at every concurrency (the same two prompts)
    assert {r["texts_sha256"] for r in rows} == {rows[0]["texts_sha256"]}
    assert all(r["identical"] is True and r["tokens"] == 2 * 8 for r in rows)
    for summ in data["summary"]:
        rs = {(r["mode"], r["repeat"]): r for r in rows if r["clients"] == summ["clients"]}
        for name in ("ngram", "auto"):
            d = summ["drafters"][name]
            pairs = [rs[name, k]["tokens_per_s"] / rs["plain", k]["tokens_per_s"] for k in (0, 1)]
            assert d["pair_ratios"] == pairs and d["ratio"] == (pairs[0] + pairs[1]) / 2
            assert d["identical"] is True
        assert summ["ratio"] == summ["drafters"]["ngram"]["ratio"]  # the first drafter fills the old keys
    table = capsys.readouterr().out
    assert "| 1 | 2 | ngram |" in table and "| 1 | 2 | auto |" in table and "| 2 | 2 | auto |" in table
    assert "2 clients auto / one client plain:" in table


def test_mode_order_alternates_and_rotates():
    assert [mode_order(["ngram"], t) for t in range(4)] == [["ngram", "plain"], ["plain", "ngram"]] * 2  # ABBA
    orders = [mode_order(["a", "b", "c"], t) for t in range(6)]
    assert orders[:2] == [["a", "b", "c", "plain"], ["plain", "c", "b", "a"]]
    for t in range(0, 6, 2):  # forward then backward: every mode has the same mean place
        assert orders[t + 1] == orders[t][::-1]
    assert [o[0] for o in orders[::2]] == ["a", "b", "c"]  # each drafter goes first in turn


def test_summarize_reads_the_one_drafter_files_of_docs_serve_md():
    # rows of the older format (mode "spec") give the summary stored beside them
    data = json.loads((Path(__file__).parent.parent / "docs/results/serve-rounds3.json").read_text())
    new = summarize(data["rows"])
    assert len(new) == len(data["summary"])
    for old, now in zip(data["summary"], new):
        for k, v in old.items():
            if isinstance(v, float) and math.isnan(v):  # a ratio with no plain decode phase: NaN in both
                assert math.isnan(now[k]), k
            else:
                assert now[k] == v, k
        assert now["drafter"] == "spec" and now["drafters"]["spec"]["ratio"] == old["ratio"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--drafters", "ngram,none"], "'none' is not a drafter"),
        (["--drafters", "ngram,ngram"], "names a drafter twice"),
        (["--drafters", "ngram", "--eagle", "h.gguf"], "--eagle applies to none of the drafters ngram"),
    ],
)
def test_bench_serve_bad_drafters_is_one_line(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as e:
        main(["bench", "serve", "--dataset", "code", "--out", str(tmp_path), *args])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_drafter_option_flags_go_to_the_drafters_that_take_them():
    import argparse

    from localspec.cli.common import drafter_options
    from localspec.policy import TreeShape

    a = argparse.Namespace(draft_model=None, draft_n_ctx=None, eagle="h.gguf", medusa=None, draft_shape="6,1,7")
    got = drafter_options(a, ["ngram", "auto", "eagle3"])
    shape = TreeShape(6, 1, 7, min_score=0.0)
    assert got == {"ngram": {}, "auto": {"eagle": "h.gguf"}, "eagle3": {"eagle": "h.gguf", "draft_shape": shape}}
