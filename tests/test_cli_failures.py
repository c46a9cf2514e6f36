"""Failures a new user reached from the command line and the core (issue 15): each test
fails without its fix. Ctrl-C is tested with real SIGINTs sent to a real ``localspec``
process at several moments, each chosen by waiting for an output line (never a pause)."""

import codecs
import json
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from conftest import frozen_cost_model
from localspec import Engine, SamplingParams
from localspec.cli.main import main
from localspec.server.fields import RequestError, get_float, get_int

PROMPT = "The capital of France is"


def cli_error(capsys, argv) -> str:
    """Run ``main(argv)``; it must fail with one ``localspec: error:`` line and no traceback."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    msg = str(e.value.code)
    assert msg.startswith("localspec: error: ") and "\n" not in msg, msg
    assert "Traceback" not in capsys.readouterr().err
    return msg


# -- one-line errors instead of tracebacks ------------------------------------------------------


def test_missing_grammar_file(capsys, tmp_path):
    msg = cli_error(capsys, ["generate", PROMPT, "--grammar-file", str(tmp_path / "nope.gbnf")])
    assert "--grammar-file" in msg and "nope.gbnf" in msg


def test_binary_prompt_file(capsys, tmp_path):
    f = tmp_path / "p.bin"
    f.write_bytes(b"abc\xff\xfe\x00\x81")
    msg = cli_error(capsys, ["generate", "-f", str(f)])
    assert "not UTF-8" in msg and "p.bin" in msg


def test_a_prompt_argument_and_a_prompt_file_are_refused_together(capsys, tmp_path):
    """Both a prompt and ``--file``: one line naming both, not the argument silently dropped."""
    f = tmp_path / "p.txt"
    f.write_text("a longer prompt from the file")
    msg = cli_error(capsys, ["generate", "hi", "-f", str(f), "-n", "2"])
    assert "not both" in msg and "'hi'" in msg and "p.txt" in msg, msg


def test_binary_prompt_on_stdin():
    r = subprocess.run([sys.executable, "-m", "localspec", "generate", "-n", "2"], input=b"\xff\xfe", capture_output=True, timeout=300)
    err = r.stderr.decode()
    assert r.returncode == 1 and err.strip() == "localspec: error: standard input is not UTF-8 text (byte 0)", err


def test_missing_bench_dataset(capsys, tmp_path):
    msg = cli_error(capsys, ["bench", "--dataset", str(tmp_path / "question.jsonl")])
    assert "--dataset" in msg and "question.jsonl" in msg


def test_bench_repeats_below_one(capsys):
    msg = cli_error(capsys, ["bench", "--dataset", "code", "--repeats", "0"])
    assert msg == "localspec: error: --repeats must be at least 1, got 0", msg


def test_bench_versus_refuses_bad_input_before_loading(capsys, tmp_path, monkeypatch):
    """``bench drafters --versus``: a missing or malformed dataset, an unknown drafter, a
    ``name#k`` label, ``none`` and an empty file each give one line, before a model loads."""
    import localspec.backend

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(localspec.backend, "Model", no_load)
    good = tmp_path / "q.jsonl"
    good.write_text(json.dumps({"category": "qa", "turns": ["Name a river."]}) + "\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"category": "qa", "turns": [123]}) + "\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    versus = ["bench", "drafters", "--versus"]
    for argv, want in [
        ([*versus, "ngram,auto", "--dataset", str(tmp_path / "nope.jsonl")], "nope.jsonl"),
        ([*versus, "ngram,auto", "--dataset", str(tmp_path)], "is not a file"),
        ([*versus, "ngram,auto", "--dataset", str(bad)], "bad.jsonl:1: not a Spec-Bench question ('turns' must be"),
        ([*versus, "ngram,auto", "--dataset", str(empty)], "the dataset has no questions"),
        ([*versus, "ngram,bogus", "--dataset", str(good)], "'bogus' is not a drafter to compare"),
        ([*versus, "ngram,ngram#2", "--dataset", str(good)], "'ngram#2' is not a drafter to compare"),
        ([*versus, "none,ngram", "--dataset", str(good)], "plain decoding always runs"),
        (["bench", "drafters", "--dataset", str(good), "--repeats", "2"], "--repeats goes with --versus"),
        (["bench", "drafters", "--chat-format"], "--per-category and --chat-format choose prompts of --dataset"),
        (["bench", "drafters", "--per-category", "2"], "--per-category and --chat-format choose prompts of --dataset"),
        (["bench", "drafters", "--dataset", str(bad)], "bad.jsonl:1: not a Spec-Bench question"),
    ]:
        assert want in cli_error(capsys, argv), argv
    for flag, value in (("--per-category", "0"), ("--per-category", "-1"), ("-n", "0")):
        with pytest.raises(SystemExit) as e:  # argparse: usage and one error line, exit 2
            main([*versus, "ngram,auto", "--dataset", str(good), flag, value])
        assert e.value.code == 2 and "must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # the head's levels: at least one pass over the prompts
        main(["bench", "drafters", "--rounds", "0"])
    assert e.value.code == 2 and "must be >= 1" in capsys.readouterr().err


def test_complete_serve_off_loopback_needs_an_api_key(capsys):
    """As `serve`: the editor server listens beyond this machine only behind a key."""
    msg = cli_error(capsys, ["complete", "--serve", "--host", "0.0.0.0", "--port", "0"])
    assert msg == "localspec: error: listening on 0.0.0.0 (not this machine only) needs --api-key KEY", msg


def test_derive_draft_on_a_truncated_gguf(capsys, tmp_path, model_path):
    cut = tmp_path / "cut.gguf"
    with open(model_path, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(40 * 2**20))
    msg = cli_error(capsys, ["models", "derive-draft", str(cut), "--layers", "4", "--out", str(tmp_path / "d.gguf")])
    assert "truncated" in msg and str(cut) in msg
    assert not (tmp_path / "d.gguf").exists()


def test_range_errors_name_their_bounds():
    for fn, body, lo, hi, want in [
        (get_float, {"temperature": -1}, 0.0, None, '"temperature" must be >= 0.0, got -1.0'),
        (get_float, {"top_p": 2}, 0.0, 1.0, '"top_p" must be in [0.0, 1.0], got 2.0'),
        (get_int, {"n": 7}, None, 5, '"n" must be <= 5, got 7'),
    ]:
        with pytest.raises(RequestError) as e:
            fn(body, next(iter(body)), None, lo, hi)
        assert e.value.message == want


# -- --seed -1, --logprobs without --json ------------------------------------------------------


def test_seed_minus_one_draws_a_seed_and_reports_it(capsys):
    seeds = []
    for _ in range(2):
        assert main(["generate", PROMPT, "-n", "3", "--seed", "-1", "--temperature", "0.8", "--json", "--drafter", "none"]) == 0
        seeds.append(json.loads(capsys.readouterr().out)["stats"]["seed"])
    assert all(isinstance(s, int) and s >= 0 for s in seeds) and seeds[0] != seeds[1]
    msg = cli_error(capsys, ["generate", PROMPT, "--seed", "-2"])
    assert "-1 for a random seed" in msg
    msg = cli_error(capsys, ["generate", PROMPT, "--seed", str(1 << 64)])  # said "non-negative", -1 being fine
    assert f"--seed must be in 0..{(1 << 64) - 1}, or -1 for a random seed; got {1 << 64}" in msg


def test_a_draft_shape_below_one_names_the_value(capsys):
    """``--draft-shape 0,1,7`` said only "takes DEPTH,WIDTH,NODES", as for text that is no shape."""
    msg = cli_error(capsys, ["generate", PROMPT, "--drafter", "eagle3", "--draft-shape", "0,1,0"])
    assert msg.endswith("--draft-shape 0,1,0: depth 0, nodes 0; each must be at least 1 (e.g. 6,1,7)"), msg
    msg = cli_error(capsys, ["generate", PROMPT, "--drafter", "eagle3", "--draft-shape", "6,x"])
    assert "takes DEPTH,WIDTH,NODES" in msg
    # a value with a leading minus sign reaches the same check (argparse took it for an option
    # and said only "expected one argument"); a real option after the flag is still an option
    msg = cli_error(capsys, ["generate", PROMPT, "--drafter", "eagle3", "--draft-shape", "-1,1,2"])
    assert msg.endswith("--draft-shape -1,1,2: depth -1; each must be at least 1 (e.g. 6,1,7)"), msg
    with pytest.raises(SystemExit) as e:
        main(["generate", PROMPT, "--draft-shape", "-n", "3"])
    assert e.value.code == 2 and "--draft-shape: expected one argument" in capsys.readouterr().err


def test_logprobs_without_json_are_printed(capsys):
    assert main(["generate", PROMPT, "-n", "3", "--temperature", "0", "--logprobs", "2", "--drafter", "none"]) == 0
    err = capsys.readouterr().err
    lines = err[err.index("log-probabilities") :].splitlines()
    assert len(lines) == 4, err  # a heading and one line per token
    for i, line in enumerate(lines[1:]):
        head, top = line.split(" | ")
        assert head.split()[0] == str(i) and float(head.rsplit(": ", 1)[1]) <= 0.0
        assert len(top.split(", ")) == 2


# -- --special and a prompt that starts with <bos> -----------------------------------------------


def test_special_prompt_starting_with_bos_gets_one_bos(engine, capsys):
    bos = engine.model.bos
    plain = engine.generate("Hello there", max_tokens=1, sampling=SamplingParams.greedy())
    marked = engine.generate("<bos>Hello there", max_tokens=1, sampling=SamplingParams.greedy(), parse_special=True)
    assert marked.stats.n_prompt_tokens == plain.stats.n_prompt_tokens
    assert marked.token_ids == plain.token_ids
    two = engine.model.tokenize("<bos><bos>Hello there", add_special=False, parse_special=True)
    assert two[:2] == [bos, bos]
    explicit = engine.generate("<bos><bos>Hello there", max_tokens=1, sampling=SamplingParams.greedy(), parse_special=True)
    assert explicit.stats.n_prompt_tokens == len(two)  # what the text says, nothing added
    assert main(["generate", "<bos>Hello there", "--special", "-n", "1", "--temperature", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["n_prompt_tokens"] == plain.stats.n_prompt_tokens


# -- --n-ctx is the size asked for ---------------------------------------------------------------


def test_small_n_ctx_holds_the_size_asked_for(model, capsys):
    e = Engine(model, drafter="ngram", n_ctx=20, cost_model=frozen_cost_model())
    try:
        assert e.n_ctx == 20 and e.ctx.n_ctx_allocated >= 256  # llama.cpp rounds up; we do not use it
        r = e.generate("Once upon a time", max_tokens=64, sampling=SamplingParams.greedy())
        # the KV cache holds at most 20 tokens; the last generated token needs no cell
        assert r.finish_reason == "length" and r.stats.n_prompt_tokens + r.stats.n_generated_tokens == 21
        assert e.cache.n_past <= 20
    finally:
        e.close()
    assert main(["generate", "Once upon a time", "--n-ctx", "20", "-n", "64", "--temperature", "0", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["stats"]["n_prompt_tokens"] + len(d["token_ids"]) == 21


def test_threads_below_one_and_a_draft_drafter_without_its_model_are_refused_before_loading(capsys, tmp_path):
    """``-t 0`` / ``-t -1`` ran with llama.cpp's own choice, and ``--drafter draft`` without
    ``--draft-model`` said so only after the target had loaded (a new user's report)."""
    for t in ("0", "-1"):
        msg = cli_error(capsys, ["generate", PROMPT, "-t", t])
        assert msg.startswith(f"localspec: error: -t/--threads must be >= 1, got {t}"), msg
    assert cli_error(capsys, ["generate", PROMPT, "--stop", ".", "--stop", ""]) == "localspec: error: --stop strings must not be empty"
    assert main(["generate", PROMPT, "--drafter", "draft"]) == 1
    err = capsys.readouterr().err
    assert "needs a draft model: --draft-model PATH" in err and "loading model" not in err, err
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "Hi"}\n')
    cli_error(capsys, ["batch", str(inp), "--out", str(tmp_path / "out.jsonl"), "-t", "0"])
    assert not (tmp_path / "out.jsonl").exists()


def test_micro_benchmarks_refuse_sizes_steps_and_repeats_they_cannot_run(capsys):
    """They were ZeroDivisionError, ValueError, IndexError, StatisticsError and MemoryError
    tracebacks (a new user's report); a history of 10^11 tokens was accepted and grew a Python
    list for minutes towards all of the machine's memory."""
    cases = {("ngram", "--sizes", "0"): "--sizes takes whole numbers from 1 to 16777216", ("ngram", "--sizes", "abc"): "got 'abc'",
             ("ngram", "--sizes", "1024,99999999999"): "--sizes takes whole numbers from 1 to 16777216, comma-separated; got '1024,99999999999'",
             ("ngram", "--memory-sizes", "99999999999"): "--memory-sizes takes whole numbers from 0 to 16777216",
             ("ngram", "--steps", "99999999999"): "--steps must be <= 16777216, got 99999999999",
             ("ngram", "--steps", "0"): "--steps must be >= 1, got 0", ("kernels", "--reps", "0"): "--reps must be >= 1",
             ("kernels", "--vocab", "0"): "--vocab must be >= 64, got 0", ("features", "--sizes", "0"): "--sizes takes"}  # fmt: skip
    for argv, want in cases.items():
        assert want in cli_error(capsys, ["bench", *argv]), argv


def test_rpc_worker_refuses_a_taken_port_a_bad_port_and_bad_threads_in_one_line(capsys):
    """rpc-server itself printed its banner, then "Failed to create server socket", and the
    command exited 0; a bad port or thread count was llama.cpp's raw text (a new user's report)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        msg = cli_error(capsys, ["rpc-worker", "--port", str(port)])
        assert msg == f"localspec: error: cannot listen on 127.0.0.1:{port}: Address already in use", msg
    assert "--port must be in 1..65535, got 99999" in cli_error(capsys, ["rpc-worker", "--port", "99999"])
    assert "-t/--threads must be >= 1, got -3" in cli_error(capsys, ["rpc-worker", "-t", "-3"])


def test_a_random_head_with_no_draft_vocabulary_names_the_flag(capsys, tmp_path):
    msg = cli_error(capsys, ["models", "random-eagle3", "default", "--out", str(tmp_path / "h.gguf"), "--draft-vocab", "0"])
    assert msg == "localspec: error: --draft-vocab must be >= 1, got 0" and not (tmp_path / "h.gguf").exists()  # was "d2t is empty"


def test_a_memory_file_or_usage_folder_that_cannot_be_used_and_an_empty_rpc_are_refused_before_loading(capsys, tmp_path):
    """``--draft-memory`` in a missing folder ran the whole generation and then said "not
    saved" with status 0; ``--record-usage`` naming a file was refused after the load with
    "[Errno 17] File exists"; ``--rpc ''`` ran locally without a word (a new user's report)."""
    msg = cli_error(capsys, ["generate", PROMPT, "--draft-memory", str(tmp_path / "nope" / "m.lsmem")])
    assert "the folder" in msg and "does not exist" in msg and "loading model" not in capsys.readouterr().err, msg
    import argparse

    from localspec.cli.common import usage_log_from_args

    (tmp_path / "afile").write_text("x")  # serve and chat make their engine (and this log) before the model loads
    with pytest.raises(SystemExit, match="is a file; give a folder"):
        usage_log_from_args(argparse.Namespace(record_usage=str(tmp_path / "afile"), record_usage_mib=8.0))
    assert cli_error(capsys, ["generate", PROMPT, "--rpc", ""]).startswith("localspec: error: --rpc is empty")


def test_serve_refuses_a_request_context_beyond_the_training_context_before_loading(capsys, tmp_path):
    """``serve --ctx-per-request`` and ``batch --n-ctx`` (each a request's context) above the
    model's training context: one line before loading (serve: was "loading model..." and then
    the kernel's OOM killer, with no message; batch: it ran past the training context)."""
    msg = cli_error(capsys, ["serve", "--port", "0", "--ctx-per-request", "1000000", "--parallel", "8"])
    assert msg == ("localspec: error: --ctx-per-request 1000000 is more than the model's training context of "
                   "32768 tokens: give at most 32768"), msg  # fmt: skip
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "Hi"}\n')
    msg = cli_error(capsys, ["batch", str(inp), "--out", str(tmp_path / "out.jsonl"), "--n-ctx", "40000"])
    assert msg == ("localspec: error: --n-ctx 40000 is more than the model's training context of "
                   "32768 tokens: give at most 32768"), msg  # fmt: skip
    assert not (tmp_path / "out.jsonl").exists()


def test_a_kv_cache_larger_than_the_memory_available_is_refused_before_it_is_allocated(model, capsys):
    from localspec.backend.context import available_memory, kv_bytes_per_token

    avail, per_token = available_memory(), kv_bytes_per_token(model, 30)
    if avail is None:
        pytest.skip("no MemAvailable in /proc/meminfo: the check is skipped")
    assert per_token == 18 * 256 * 2 * 2  # layers x (K + V of one KV head of 256) x 2 bytes
    # any surface, through the one context creation: generate's --n-ctx ...
    assert main(["generate", PROMPT, "--n-ctx", "2000000000", "-n", "1", "--drafter", "none"]) == 1
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("localspec: error: a KV cache of 2000000000 tokens would need 34332.3 GiB (18.0 KiB a "
                           "token for gemma-3-270m-q4_k_m.gguf), more than the ") and "use a smaller context" in last, err
    assert "Traceback" not in err
    # ... and serve's --parallel x --ctx-per-request, within the training context
    if per_token * 254 * 32768 <= avail:
        pytest.skip("this machine could hold serve's largest KV cache")
    assert main(["serve", "--port", "0", "--parallel", "254", "--prompt-cache", "0", "--ctx-per-request", "32768",
                 "--drafter", "none"]) == 1  # fmt: skip
    out, err = capsys.readouterr()
    assert "listening" not in out + err and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("localspec: error: a KV cache of ") and "--ctx-per-request or --parallel" in last, err


# -- mean acceptance length counts the end-of-generation step ----------------------------------------


@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_mean_acceptance_length_counts_the_eog_step(engine, drafter):
    old = engine.drafter_name
    engine.set_drafter(drafter)
    try:
        eos = engine.model.eos
        r = engine.generate(PROMPT, max_tokens=8, sampling=SamplingParams.greedy(logit_bias={eos: 1e30}))
        assert r.token_ids == [] and r.finish_reason == "stop"
        assert r.stats.n_steps == 1 and r.stats.mean_acceptance_length == 1.0
        r = engine.generate(PROMPT, max_tokens=6, sampling=SamplingParams.greedy())
        assert r.stats.n_step_tokens == r.stats.n_generated_tokens == 6
        if drafter == "none":
            assert r.stats.n_steps == 6 and r.stats.mean_acceptance_length == 1.0
        else:
            assert r.stats.mean_acceptance_length == 6 / r.stats.n_steps
    finally:
        engine.set_drafter(old)


# -- --compare alternates the runs ---------------------------------------------------------------


def test_compare_alternates_and_takes_medians(capsys):
    assert main(["generate", PROMPT, "-n", "8", "--temperature", "0", "--compare", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    c = d["compare"]
    assert c["order"] == ["speculative", "plain", "plain", "speculative"]
    assert len(c["speculative_tokens_per_s"]) == len(c["plain_tokens_per_s"]) == 2
    assert c["speculative_tokens_per_s"][0] == d["stats"]["tokens_per_s"]
    want = statistics.median(c["speculative_tokens_per_s"]) / statistics.median(c["plain_tokens_per_s"])
    assert d["speed_ratio"] == pytest.approx(want, rel=1e-12)
    assert d["identical_to_plain"] is True
    assert main(["generate", PROMPT, "-n", "4", "--temperature", "0", "--compare"]) == 0
    err = capsys.readouterr().err
    assert "compared 4 runs in the order speculative, plain, plain, speculative" in err


# -- Ctrl-C at any moment -------------------------------------------------------------------------


class Proc:
    """A ``localspec`` subprocess whose stderr lines and stdout chunks are collected by threads."""

    def __init__(self, args, env=None):
        self.p = subprocess.Popen(
            [sys.executable, "-m", "localspec", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        self.lines: queue.Queue = queue.Queue()
        self.err: list[str] = []
        self.out: list[str] = []
        self.threads = [
            threading.Thread(target=self._pump, args=(stream, sink, name), daemon=True)
            for stream, sink, name in ((self.p.stdout, self.out, "out"), (self.p.stderr, self.err, "err"))
        ]
        for t in self.threads:
            t.start()

    def _pump(self, stream, sink, name):
        if name == "out":  # generated text: whatever arrives (a line can take minutes at T > 0)
            dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
            fd = stream.fileno()
            for chunk in iter(lambda: os.read(fd, 65536), b""):
                text = dec.decode(chunk)
                if text:
                    sink.append(text)
                    self.lines.put((name, text))
        else:
            for line in iter(stream.readline, ""):
                sink.append(line)
                self.lines.put((name, line))
        self.lines.put((name, None))

    def wait_for(self, pred, timeout=900):
        """Block until a line satisfies ``pred(name, line)``; fail if both streams end first."""
        deadline = time.monotonic() + timeout
        ended = 0
        while True:
            name, line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if line is None:
                ended += 1
                assert ended < 2, "the process ended first:\n" + "".join(self.err)
            elif pred(name, line):
                return line

    def interrupt(self):
        self.p.send_signal(signal.SIGINT)
        rc = self.p.wait(120)
        for t in self.threads:  # the pipes are closed: the pumps finish
            t.join(30)
        return rc, "".join(self.err)

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


def assert_clean_interrupt(rc, err):
    assert rc == 130, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert err.rstrip().endswith("localspec: interrupted"), err


@pytest.fixture
def fresh_cache(tmp_path, model_path):
    """A cache directory without a cost table (the decode cost is measured at start-up)
    and the default model given by path."""
    env = dict(os.environ, LOCALSPEC_CACHE_DIR=str(tmp_path / "cache"))
    return env, str(model_path)


def test_ctrl_c_while_the_model_loads(fresh_cache):
    env, m = fresh_cache
    p = Proc(["-v", "generate", PROMPT, "-m", m, "-n", "64"], env=env)
    try:
        p.wait_for(lambda name, line: "loading model" in line)
        assert_clean_interrupt(*p.interrupt())
    finally:
        p.kill()


def test_ctrl_c_while_llama_cpp_logs_through_a_callback(fresh_cache):
    """With -v every llama.cpp log line goes through a ctypes callback into Python: the
    moment where a KeyboardInterrupt used to be swallowed ("Exception ignored ...")."""
    env, m = fresh_cache
    p = Proc(["-v", "generate", PROMPT, "-m", m, "-n", "64"], env=env)
    try:
        p.wait_for(lambda name, line: name == "err" and "llama_context" in line)
        assert_clean_interrupt(*p.interrupt())
    finally:
        p.kill()


def test_ctrl_c_while_batch_loads_its_model(fresh_cache, tmp_path):
    """``batch`` went on after a Ctrl-C raised inside llama.cpp's log callback during the
    load (ctypes swallowed it: "Exception ignored ..."), wrote every result and exited 0."""
    env, m = fresh_cache
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt": PROMPT}) + "\n" for i in range(40)))
    p = Proc(["-v", "batch", str(inp), "--out", str(out), "-m", m, "-n", "8", "--no-progress"], env=env)
    try:
        p.wait_for(lambda name, line: name == "err" and "llama_context" in line)
        rc, err = p.interrupt()
        assert_clean_interrupt(rc, err)
        assert "wrote" not in err and not out.exists(), err  # stopped in its load: no OUT left behind
    finally:
        p.kill()


def test_ctrl_c_inside_a_llama_cpp_callback_reaches_the_python_api(tmp_path, model_path):
    """A program using the API: a Ctrl-C raised while llama.cpp calls back into Python (here
    its log, the signal sent from inside the callback itself) is raised by the ``Context`` or
    ``Model`` being made once the native call returns, not swallowed by ctypes."""
    script = tmp_path / "api.py"
    script.write_text(f"""
import logging, os, signal
from localspec.backend import Context, Model
from localspec.backend._llama import set_log_level

class Interrupt(logging.Handler):
    def emit(self, record):
        if "llama_context" in record.getMessage() and not getattr(self, "sent", False):
            self.sent = True
            os.kill(os.getpid(), signal.SIGINT)  # runs inside llama.cpp's log callback

logging.getLogger("localspec.llama").addHandler(Interrupt())
logging.getLogger("localspec.llama").setLevel(logging.DEBUG)
set_log_level("info")
model = Model({str(model_path)!r})
try:
    ctx = Context(model, n_ctx=256)
except KeyboardInterrupt:
    print("INTERRUPTED")
else:
    print("WENT ON")
""")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert r.stdout.strip() == "INTERRUPTED" and "Exception ignored" not in r.stderr, (r.stdout, r.stderr[-2000:])


def test_ctrl_c_while_a_draft_model_is_written_leaves_the_old_file_and_no_partial_one(tmp_path):
    """``models derive-draft`` wrote straight into ``--out``: a Ctrl-C half-way left a truncated
    GGUF there ("data is not within the file bounds" at the next load), over a good file if
    one was there (a new user's report). Now the copy goes to a temporary file renamed at the
    end, and the hard exit on Ctrl-C removes it."""
    out = tmp_path / "draft.gguf"
    out.write_bytes(b"the previous draft")
    p = Proc(["models", "derive-draft", "default", "--layers", "6", "--out", str(out)])
    try:
        deadline = time.monotonic() + 300
        while not list(tmp_path.glob(".draft.gguf.*.tmp")):  # the copy has started
            assert p.p.poll() is None and time.monotonic() < deadline, "".join(p.err)
            time.sleep(0.001)
        # frozen while its temporary file is there, the copy has not ended (the rename is its
        # last step); Ctrl-C then reaches it half-way whatever the speed of the disk
        p.p.send_signal(signal.SIGSTOP)
        try:
            assert list(tmp_path.glob(".draft.gguf.*.tmp")), "the copy ended before it was stopped"
            p.p.send_signal(signal.SIGINT)
        finally:
            p.p.send_signal(signal.SIGCONT)
        rc = p.p.wait(120)
        for t in p.threads:
            t.join(30)
    finally:
        p.kill()
    assert_clean_interrupt(rc, "".join(p.err))
    assert out.read_bytes() == b"the previous draft" and not list(tmp_path.glob(".*.tmp")), list(tmp_path.iterdir())


def test_ctrl_c_while_generating():
    p = Proc(["generate", "Once upon a time", "-n", "100000", "--n-ctx", "4096", "--temperature", "0.8"])
    try:
        p.wait_for(lambda name, line: name == "out" and line.strip())
        rc, err = p.interrupt()
        assert_clean_interrupt(rc, err)
        assert len("".join(p.out)) > 0
    finally:
        p.kill()


def test_ctrl_c_while_complete_serve_starts(fresh_cache):
    """As ``serve``: Ctrl-C during the load stops it there (the load's last line, the note
    that the default model has no fill-in-the-middle tokens, never comes) and nothing says it
    listens."""
    env, m = fresh_cache
    p = Proc(["-v", "complete", "--serve", "--port", "0", "-m", m], env=env)
    try:
        p.wait_for(lambda name, line: "loading model" in line)
        rc, err = p.interrupt()
        assert_clean_interrupt(rc, err)
        assert "listening" not in "".join(p.out) + err and "fill-in-the-middle" not in err, err
    finally:
        p.kill()


@pytest.mark.parametrize("args,started", [
    ([], "loading model"),  # the first line: the signal may come before uvicorn takes the signals
    (["-v"], "llama_context"),  # llama.cpp logs through a callback; uvicorn holds the signals
])
def test_ctrl_c_while_serve_starts(fresh_cache, args, started):
    """Ctrl-C while `serve` loads stops it there: the load is not waited for (its last line,
    the chat-template note of the default model, never comes) and nothing says it listens."""
    env, m = fresh_cache
    p = Proc([*args, "serve", "--port", "0", "-m", m], env=env)
    try:
        p.wait_for(lambda name, line: name == "err" and started in line)
        rc, err = p.interrupt()
        assert_clean_interrupt(rc, err)
        assert "listening" not in "".join(p.out) + err and "chat template" not in err, err
    finally:
        p.kill()


def test_ctrl_c_during_decode_cost_measurement(fresh_cache):
    """The cost table is measured after the context exists: wait for the last context line
    llama.cpp logs, then interrupt (a new cache directory: nothing is cached)."""
    env, m = fresh_cache
    p = Proc(["-v", "generate", PROMPT, "-m", m, "-n", "8"], env=env)
    try:
        p.wait_for(lambda name, line: name == "err" and "reserve took" in line)
        assert_clean_interrupt(*p.interrupt())
        assert p.out == []  # stopped before generating anything
    finally:
        p.kill()
    shutil.rmtree(env["LOCALSPEC_CACHE_DIR"], ignore_errors=True)


def test_generate_says_when_the_context_filled_before_max_tokens(capsys):
    """A generation that stops because the context is full (finish reason "length" before
    ``-n``) says so and what to do; it ended without a word, like one that reached ``-n``."""
    prompt = " ".join(str(i) for i in range(1, 80))  # most of a 256-token context
    assert main(["generate", prompt, "-n", "64", "--n-ctx", "256", "--drafter", "none", "--temperature", "0"]) == 0
    err = capsys.readouterr().err
    assert "tokens: the context of 256 tokens is full (give a larger --n-ctx)" in err, err
    assert main(["generate", PROMPT, "-n", "4", "--drafter", "none", "--temperature", "0"]) == 0
    assert "is full" not in capsys.readouterr().err


def python_c(code: str) -> subprocess.CompletedProcess:
    """``python -c code`` in a fresh interpreter (what a process imports first is the point)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_the_command_module_loads_neither_llama_cpp_nor_numpy():
    """``import localspec.cli.main`` (the console script's first line) stays light: the
    package exports load on first use (PEP 562), so Ctrl-C meets ``main``'s handler at once."""
    code = "import sys, localspec.cli.main; print(sorted(m for m in ('llama_cpp', 'numpy', 'localspec.engine') if m in sys.modules))"
    r = python_c(code)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr


def test_the_package_exports_load_on_first_use():
    code = textwrap.dedent("""
        import localspec
        assert 'Engine' in dir(localspec) and set(localspec.__all__) <= set(dir(localspec))
        from localspec import SamplingParams
        assert SamplingParams.greedy().temperature == 0.0
        assert localspec.Engine.__name__ == 'Engine' and localspec.InvalidRequestError.__module__ == 'localspec.errors'
        ns = {}
        exec('from localspec import *', ns)
        assert set(localspec.__all__) <= set(ns)
        try:
            localspec.Nothing
        except AttributeError as e:
            print(e)
    """)
    r = python_c(code)
    assert r.returncode == 0 and r.stdout.strip() == "module 'localspec' has no attribute 'Nothing'", r.stderr


def test_ctrl_c_while_the_command_imports_its_modules_is_one_line():
    """A real SIGINT sent while ``main`` imports the command's modules (at numpy's import, an
    import hook's doing): one line and status 130, not a KeyboardInterrupt traceback."""
    code = textwrap.dedent("""
        import os, signal, sys
        class Hook:
            def find_spec(self, name, path=None, target=None):
                if name == 'numpy':
                    sys.meta_path.remove(self)
                    os.kill(os.getpid(), signal.SIGINT)
                return None
        sys.meta_path.insert(0, Hook())
        from localspec.cli.main import main
        sys.exit(main(['generate', 'x', '-n', '1']))
    """)
    r = python_c(code)
    assert r.returncode == 130 and r.stderr == "\nlocalspec: interrupted\n", r.stderr


def test_serve_refuses_a_parallel_beyond_the_sequence_ids_before_loading(capsys):
    """``serve --parallel 10000`` said "parallel=10000 needs more than 256 sequence ids"
    (Python's spelling, no range) after loading the model."""
    msg = cli_error(capsys, ["serve", "--port", "0", "--parallel", "10000"])
    assert msg == "localspec: error: --parallel must be in 1..254 (llama.cpp's 256 sequence ids), got 10000", msg
    assert "loading model" not in capsys.readouterr().err


@pytest.mark.parametrize("grammar,reason", [("root ::= foo", "Undefined rule identifier 'foo'"),
                                            ("root ::= [a-", "unexpected end of input")])  # fmt: skip
def test_a_grammar_that_does_not_parse_is_one_line_with_the_parsers_reason(grammar, reason):
    """llama.cpp's parser prints its reason and the whole grammar on fd 2 itself, then logs
    "failed to parse grammar", which was all the error said. Now the reason is in the error,
    and nothing else is printed."""
    r = subprocess.run([sys.executable, "-m", "localspec", "generate", PROMPT, "-n", "2", "--grammar", grammar],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    lines = [x for x in r.stderr.splitlines() if x.strip() and "loading model" not in x]
    assert r.returncode == 1 and lines == [f"localspec: error: the GBNF grammar does not parse: {reason}"], r.stderr
