"""The command line as users and scripts call it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from localspec.cli.main import main

DATA = Path(__file__).parent / "data"


def run_cli(*args, input=None):
    return subprocess.run(
        [sys.executable, "-m", "localspec", *args], input=input, capture_output=True, text=True, timeout=600
    )


def test_generate_json_schema():
    r = run_cli("generate", "The capital of France is", "--drafter", "ngram", "--max-tokens", "12",
                "--temperature", "0", "--seed", "1", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    for k in ("text", "token_ids", "finish_reason", "stats"):
        assert k in d
    for k in ("tokens_per_s", "mean_acceptance_length", "num_draft_tokens", "num_accepted_tokens"):
        assert k in d["stats"]
    assert len(d["token_ids"]) == 12 and d["finish_reason"] == "length"


def test_generate_prompt_from_stdin_and_file(tmp_path, capsys):
    r = run_cli("generate", "-n", "4", "--temperature", "0", "--json", input="Once upon a time")
    assert r.returncode == 0, r.stderr
    a = json.loads(r.stdout)
    f = tmp_path / "p.txt"
    f.write_text("Once upon a time")
    assert main(["generate", "-f", str(f), "-n", "4", "--temperature", "0", "--json", "--drafter", "none"]) == 0
    b = json.loads(capsys.readouterr().out)
    assert a["token_ids"] == b["token_ids"]


def test_generate_compare_reports_ratio(capsys):
    assert main(["generate", "a b c a b c a b c", "-n", "16", "--temperature", "0", "--compare", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["speed_ratio"] > 0
    from localspec.backend import exact_kernels

    if exact_kernels():  # the CPU backend with the exact kernels: greedy output is plain's, bit for bit
        assert d["identical_to_plain"] is True
    else:
        assert isinstance(d["identical_to_plain"], bool)


def test_compare_gives_the_pairs_spread_around_the_ratio():
    """A prompt that repeats itself, whole trees verified (--no-adaptive: drafting does not
    depend on the machine's load): the drafts save many steps, so the ratio is given, with
    the spread of the two ABBA pairs' ratios around it (the ratio of the medians of two runs
    each is the pairs' mediant: it lies between them)."""
    import re

    args = ["generate", "a b c a b c a b c", "-n", "32", "--temperature", "0", "--compare", "--no-adaptive"]
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr
    m = re.search(r"speed ratio of the medians (\d+\.\d\d)x \(pairs (\d+\.\d\d)-(\d+\.\d\d)x\)", r.stderr)
    assert m, r.stderr
    ratio, lo, hi = (float(x) for x in m.groups())
    assert lo <= ratio <= hi
    assert "no speedup to measure" not in r.stderr
    d = json.loads(run_cli(*args, "--json").stdout)
    c = d["compare"]
    assert c["no_speedup"] is None
    want = [s / p for s, p in zip(c["speculative_tokens_per_s"], c["plain_tokens_per_s"])]
    assert c["pair_ratios"] == pytest.approx(want, rel=1e-12)


def test_compare_repeats_do_not_draft_from_the_first_runs_output(capsys):
    """The drafting memory is on by default and holds the first run's output after it; the
    repeats keep out of it, so the second speculative run drafts what the first did (whole
    trees verified: the steps do not depend on the machine's load) instead of copying itself."""
    args = ["generate", "def quicksort(xs):", "-n", "40", "--temperature", "0", "--compare", "--no-adaptive", "--json"]
    assert main(args) == 0
    d = json.loads(capsys.readouterr().out)
    first, again = d["compare"]["speculative_steps"]
    assert first == again > 20
    assert main([*args, "--no-draft-memory"]) == 0
    assert json.loads(capsys.readouterr().out)["compare"]["speculative_steps"] == [first, again]


def test_compare_without_accepted_drafts_gives_no_ratio(capsys):
    """Nothing drafted (drafter none): the runs differ by the machine's noise only, so no
    "speed ratio" is printed; the reason and the pairs' spread are."""
    args = ["generate", "a b c a b c a b c", "-n", "8", "--temperature", "0", "--compare", "--drafter", "none"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "speed ratio" not in err
    assert "no speedup to measure: nothing was drafted in the speculative runs (they saved 0 of" in err
    assert "the pairs' ratios " in err
    assert main([*args, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["compare"]["no_speedup"] == "nothing was drafted" and len(d["compare"]["pair_ratios"]) == 2


def test_no_speedup_reason_counts_the_steps_the_drafts_saved():
    from localspec.stats import GenerationStats, no_speedup_reason

    def st(drafted, accepted, step_tokens, steps):
        return GenerationStats(num_draft_tokens=drafted, num_accepted_tokens=accepted, n_step_tokens=step_tokens, n_steps=steps)

    assert no_speedup_reason(st(0, 0, 128, 128)) == "nothing was drafted"
    assert no_speedup_reason(st(7, 0, 128, 128)) == "0 of 7 drafted tokens accepted"  # the make run case
    assert no_speedup_reason(st(40, 6, 128, 122)) == "6 of 40 drafted tokens accepted"  # 4.7% of steps saved
    assert no_speedup_reason(st(40, 7, 128, 121)) is None  # 5.5% saved
    assert no_speedup_reason(st(117, 110, 128, 40)) is None
    # summed over runs: one run that saved many steps does not hide another that saved none
    assert no_speedup_reason(st(7, 0, 128, 128), st(7, 0, 128, 128)) == "0 of 14 drafted tokens accepted"
    assert no_speedup_reason(st(7, 0, 128, 128), st(117, 110, 128, 40)) is None


def test_missing_model_is_a_clear_error(capsys, tmp_path):
    assert main(["generate", "hi", "-m", str(tmp_path / "missing.gguf")]) == 1
    err = capsys.readouterr().err
    assert "not found" in err


@pytest.mark.parametrize("command", ["generate", "batch", "bench"])
def test_arguments_are_checked_before_the_model_loads(tmp_path, command):
    """A missing model file or a negative token count is refused first: nothing is loaded and
    "loading model" is never printed before the error."""
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text('{"id": "1", "prompt": "hi"}\n')
    first = {"generate": ["generate", "hi"], "batch": ["batch", str(jobs), "--out", str(tmp_path / "o.jsonl")],
             "bench": ["bench", "--dataset", "code"]}[command]  # fmt: skip
    r = run_cli(*first, "-m", str(tmp_path / "missing.gguf"))
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("localspec: error: model file not found:"), r.stderr
    assert "loading model" not in r.stderr
    if command == "generate":  # a missing head is named as the head, with its flag (it was "model file not found")
        r = run_cli(*first, "--drafter", "eagle3", "--eagle", str(tmp_path / "nohead.gguf"))
        last = r.stderr.strip().splitlines()[-1]
        assert r.returncode == 1 and last.startswith("localspec: error: EAGLE-3 head file not found:") and "--eagle" in last, r.stderr
    r = run_cli(*first, "--max-tokens", "-5")
    least = 1 if command == "bench" else 0  # a bench of no tokens times nothing
    assert r.returncode == 2 and f"argument -n/--max-tokens: must be >= {least}, got -5" in r.stderr, r.stderr
    assert "loading model" not in r.stderr and "Traceback" not in r.stderr


def test_models_command(capsys):
    assert main(["models", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert Path(d["path"]).exists() and d["default_model"].endswith(".gguf")


def test_models_json_goes_before_or_after_the_action(capsys):
    """``models info --json`` was a usage error and ``models --json where`` printed a bare path."""
    outs = {}
    for argv in (["models", "--json", "where"], ["models", "where", "--json"], ["models", "--json", "info"],
                 ["models", "info", "--json"]):  # fmt: skip
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert out.count("\n") == 1, out  # one JSON line
        outs[tuple(argv)] = json.loads(out)
    assert outs[("models", "--json", "where")] == outs[("models", "where", "--json")] == {"path": outs[("models", "info", "--json")]["path"]}
    assert outs[("models", "--json", "info")] == outs[("models", "info", "--json")]
    assert main(["models", "where"]) == 0 and capsys.readouterr().out.strip() == outs[("models", "where", "--json")]["path"]


def test_bench_writes_json_table_and_plot(tmp_path, capsys):
    ds = tmp_path / "q.jsonl"
    rows = [
        {"question_id": 1, "category": "summarization", "turns": ["Summarize: the cat sat on the mat. The cat sat."]},
        {"question_id": 2, "category": "qa", "turns": ["What is the capital of France?"]},
        {"question_id": 3, "category": "writing", "turns": ["Write a poem about tea."]},
        {"question_id": 4, "category": "coding", "turns": ["Write hello world in C."]},
    ]
    ds.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "out"
    assert main(["bench", "--dataset", str(ds), "--per-category", "1", "-n", "8", "--out", str(out)]) == 0
    d = json.loads((out / "bench.json").read_text())
    assert set(d["categories"]) == {"summarization", "qa", "mt_bench"}
    for c in d["categories"].values():
        for k in ("speedup", "mean_acceptance_length", "identical_fraction", "t_host_us_per_step", "t_decode_us_per_step"):
            assert k in c
    assert len(d["prompts"]) == 3
    for p in d["prompts"]:
        assert {"category", "question_id", "identical", "divergence_gap"} <= set(p)
    assert (out / "bench.md").read_text().startswith("localspec bench")
    assert (out / "bench.png").exists()


def test_bench_repeats_run_abba_and_keep_the_median_run(tmp_path, capsys, monkeypatch):
    """--repeats 3: each prompt runs plain and speculative three times each, in ABBA order
    (the first kind alternating between prompts); the record keeps the median run of each
    kind, and the prompt's pair ratios (run i of plain with run i of speculative) are written."""
    from localspec.engine import Engine

    calls = []
    real = Engine.generate

    def spy(self, prompt, **kw):
        r = real(self, prompt, **kw)
        calls.append((kw.get("speculative", True), r.stats.t_generate_us))
        return r

    monkeypatch.setattr(Engine, "generate", spy)
    ds = tmp_path / "q.jsonl"
    rows = [
        {"question_id": 1, "category": "qa", "turns": ["The cat sat on the mat. The cat sat on the"]},
        {"question_id": 2, "category": "qa", "turns": ["One, two, three, four, one, two, three,"]},
    ]
    ds.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "out"
    args = ["bench", "--dataset", str(ds), "--per-category", "2", "-n", "6", "--repeats", "3", "--out", str(out)]
    assert main(args) == 0
    kinds = [spec for spec, _ in calls if spec is not None]
    assert kinds[:6] == [False, True, True, False, False, True], kinds  # prompt 1: plain first
    assert kinds[6:12] == [True, False, False, True, True, False], kinds  # prompt 2: spec first
    d = json.loads((out / "bench.json").read_text())
    assert d["config"]["repeats"] == 3
    for i, p in enumerate(d["prompts"]):
        runs = calls[6 * i : 6 * i + 6]
        plain = [t for s, t in runs if not s]
        spec = [t for s, t in runs if s]
        assert p["plain"]["t_decode_us"] == sorted(plain)[1]
        assert p["spec"]["t_decode_us"] == sorted(spec)[1]
        n_p, n_s = p["plain"]["n_tokens"], p["spec"]["n_tokens"]
        want = [(n_s / ts) / (n_p / tp) for tp, ts in zip(plain, spec)]
        assert p["pair_ratios"] == pytest.approx(want)


def test_bench_ngram_micro(capsys):
    from localspec import native

    assert main(["bench", "ngram", "--sizes", "1024,4096", "--steps", "20", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    indexes = ["NativeNgramIndex", "NgramIndex"] if native.AVAILABLE else ["NgramIndex"]
    assert [(r["index"], r["history_tokens"]) for r in d["ngram"]] == [(i, n) for i in indexes for n in (1024, 4096)]


def test_bench_kernels_micro(capsys):
    from localspec import native

    if not native.AVAILABLE:
        pytest.skip("native kernels not built")
    assert main(["bench", "kernels", "--reps", "1", "--vocab", "4096", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["native"]["available"]
    assert len(d["kernels"]) >= 10
    for k in d["kernels"]:
        assert k["same"], k["kernel"]
        assert k["native_us"] > 0 and k["reference_us"] > 0 and k["speedup"] > 0


@pytest.mark.parametrize("bad", [["generate"], ["bench"]])
def test_usage_errors(bad):
    r = run_cli(*bad, input="")
    assert r.returncode != 0


def test_a_missing_extra_is_one_line_naming_it():
    """`make run` installs the running extras only: a bench command whose client library is
    missing says which extra to install, in one line."""
    from localspec.cli.common import need_extra

    need_extra("httpx", "bench", "bench complete")  # installed here: nothing happens
    with pytest.raises(SystemExit) as e:
        need_extra("localspec_no_such_module", "bench", "bench complete")
    msg = str(e.value.code)
    assert msg.startswith("localspec: error: localspec bench complete needs the [bench] extra: "
                          "pip install 'localspec[bench]'") and "\n" not in msg  # fmt: skip


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity (Linux)")
def test_a_cost_table_measured_under_contention_is_one_note_line(tmp_path):
    """Real contention: `generate` and a busy loop pinned to the same CPU, with an empty cost
    cache: the calibration gets about half of the CPU's time, so the command says in one line
    what that means, that the table is not cached and what to do, and caches nothing."""
    cpu = min(os.sched_getaffinity(0))

    def pin():
        os.sched_setaffinity(0, {cpu})

    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=pin)
    try:
        r = subprocess.run([sys.executable, "-m", "localspec", "generate", "Hi", "-n", "1", "--max-tree-nodes", "4",
                            "-t", "1"], env={**os.environ, "LOCALSPEC_CACHE_DIR": str(tmp_path)}, preexec_fn=pin,
                           capture_output=True, text=True, timeout=600)  # fmt: skip
    finally:
        busy.kill()
        busy.wait()
    assert r.returncode == 0, r.stderr
    notes = [ln for ln in r.stderr.splitlines() if "cost table" in ln]
    assert len(notes) == 1, r.stderr
    assert notes[0].startswith("localspec: note: the decode cost table was measured while other work loaded")
    assert "not cached" in notes[0] and "on a quiet machine" in notes[0]
    assert not (tmp_path / "costs.json").exists()


def test_a_file_llama_cpp_cannot_load_is_one_error_line(tmp_path, random_head_path):
    """A head cut in half: llama.cpp's own error lines are in the one-line error, and not
    printed before it as well (they were: two ``localspec.llama:`` lines, then the error)."""
    cut = tmp_path / "half.gguf"
    data = random_head_path.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    r = run_cli("generate", "Hi", "-n", "2", "--drafter", "eagle3", "--eagle", str(cut))
    assert r.returncode == 1, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert "localspec.llama" not in r.stderr, r.stderr
    assert lines[-1].startswith(f"localspec: error: llama.cpp could not load {cut}: ") and "not within the file bounds" in lines[-1]


def test_generate_of_no_tokens_shows_no_mean_acceptance_length(capsys):
    """It printed "mean acceptance length 0.00", which docs/sampling.md says is never below 1."""
    assert main(["generate", "Hi", "-n", "0"]) == 0
    err = capsys.readouterr().err
    assert "mean acceptance length: no step ran, accepted 0/0 drafted" in err and "0.00" not in err, err
