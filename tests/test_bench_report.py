"""Bench bookkeeping without a model: per-prompt minimum ratios, the shipped code dataset."""

import json

import pytest

from localspec.bench.dataset import BUILTIN_DATASETS, load_questions, resolve_dataset, select_prompts
from localspec.bench.report import markdown_table
from localspec.bench.specbench import PromptRecord, RunRecord, summarize


def rec(cat, qid, plain_us, spec_us, n=100, peers=None):
    return PromptRecord(cat, cat, qid, 10, RunRecord(n, plain_us, plain_us, n), RunRecord(n, spec_us, spec_us, n // 2), True, peers=peers or {})


def peer(n, ms):
    return {"n_tokens": n, "t_decode_ms": ms, "t_prompt_ms": 1.0, "draft_n": 0, "draft_n_accepted": 0}


def test_min_prompt_ratio_is_the_worst_prompt_not_the_total():
    # totals: plain 3 s, spec 2.5 s (1.2x); prompt 2 alone is slower than plain (1/1.25 = 0.8x)
    rs = [
        rec("code", "a", 1e6, 0.5e6, peers={"none": peer(100, 1000.0), "ngram-mod": peer(100, 1000.0)}),
        rec("code", "b", 1e6, 1.25e6, peers={"none": peer(100, 1000.0), "ngram-mod": peer(100, 900.0)}),
        rec("code", "c", 1e6, 0.75e6, peers={"none": peer(100, 1000.0), "ngram-mod": peer(100, 1100.0)}),
        rec("qa", "d", 1e6, 0.9e6),
    ]
    s = summarize(rs)
    c = s["code"]
    assert c["speedup"] == pytest.approx(3.0 / 2.5)
    assert c["min_prompt_speedup"] == pytest.approx(0.8)
    assert c["min_prompt_id"] == "b"
    assert c["n_prompts_below_0_97"] == 1
    assert c["peers"]["ngram-mod"]["min_prompt_speedup"] == pytest.approx(1000.0 / 1100.0)
    assert c["best_peer_min_prompt_speedup"] == pytest.approx(1000.0 / 1100.0)
    assert s["qa"]["min_prompt_speedup"] == pytest.approx(1 / 0.9)
    table = markdown_table({"drafter": "ngram"}, s)
    assert "min prompt ratio" in table
    assert "| 0.80x (b) |" in table
    assert "| 0.91x |" in table  # the peer's worst prompt


def test_prompts_that_generated_nothing_do_not_count():
    rs = [rec("qa", "a", 1e6, 0.5e6), PromptRecord("qa", "qa", "z", 10, RunRecord(0, 1.0, 1.0, 1), RunRecord(0, 1.0, 1.0, 1), True)]
    assert summarize(rs)["qa"]["min_prompt_speedup"] == pytest.approx(2.0)


def test_shipped_code_dataset():
    path = resolve_dataset("code")
    assert path == BUILTIN_DATASETS["code"] and path.is_file()
    qs = load_questions("code")
    assert 30 <= len(qs) <= 50
    assert len({q["question_id"] for q in qs}) == len(qs)
    for q in qs:
        assert q["category"] == "code" and q["turns"][0].strip()
        src = q["source"]
        assert src["package"] and src["version"] and src["license"] and src["path"].endswith(".py")
    ps = select_prompts(qs, ["code"], 5)
    assert [p.question_id for p in ps] == [q["question_id"] for q in qs[:5]]


def test_heldout_code_set_shares_nothing_with_the_shipped_code_set():
    """``docs/results/heldout-code.jsonl``, the "never slower" table's held-out code prompts,
    reads as a `bench --dataset` file and takes no package (and so no prompt) of the shipped
    ``code`` set nor of the Python standard library."""
    import sysconfig
    from pathlib import Path

    held = load_questions(Path(__file__).parents[1] / "docs" / "results" / "heldout-code.jsonl")
    assert 12 <= len(held) <= 16 and len({q["question_id"] for q in held}) == len(held)
    assert all(q["category"] == "code" and q["turns"][0].strip() for q in held)
    shipped = {q["source"]["package"].lower() for q in load_questions("code")}
    packages = {q["source"]["package"].lower() for q in held}
    assert len(packages) >= 6 and not packages & shipped
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    assert not any((stdlib / q["source"]["path"]).exists() for q in held)
    assert [p.question_id for p in select_prompts(held, ["code"], 16)] == [q["question_id"] for q in held]


def test_a_missing_dataset_is_a_one_line_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a file nor a shipped dataset"):
        load_questions(tmp_path / "nope.jsonl")
    from localspec.cli.main import main

    with pytest.raises(SystemExit, match="localspec: error: --dataset: dataset"):
        main(["bench", "--dataset", str(tmp_path / "nope.jsonl")])


def test_code_dataset_is_package_data():
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert "*.jsonl" in pyproject["tool"]["setuptools"]["package-data"]["localspec.bench.data"]
    json.loads(resolve_dataset("code").read_text().splitlines()[0])


class _RememberingPeer:
    """Stands for a llama-server in a mode with memory across requests (ngram-mod's hash
    pool): a prompt it has served before comes back with every draft accepted and twice as
    fast. Records what it served."""

    def __init__(self):
        self.served = []

    def complete(self, tokens, n_predict):
        from localspec.bench.peer import PeerRun

        seen = tuple(tokens) in self.served
        self.served.append(tuple(tokens))
        return PeerRun([], n_predict, 500.0 if seen else 1000.0, 10.0, n_predict if seen else 0, n_predict if seen else 0)


def test_each_peer_repeat_runs_on_its_own_server(engine):
    """With ``peer_repeats`` > 1 every run of a prompt goes to a different server of the mode,
    so no run is drafted from an earlier run of the same prompt (with one server per mode the
    second run of each prompt drafted the first's answer: 1.89x instead of 1.10x on code)."""
    from localspec import SamplingParams
    from localspec.bench.dataset import BenchPrompt
    from localspec.bench.specbench import run_bench

    prompts = [BenchPrompt("code", "code", i, t) for i, t in enumerate(["def add(a, b):", "import os\n"])]
    servers = [_RememberingPeer(), _RememberingPeer()]
    recs = run_bench(engine, prompts, max_tokens=3, sampling=SamplingParams.greedy(), peers={"ngram-mod": servers}, peer_repeats=2)
    for s in servers:
        assert len(s.served) == 2 and len(set(s.served)) == 2  # each prompt once per server
    assert all(r.peers["ngram-mod"]["t_decode_ms"] == 1000.0 and r.peers["ngram-mod"]["draft_n"] == 0 for r in recs)
    # one server for both repeats: the artefact this guards against
    one = _RememberingPeer()
    recs = run_bench(engine, prompts[:1], max_tokens=3, sampling=SamplingParams.greedy(), peers={"ngram-mod": [one]}, peer_repeats=2)
    assert recs[0].peers["ngram-mod"]["t_decode_ms"] == 500.0


def test_chat_format_gives_each_question_as_a_user_turn(engine):
    """``bench --chat-format``: the model (and every peer) gets each question as one user turn
    of the conversation, the tokens ``chat`` and ``serve`` would give it (the plain transcript
    for the default base model), not the bare question."""
    from localspec import SamplingParams
    from localspec.bench.dataset import BenchPrompt, as_chat
    from localspec.bench.specbench import run_bench
    from localspec.tui.chat_format import chat_prompt_tokens

    bare = [BenchPrompt("qa", "qa", 0, "Why is the sky blue?")]
    peer = _RememberingPeer()
    run_bench(engine, as_chat(bare, engine.model), max_tokens=2, sampling=SamplingParams.greedy(), peers={"ngram-mod": [peer]})
    want = chat_prompt_tokens(engine.model, "Why is the sky blue?")
    assert peer.served == [tuple(want)]
    assert want != engine.tokenize("Why is the sky blue?")
    assert "Why is the sky blue?" in engine.model.detokenize(want)


class _ScriptedEngine:
    """Stands in for the engine where only the timing statistic is under test: each call of
    ``generate`` returns the next scripted decode time (µs) for its kind, same tokens."""

    def __init__(self, plain_us, spec_us):
        self.times = {False: list(plain_us), True: list(spec_us)}
        self.order = []

    def tokenize(self, text):
        return [1, 2, 3]

    def reset(self):
        pass

    def generate(self, tokens, *, max_tokens, sampling, speculative):
        from types import SimpleNamespace

        from localspec.stats import GenerationStats

        self.order.append("spec" if speculative else "plain")
        t = self.times[speculative].pop(0)
        st = GenerationStats(n_generated_tokens=96, t_generate_us=t, t_total_us=t, n_steps=96)
        return SimpleNamespace(token_ids=list(range(96)), stats=st, logprobs=None)


def test_a_prompt_ratio_is_the_median_of_its_abba_pairs_not_set_by_one_fast_burst():
    """Runs in ABBA order pair up (run i of each kind are adjacent); the prompt's ratio is the
    median pair ratio. One plain run that caught a fast burst of the host (0.83 s against
    ~3.3 s, measured on this VM) made the fastest-of statistic call a 1.0x prompt 0.25x."""
    from localspec import SamplingParams
    from localspec.bench.dataset import BenchPrompt
    from localspec.bench.specbench import prompt_speedup, run_bench

    plain = [3.30e6, 0.83e6, 3.30e6, 3.30e6]  # run 2 of plain caught a burst
    spec = [3.30e6, 3.30e6, 3.30e6, 3.30e6]
    eng = _ScriptedEngine(plain, spec)
    recs = run_bench(eng, [BenchPrompt("qa", "qa", 0, "q")], max_tokens=96, sampling=SamplingParams.greedy(), repeats=4)
    assert eng.order == ["plain", "spec", "spec", "plain", "plain", "spec", "spec", "plain"]
    r = recs[0]
    assert r.pair_ratios == pytest.approx([1.0, 0.83 / 3.30, 1.0, 1.0])
    assert prompt_speedup(r) == pytest.approx(1.0)
    # each kind's record is its median run, so the category total is not set by the burst either
    assert r.plain.t_decode_us == 3.30e6
    assert summarize(recs)["qa"]["speedup"] == pytest.approx(1.0)
    # a prompt that really is slower stays slower: every pair says 0.8x
    eng = _ScriptedEngine([1e6] * 4, [1.25e6] * 4)
    r = run_bench(eng, [BenchPrompt("qa", "qa", 0, "q")], max_tokens=96, sampling=SamplingParams.greedy(), repeats=4)[0]
    assert prompt_speedup(r) == pytest.approx(0.8)
