"""``localspec bench``: speed of speculative vs plain decoding on Spec-Bench-format prompts,
and micro-benchmarks (``bench ngram``, ``bench kernels``, ``bench host``, ``bench features``,
``bench drafters``, ``bench complete``)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path

from .common import (add_drafter_args, add_model_args, add_sampling_args, count, drafters_to_compare, make_engine, positive,
                     sampling_from_args)


def register(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark speculative vs plain decoding (Spec-Bench JSONL)",
        description="Runs each prompt with plain and speculative decoding (interleaved, same "
        "sampling, empty KV cache each time) and reports per-category speed ratios, mean acceptance "
        "length and whether outputs are identical. Writes DIR/bench.json, DIR/bench.md, DIR/bench.png. "
        "With --accept-threshold-single/--accept-threshold-acc (LOSSY, temperature > 0) each prompt is also decoded "
        "with the thresholds: acceptance and speed against the lossless run, the mean log-probability of the emitted "
        "tokens under the target, and the exact TVD from the target on synthetic rows.",
    )
    p.add_argument(
        "--dataset",
        default=None,
        help="Spec-Bench question.jsonl (question_id, category, turns), or a shipped dataset: "
        "'code' (Python code-completion prompts, see localspec/bench/data/README.md)",
    )
    p.add_argument("--categories", default=None, help="comma-separated categories (default: all)")
    p.add_argument("--per-category", type=positive, default=10, help="prompts per category (default 10)")
    p.add_argument("--chat-format", action="store_true",
                   help="give each question as one user turn of a conversation, as chat and serve do (the model's "
                   "chat template, or the plain transcript for a base model), as Spec-Bench's own harness does; "
                   "default: the bare question, which a base model continues as text")  # fmt: skip
    p.add_argument("-n", "--max-tokens", type=positive, default=128, help="new tokens per prompt (default 128)")
    p.add_argument("--out", default="bench-out", help="output directory (default ./bench-out)")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        metavar="R",
        help="runs of plain and speculative decoding per prompt, in ABBA order; a prompt's ratio is the "
        "median over its adjacent (plain, speculative) pairs, so that per-prompt ratios on a shared "
        "machine are not artefacts of load (default 1)",
    )
    p.add_argument(
        "--peer-llama-server",
        default=None,
        metavar="BIN",
        help="also run this llama-server binary plain and in each n-gram mode on the same prompts",
    )
    p.add_argument("--peer-modes", default=None, help="comma-separated llama-server --spec-type modes")
    p.add_argument(
        "--peer-repeats",
        type=int,
        default=1,
        metavar="R",
        help="runs per prompt of each llama-server mode, each on its own server (ngram-mod remembers the requests it served); the fastest is kept (default 1)",
    )
    p.add_argument(
        "--peer-kernels",
        choices=("same", "exact", "fast"),
        default="same",
        help="numerics of the peer server: the same as localspec (default), exact, or llama.cpp's defaults",
    )
    add_drafter_args(p)
    add_sampling_args(p, greedy_default=True)
    add_model_args(p)
    p.set_defaults(func=run)
    bsub = p.add_subparsers(dest="bench_command", metavar="MICRO")
    ng = bsub.add_parser("ngram", help="n-gram drafter cost per step at growing history sizes")
    ng.add_argument("--sizes", default="1024,8192,32768")
    ng.add_argument("--steps", type=int, default=300)
    ng.add_argument("--memory-sizes", default="0,100000,1000000",
                    help="tokens stored in a drafting memory for its rows (default 0,100000,1000000; '' = none)")
    ng.add_argument("--json", action="store_true")
    ng.set_defaults(func=run_ngram)
    me = bsub.add_parser(
        "memory",
        help="sequences of requests with and without a drafting memory (same outputs)",
        description="Runs workloads of requests in order through one engine; each request runs with the "
        "n-gram drafter alone and with the n-gram drafter and a drafting memory shared by the whole run "
        "(docs/drafters.md#drafting-memory), back to back, and must give the same tokens. Reports decode "
        "speed and tokens per target call per workload.",
    )
    me.add_argument("--workloads", default="all",
                    help="comma list, run in this order: code, batch, specbench, turn2, editor, project (default all; "
                         "specbench and turn2 need --dataset and are left out of 'all' without it)")  # fmt: skip
    me.add_argument("--prompts", type=int, default=None, metavar="N",
                    help="at most N measured requests per workload whose own count is not given (a cut-down run)")
    me.add_argument("--code", type=int, default=None, metavar="N", help="first N code prompts (default all)")
    me.add_argument("--code-file", default=None, metavar="PATH",
                    help="code workload from HumanEval problems (HumanEval.jsonl or HumanEval-SingleLineInfilling.jsonl, "
                         ".gz too), leaving out those `bench complete --humaneval` evaluates; default: the shipped code prompts")  # fmt: skip
    me.add_argument("--batch", type=int, default=None, metavar="N",
                    help="prompts of the batch workload (one instruction, different inputs; default 200)")
    me.add_argument("--dataset", default=None, metavar="FILE",
                    help="Spec-Bench question.jsonl (for specbench, and its MT-Bench items for turn2)")
    me.add_argument("--per-category", type=positive, default=None, help="Spec-Bench prompts per category (default 5)")
    me.add_argument("--turns", type=int, default=None, metavar="N", help="conversations of turn2 (default 20)")
    me.add_argument("--editor-file", default=None, metavar="PATH",
                    help="the file typed in the editor workload (default: localspec's server/prompt.py)")
    me.add_argument("--editor", type=int, default=None, metavar="N", help="/infill requests of the editor workload (default 40)")
    me.add_argument("--project", default=None, metavar="DIR",
                    help="the Python project of the project workload (default: the installed starlette package)")
    me.add_argument("--project-prompts", type=int, default=None, metavar="N", help="completions in it (default 40)")
    me.add_argument("-n", "--max-tokens", type=int, default=128)
    me.add_argument("--mib", type=float, default=64.0, help="memory budget (default 64 MiB)")
    me.add_argument("--peer-llama-server", default=None, metavar="BIN",
                    help="also run the same requests, in the same order, through one llama-server per mode "
                         "(--peer-modes); ngram-cache gets a static cache of the project's corpus "
                         "(llama-lookup-create beside BIN)")  # fmt: skip
    me.add_argument("--peer-modes", default="ngram-mod,ngram-cache", help="llama-server --spec-type modes (default ngram-mod,ngram-cache)")
    me.add_argument("--peer-kernels", choices=("same", "exact", "fast"), default="same",
                    help="numerics of the peer server: the same as localspec (default), exact, or llama.cpp's defaults")
    me.add_argument("--plot", default=None, metavar="PATH", help="write a plot (PNG) of speed-up and tokens per call per workload")
    me.add_argument("--rss", type=int, default=None, metavar="N",
                    help="instead: N synthetic requests (no model) through a memory of --mib; report the process's "
                         "resident memory against the budget (issue 29: 10000)")  # fmt: skip
    me.add_argument("--json", action="store_true")
    me.add_argument("--out", default=None, help="also write the JSON report here")
    add_model_args(me)
    me.set_defaults(func=run_memory)
    kn = bsub.add_parser(
        "kernels",
        help="native C kernels vs the numpy reference (sampling, verification, n-gram)",
        description="Times each kernel with the native C library and with the numpy / Python "
        "reference on the same inputs (262,144-token rows), and checks both give the same result.",
    )
    kn.add_argument("--reps", type=int, default=5, help="timed calls per kernel (median reported)")
    kn.add_argument("--real-rows", action="store_true", help="logits rows from the default model instead of synthetic ones")
    kn.add_argument("--threads", type=int, default=None, help="threads of the native row passes (default 1)")
    kn.add_argument("--vocab", type=int, default=262144, help="width of the synthetic rows (default 262144)")
    kn.add_argument("--json", action="store_true")
    kn.set_defaults(func=run_kernels)
    ho = bsub.add_parser(
        "host",
        help="host overhead per step (all but llama_decode) with forced tree sizes",
        description="Runs the engine with n-gram trees padded to exactly --nodes nodes (no adaptive "
        "policy), greedy and T=0.8/top-p=0.95, with the native kernels and with the numpy reference, "
        "and reports host time (everything but llama_decode) against llama_decode time per step.",
    )
    ho.add_argument("--nodes", type=int, default=16, help="nodes per verified tree, root included (default 16)")
    ho.add_argument("-n", "--max-tokens", type=count, default=64)
    ho.add_argument("--json", action="store_true")
    add_model_args(ho)
    ho.set_defaults(func=run_host)

    ft = bsub.add_parser("features", help="cost per decode of capturing target features (EAGLE-3)")
    ft.add_argument("--layers", default="2,9,15", help="target layer ids (default 2,9,15)")
    ft.add_argument("--sizes", default="1,8", help="batch sizes (default 1,8)")
    ft.add_argument("--reps", type=int, default=30)
    ft.add_argument("-m", "--model", default=None, help="target GGUF (default: the embedded model)")
    ft.add_argument("-ngl", "--n-gpu-layers", type=int, default=0, help="layers to offload on CUDA/Metal builds (-1 = all)")
    ft.add_argument("--json", action="store_true")
    ft.set_defaults(func=run_features)

    dr = bsub.add_parser(
        "drafters",
        help="EAGLE-3 head cost per tree level vs a target single-token decode",
        description="Drafts with the head in fixed tree shapes on every step and, alternating prompt "
        "by prompt in the same run, decodes plainly: reports per head runtime (the host's C kernels "
        "and llama.cpp's eagle3 graph) and level the head's median time, its fraction of a plain "
        "single-token target decode (goal: <= 3%; level 0 with its catch-up <= 5%), the head's "
        "calls per level, and the host time per drafted node.",
    )
    dr.add_argument("--runtimes", default="host,llama", help="head runtimes to measure (default host,llama)")
    dr.add_argument("--eagle", default=None, metavar="PATH", help="EAGLE-3 head GGUF (default: the head shipped for the model)")
    dr.add_argument("--shapes", default="6x1x7,4x3x16", help="tree shapes depth x width x nodes (default 6x1x7,4x3x16)")
    dr.add_argument("-n", "--max-tokens", type=positive, default=48, help="tokens per prompt (default 48)")
    dr.add_argument("--rounds", type=positive, default=2, help="passes over the prompts (default 2)")
    dr.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all this process may use)")
    dr.add_argument("-m", "--model", default=None, help="target GGUF (default: the embedded model)")
    dr.add_argument("-ngl", "--n-gpu-layers", type=int, default=0,
                    help="target layers to offload on CUDA/Metal builds (-1 = all; the head stays on the CPU)")
    dr.add_argument("--versus", default=None, metavar="A,B[,...]",
                    help="instead: Spec-Bench prompts (--dataset) decoded plainly and with drafters A and B in one "
                    "run (e.g. ngram,auto); per category speed over plain, MAL, identical outputs, and B over A; "
                    "a name given twice runs two engines of it (ngram,ngram,auto: the spread of a drafter against "
                    "itself beside B)")  # fmt: skip
    dr.add_argument("--dataset", default=None,
                    help="Spec-Bench question.jsonl: its prompts instead of the four short built-in ones (the head's "
                    "attention grows with the context); needed by --versus")  # fmt: skip
    dr.add_argument("--per-category", type=positive, default=None, help="prompts per category of --dataset (default 3)")
    dr.add_argument("--chat-format", action="store_true",
                    help="(with --dataset) each question as one user turn of a conversation, as chat and serve give it")
    dr.add_argument("--repeats", type=int, default=None, metavar="R",
                    help="(with --versus) rounds per prompt, each running every engine once, in reversed order "
                    "round by round (A B, B A, ...); a prompt's time per engine is the median (with 2, the mean; default 1)")  # fmt: skip
    dr.add_argument("--json", action="store_true")
    dr.set_defaults(func=run_drafters)

    from . import bench_complete, bench_serve

    bench_complete.register(bsub)
    bench_serve.register(bsub)


def _native_line() -> str:
    from .. import native

    d = native.describe()
    if not d["available"]:
        return f"native kernels: NOT AVAILABLE ({d['load_error']})"
    return f"native kernels: loaded, OpenMP {'yes' if d['openmp'] else 'no'}, {d['threads']} thread(s)"


# The largest history --sizes / --memory-sizes / --steps build (tokens): more than any context
# llama.cpp decodes; its synthetic history alone takes about 6 s and 0.4 GB at this size.
MAX_HISTORY_TOKENS = 1 << 24


def _ints(text: str, flag: str, lo: int, hi: int | None = None) -> list[int]:
    """``text`` as comma-separated whole numbers in ``lo..hi``; else SystemExit (one line)."""
    try:
        out = [int(x) for x in str(text).split(",")]
    except ValueError:
        out = []
    if not out or min(out) < lo or (hi is not None and max(out) > hi):
        bounds = f">= {lo}" if hi is None else f"from {lo} to {hi}"
        raise SystemExit(f"localspec: error: {flag} takes whole numbers {bounds}, comma-separated; got {text!r}")
    return out


def _at_least(value: int | None, lo: int, flag: str) -> None:
    if value is not None and value < lo:
        raise SystemExit(f"localspec: error: {flag} must be >= {lo}, got {value}")


def run_ngram(a: argparse.Namespace) -> int:
    from .. import native
    from ..bench.ngram import bench_ngram

    sizes = _ints(a.sizes, "--sizes", 1, MAX_HISTORY_TOKENS)
    _at_least(a.steps, 1, "--steps")
    if a.steps > MAX_HISTORY_TOKENS:
        raise SystemExit(f"localspec: error: --steps must be <= {MAX_HISTORY_TOKENS}, got {a.steps}")
    memory_sizes = _ints(a.memory_sizes, "--memory-sizes", 0, MAX_HISTORY_TOKENS) if a.memory_sizes else []
    rows = bench_ngram(sizes, steps=a.steps, index="reference")
    if native.AVAILABLE:
        rows = bench_ngram(sizes, steps=a.steps, index="native") + rows
    mem_rows = []
    if native.AVAILABLE and a.memory_sizes:
        from ..bench.ngram import bench_memory

        mem_rows = bench_memory(memory_sizes, steps=a.steps)
    if a.json:
        print(json.dumps({"native": native.describe(), "ngram": rows, "memory": mem_rows}))
    else:
        print("| index | history tokens | µs/step (median) | µs/step (p90) | build µs/token |\n|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['index']} | {r['history_tokens']} | {r['step_us_median']:.0f} | {r['step_us_p90']:.0f} "
                f"| {r['build_us_per_token']:.2f} |"
            )
        if mem_rows:
            print("\n| drafting memory tokens | history tokens | µs/step (median) | µs/step (p90) | write µs/token |\n|---|---|---|---|---|")
            for r in mem_rows:
                print(f"| {r['memory_tokens']} | {r['history_tokens']} | {r['step_us_median']:.0f} | {r['step_us_p90']:.0f} "
                      f"| {r['write_us_per_token']:.2f} |")  # fmt: skip
    return 0


MEMORY_WORKLOADS = ("code", "batch", "specbench", "turn2", "editor", "project")


def memory_workload_names(a: argparse.Namespace) -> list[str]:
    """The names of --workloads ('all': those whose inputs are there).

    Raises:
        SystemExit: an unknown workload (one line).
    """
    names = [x.strip() for x in a.workloads.split(",") if x.strip()]
    if names == ["all"]:
        names = [w for w in MEMORY_WORKLOADS if a.dataset or w not in ("specbench", "turn2")]
        if not a.dataset:
            print("localspec: specbench and turn2 need --dataset (a Spec-Bench question.jsonl): left out", file=sys.stderr)
    bad = [w for w in names if w not in MEMORY_WORKLOADS]
    if bad:
        raise SystemExit(f"localspec: error: unknown workload {bad[0]!r} ({', '.join(MEMORY_WORKLOADS)})")
    return names


def memory_workloads(a: argparse.Namespace, engine, names: list[str] | None = None) -> list:
    """The workloads of ``bench memory`` (``bench.memory.Workload``), in run order.

    Raises:
        SystemExit: an unknown workload, or one whose input is missing (one line).
    """
    from ..bench import memory as bm

    names = memory_workload_names(a) if names is None else names
    def first(given: int | None, default: int | None) -> int | None:
        """A workload's count: its own option, else --prompts (at most the default), else the default."""
        if given is not None:
            return given
        if a.prompts is None:
            return default
        return a.prompts if default is None else min(default, a.prompts)

    model, out = engine.model, []
    try:
        for w in names:
            if w == "code" and a.code_file:
                out.append(bm.Workload("code:humaneval", bm.humaneval_workload(a.code_file, first(a.code, None))))
            elif w == "code":
                out.append(bm.Workload("code", bm.code_workload(first(a.code, None))))
            elif w == "batch":
                out.append(bm.Workload("batch", bm.batch_workload(first(a.batch, 200))))
            elif w == "specbench":
                if not a.dataset:
                    raise SystemExit("localspec: error: the specbench workload needs --dataset FILE (a Spec-Bench question.jsonl)")
                out += [bm.Workload(f"spec:{c}", ps) for c, ps in bm.specbench_workload(a.dataset, first(a.per_category, 5))]
            elif w == "turn2":
                if not a.dataset:
                    raise SystemExit("localspec: error: the turn2 workload needs --dataset FILE (Spec-Bench, with MT-Bench items)")
                out.append(bm.Workload("turn2", bm.second_turn_workload(model, a.dataset, first(a.turns, 20))))
            elif w == "editor":
                path = a.editor_file or str(Path(__file__).resolve().parent.parent / "server" / "prompt.py")
                out.append(bm.Workload(f"editor:{Path(path).name}",
                                       bm.editor_workload(model, path, first(a.editor, 40), n_ctx=engine.n_ctx, n_predict=a.max_tokens)))  # fmt: skip
            elif w == "project":
                root = a.project or bm.default_project()
                if root is None:
                    raise SystemExit("localspec: error: the project workload needs --project DIR (starlette is not installed)")
                out.append(bm.project_workload(model, root, first(a.project_prompts, 40)))
    except (OSError, ValueError) as e:
        raise SystemExit(f"localspec: error: {e}") from None
    return out


def _memory_peers(a: argparse.Namespace, engine, workloads: list, log_dir: Path) -> list:
    """One llama-server per --peer-modes mode; ngram-cache with a static cache (-lcs) built by
    llama-lookup-create from the corpora of the workloads, when that binary is beside BIN."""
    import subprocess

    from ..backend import exact_kernels
    from ..bench.peer import PeerServer

    exact = exact_kernels() if a.peer_kernels == "same" else a.peer_kernels == "exact"
    modes = [m.strip() for m in a.peer_modes.split(",") if m.strip()]
    log_dir.mkdir(parents=True, exist_ok=True)
    static: list[str] = []
    corpus = [d for w in workloads for d in w.corpus]
    creator = Path(a.peer_llama_server).parent / "llama-lookup-create"
    if "ngram-cache" in modes and corpus:
        if not creator.exists():
            print(f"localspec: {creator} not found: ngram-cache runs without a static cache", file=sys.stderr)
        else:
            text_path, cache_path = log_dir / "corpus.txt", log_dir / "corpus.lcs"
            text_path.write_text("\n".join(engine.model.detokenize(d) for d in corpus))
            with open(log_dir / "llama-lookup-create.log", "w") as log:
                # it only tokenizes (no decode): a small context; --no-repack: llama.cpp's AMX
                # repacking crashes in its warm-up on some CPUs (backend.cpu_amx)
                cmd = [str(creator), "-m", str(engine.model.path), "-f", str(text_path), "-lcs", str(cache_path),
                       "-c", "512", "--no-repack"]  # fmt: skip
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
            if rc != 0:
                raise SystemExit(f"localspec: error: llama-lookup-create exited with {rc}; see {log_dir / 'llama-lookup-create.log'}")
            static = ["-lcs", str(cache_path)]
    peers = []
    try:
        for mode in modes:
            peers.append(PeerServer(a.peer_llama_server, engine.model.path, mode, n_ctx=engine.n_ctx,
                                    threads=engine.ctx.n_threads, log_dir=log_dir, exact=exact,
                                    extra_args=static if mode == "ngram-cache" else ()))  # fmt: skip
    except RuntimeError as e:
        for p in peers:
            p.close()
        raise SystemExit(f"localspec: error: {e}") from None
    return peers


def run_memory(a: argparse.Namespace) -> int:
    from ..bench.memory import format_report, plot_report, run_memory_bench

    if a.rss is not None:
        return _run_memory_rss(a)
    names = memory_workload_names(a)  # a bad name fails before the model loads
    engine = make_engine(a, "ngram")
    peers = []
    try:
        workloads = memory_workloads(a, engine, names)
        if a.peer_llama_server:
            log_dir = Path(a.out).parent if a.out else Path("bench-out")
            peers = _memory_peers(a, engine, workloads, log_dir / "memory-peer")

        def progress(name, i, r_off, r_on) -> None:
            print(f"{name} #{i}: off {r_off.stats.n_steps} steps, on {r_on.stats.n_steps} steps, "
                  f"{'same' if r_off.token_ids == r_on.token_ids else 'DIFFERENT'} output", file=sys.stderr)  # fmt: skip

        rep = run_memory_bench(engine, workloads, max_tokens=a.max_tokens, budget_mib=a.mib, on_request=progress, peers=peers)
        rep["peer_static_cache"] = bool(peers) and any("-lcs" in p.args for p in peers)
    finally:
        for p in peers:
            p.close()
        engine.close()
    if a.out:  # compact: the report holds every prompt, output and corpus token
        Path(a.out).write_text(json.dumps(rep, separators=(",", ":")))
    if a.plot:
        plot_report(rep, a.plot)
    print(json.dumps(rep, indent=2) if a.json else format_report(rep))
    return 0 if all(w["identical"] for w in rep["workloads"]) else 1


def _run_memory_rss(a: argparse.Namespace) -> int:
    from ..bench.memory import format_rss, rss_run

    if a.rss < 1:
        raise SystemExit("localspec: error: --rss needs a number of requests >= 1")
    every = max(1, a.rss // 10)

    def progress(s: dict) -> None:
        print(f"{s['requests']} requests: RSS {s['rss_mib']:.1f} MiB", file=sys.stderr)

    rep = rss_run(a.rss, budget_mib=a.mib, every=every, on_sample=progress)
    if a.out:
        Path(a.out).write_text(json.dumps(rep, indent=2))
    print(json.dumps(rep, indent=2) if a.json else format_rss(rep))
    return 0


def run_kernels(a: argparse.Namespace) -> int:
    from .. import native
    from ..bench.kernels import bench_kernels, model_rows

    _at_least(a.reps, 1, "--reps")
    _at_least(a.vocab, 64, "--vocab")
    _at_least(a.threads, 1, "--threads")
    if not native.AVAILABLE:
        raise SystemExit(f"localspec: error: {_native_line()}")
    if a.threads:
        native.set_threads(a.threads)
    if a.real_rows:
        rows = model_rows(64)
    else:
        import numpy as np

        from ..bench.kernels import gemma_like_rows

        rows = gemma_like_rows(np.random.default_rng(0), 64, a.vocab)
    timings = bench_kernels(reps=a.reps, rows=rows)
    if a.json:
        print(json.dumps({"native": native.describe(), "rows": "model" if a.real_rows else "synthetic", "kernels": [t.to_dict() for t in timings]}))
    else:
        print(_native_line() + f"; rows: {'default model' if a.real_rows else 'synthetic, Gemma-shaped'}, {rows.shape[1]:,} wide")
        print("| kernel | native µs | reference µs | speedup | same result |\n|---|---|---|---|---|")
        for t in timings:
            print(f"| {t.kernel} | {t.native_us:.0f} | {t.reference_us:.0f} | {t.speedup:.1f}x | {'yes' if t.same else 'NO'} |")
    return 0


def run_host(a: argparse.Namespace) -> int:
    from ..bench.host import as_dicts, bench_host

    a.max_tree_nodes = max(a.max_tree_nodes, a.nodes)
    engine = make_engine(a, "ngram")
    try:
        rows = bench_host(engine, n_nodes=a.nodes, max_tokens=a.max_tokens)
    finally:
        engine.close()
    if a.json:
        from .. import native

        print(json.dumps({"native": native.describe(), "host": as_dicts(rows)}))
    else:
        print(_native_line())
        print(
            "| sampling | kernels | steps | nodes/step | tokens/step | host µs/step | llama_decode µs/step | host/decode "
            "| host/calibrated decode | draft µs | verify µs | other µs |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
        )
        for r in rows:
            print(
                f"| {r.sampling} | {r.kernels} | {r.steps} | {r.mean_tree_nodes:.1f} | {r.mean_acceptance_length:.2f} "
                f"| {r.t_host_us_per_step:.0f} | {r.t_decode_us_per_step:.0f} | {100 * r.host_fraction:.1f}% "
                f"| {100 * r.host_fraction_calibrated:.1f}% of {r.t_decode_calibrated_us / 1e3:.0f} ms "
                f"| {r.t_draft_us_per_step:.0f} | {r.t_verify_us_per_step:.0f} | {r.t_other_us_per_step:.0f} |"
            )
        if any(r.identical_to_reference is False for r in rows):
            print("WARNING: native and reference outputs differ")
    return 0


def run_features(a: argparse.Namespace) -> int:
    from ..backend import Model
    from ..bench.features import bench_features
    from ..models import resolve_model

    layers, sizes = _ints(a.layers, "--layers", 1), _ints(a.sizes, "--sizes", 1)
    _at_least(a.reps, 1, "--reps")
    model = Model(resolve_model(a.model), n_gpu_layers=a.n_gpu_layers)
    try:
        rows = bench_features(model, layers, sizes=sizes, reps=a.reps)
    finally:
        model.close()
    if a.json:
        print(json.dumps({"features": rows}))
    else:
        print("| batch | decode µs | with Python tap µs | overhead µs | in callback µs | with C tap µs | overhead µs |\n"
              "|---|---|---|---|---|---|---|")  # fmt: skip
        for r in rows:
            c = (f"{r['t_tap_native_us']:.0f} | {r['t_overhead_native_us']:.0f}" if "t_tap_native_us" in r
                 else "(C kernels not built) | -")  # fmt: skip
            print(f"| {r['batch']} | {r['t_plain_us']:.0f} | {r['t_tap_us']:.0f} | {r['t_overhead_us']:.0f} "
                  f"| {r['t_callback_us']:.0f} | {c} |")  # fmt: skip
    return 0


def run_drafters(a: argparse.Namespace) -> int:
    import os

    from ..backend import Model
    from ..bench.dataset import as_chat
    from ..bench.drafters import bench_drafters
    from ..models import resolve_model
    from ..models.eagle3_heads import shipped_head
    from ..policy import TreeShape

    if a.versus:
        return _run_versus(a)
    if a.repeats is not None:
        raise SystemExit("localspec: error: --repeats goes with --versus A,B (the head's cost per level: --rounds)")
    if a.dataset is None and (a.per_category is not None or a.chat_format):
        raise SystemExit("localspec: error: --per-category and --chat-format choose prompts of --dataset FILE")
    prompts = None
    if a.dataset is not None:
        prompts = _drafters_prompts(a)
    model = Model(resolve_model(a.model), n_gpu_layers=a.n_gpu_layers)
    try:
        if prompts is not None:
            prompts = [bp.model_input for bp in (as_chat(prompts, model) if a.chat_format else prompts)]
        head = a.eagle or shipped_head(model.path)
        if head is None:
            raise SystemExit("localspec: error: no EAGLE-3 head ships for this model: give one with --eagle PATH")
        try:
            shapes = [TreeShape(*(int(x) for x in s.split("x")), 0.0) for s in a.shapes.split(",")]
        except (TypeError, ValueError):
            raise SystemExit(f"localspec: error: --shapes {a.shapes!r}: expected DEPTHxWIDTHxNODES[,...]") from None
        runtimes = tuple(x.strip() for x in a.runtimes.split(",") if x.strip())
        bad = [x for x in runtimes if x not in ("host", "llama")]
        if bad or not runtimes:
            raise SystemExit(f"localspec: error: --runtimes {a.runtimes!r}: expected host, llama or both (comma-separated)")
        rows = bench_drafters(model, head, shapes=shapes, prompts=prompts, max_tokens=a.max_tokens, rounds=a.rounds,
                              n_threads=a.threads, runtimes=runtimes)  # fmt: skip
    finally:
        model.close()
    if a.json:
        print(json.dumps({"drafters": [r.to_dict() for r in rows], "load_avg_1min": os.getloadavg()[0]}))
        return 0
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    for r in rows:
        print(
            f"\n{r.shape}, head on {r.runtime}: plain single-token target decode {r.t_decode_1_us / 1e3:.2f} ms; {r.drafted_steps} drafted steps, "
            f"{r.nodes_per_step:.1f} nodes/step, MAL {r.mean_acceptance_length:.2f}; host {r.host_us_per_node:.0f} µs per "
            f"drafted node; head calls outside drafted steps: {r.head_calls_outside_drafting}"
        )
        print("| level | steps | head µs (median) | p90 µs | of a target decode | head calls | catch-up entries |\n|---|---|---|---|---|---|---|")
        for lv in r.levels:
            print(
                f"| {lv.level} | {lv.steps} | {lv.t_median_us:.0f} | {lv.t_p90_us:.0f} | {100 * lv.fraction_of_decode:.1f}% "
                f"| {lv.calls_per_step:.2f} | {lv.mean_catch_up:.1f} |"
            )
    return 0


def _load_prompts(dataset: str, categories: list[str] | None, per_category: int) -> list:
    """``select_prompts`` of ``load_questions(dataset)``; a missing, unreadable or malformed
    file, an unknown category or a dataset without questions exits with one line."""
    from ..bench.dataset import load_questions, select_prompts

    try:
        return select_prompts(load_questions(dataset), categories, per_category)
    except OSError as e:  # resolve_dataset's own message, or the OS's
        msg = f"cannot read --dataset {dataset!r}: {e.strerror}" if e.strerror else f"--dataset: {e}"
        raise SystemExit(f"localspec: error: {msg}") from None
    except (ValueError, UnicodeDecodeError) as e:  # a malformed line names itself
        raise SystemExit(f"localspec: error: {e}") from None


def _drafters_prompts(a: argparse.Namespace) -> list:
    """``bench drafters``' prompts: ``--per-category`` (default 3) of each category of ``--dataset``."""
    return _load_prompts(a.dataset, None, 3 if a.per_category is None else a.per_category)


def _run_versus(a: argparse.Namespace) -> int:
    import os

    from ..backend import Model
    from ..bench.dataset import as_chat
    from ..bench.drafters import compare_drafters, summarize_versus, versus_labels
    from ..models import resolve_model

    if not a.dataset:
        raise SystemExit("localspec: error: --versus needs --dataset FILE (a Spec-Bench question.jsonl)")
    names = drafters_to_compare("--versus", [n.strip() for n in a.versus.split(",") if n.strip()])
    if len(names) < 2:
        raise SystemExit("localspec: error: --versus takes two or more drafter names, e.g. ngram,auto")
    names = versus_labels(names)
    repeats = 1 if a.repeats is None else a.repeats
    if repeats < 1:
        raise SystemExit(f"localspec: error: --repeats must be at least 1, got {repeats}")
    prompts = _drafters_prompts(a)
    model = Model(resolve_model(a.model), n_gpu_layers=a.n_gpu_layers)
    if a.chat_format:
        prompts = as_chat(prompts, model)
    load0 = os.getloadavg()[0]
    try:
        rows = compare_drafters(model, prompts, names, max_tokens=a.max_tokens, n_threads=a.threads, repeats=repeats,
                                progress=lambda i, n, _r: print(f"  {i}/{n}", file=sys.stderr))  # fmt: skip
    finally:
        model.close()
    summary = summarize_versus(rows, names)
    load1 = os.getloadavg()[0]
    if a.json:
        print(json.dumps({"prompts": rows, "summary": summary, "repeats": repeats, "load_avg_1min": [load0, load1]}))
        return 0
    print(f"load average (1 min): {load0:.1f} at the start, {load1:.1f} at the end, on {os.cpu_count()} CPUs; greedy, {a.max_tokens} tokens")
    head = " | ".join(f"{n} vs plain / MAL / identical" for n in names)
    print(f"| category | prompts | {head} | {names[-1]} over {names[0]} (95% bootstrap interval over prompts) |\n|---|---|"
          + "---|" * (len(names) + 1))  # fmt: skip
    for e in summary:
        cells = " | ".join(f"{e[n]['speed_vs_plain']:.2f}x / {e[n]['mal']:.2f} / {e[n]['identical']}/{e['prompts']}" for n in names)
        lo, hi = e["last_over_first_ci"]
        print(f"| {e['category']} | {e['prompts']} | {cells} | {e['last_over_first']:.3f}x ({lo:.3f}-{hi:.3f}) |")
    total = summary[-1]
    for n in names:
        src = total[n]["token_sources"]
        print(f"{n}: emitted tokens by source, all prompts: " + ", ".join(f"{k} {v}" for k, v in sorted(src.items(), key=lambda kv: -kv[1])))
    return 0


def run(a: argparse.Namespace) -> int:
    from ..bench import peer as peer_mod
    from ..bench.report import markdown_table, plot, write_json
    from ..bench.specbench import machine_info, run_bench, summarize

    if not a.dataset:
        raise SystemExit("localspec: error: --dataset FILE is required (a Spec-Bench question.jsonl, or 'code')")
    if a.drafter == "none":
        raise SystemExit("localspec: error: bench compares a drafter against plain decoding; choose --drafter other than none")
    if a.repeats < 1:
        raise SystemExit(f"localspec: error: --repeats must be at least 1, got {a.repeats}")
    if a.peer_repeats < 1:
        raise SystemExit(f"localspec: error: --peer-repeats must be at least 1, got {a.peer_repeats}")
    cats = [c.strip() for c in a.categories.split(",")] if a.categories else None
    prompts = _load_prompts(a.dataset, cats, a.per_category)
    sampling = sampling_from_args(a)
    lossy = None
    if sampling.accept_threshold_single is not None or sampling.accept_threshold_acc is not None:
        if sampling.is_greedy:
            raise SystemExit("localspec: error: the acceptance thresholds apply at temperature > 0 (greedy verification "
                             "ignores them) and bench defaults to --temperature 0: add e.g. --temperature 0.8")  # fmt: skip
        lossy = sampling
        if not lossy.lossy:
            print("localspec: note: both acceptance thresholds are 1 (lossless): the 'lossy' run is lossless", file=sys.stderr)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    engine = make_engine(a, a.drafter)
    if a.chat_format:
        from ..bench.dataset import as_chat

        prompts = as_chat(prompts, engine.model)
    peers = {}
    if threading.current_thread() is threading.main_thread():  # SIGTERM closes the peers too
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        if a.peer_llama_server:
            modes = a.peer_modes.split(",") if a.peer_modes else list(peer_mod.NGRAM_MODES)
            print(f"localspec: starting llama-server in modes: none, {', '.join(modes)}", file=sys.stderr)
            from ..backend import exact_kernels

            exact = exact_kernels() if a.peer_kernels == "same" else a.peer_kernels == "exact"
            for mode in ["none", *modes]:  # one server per repeat: see run_bench's peers
                peers[mode] = [
                    peer_mod.PeerServer(
                        a.peer_llama_server,
                        engine.model.path,
                        mode,
                        n_ctx=engine.n_ctx,
                        threads=engine.ctx.n_threads,
                        log_dir=out,
                        exact=exact,
                        tag=str(r) if a.peer_repeats > 1 else "",
                    )
                    for r in range(a.peer_repeats)
                ]
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(prompts), desc="bench", unit="prompt", file=sys.stderr)
        except ImportError:  # pragma: no cover
            bar = None

        def progress(done, total, rec):
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"{rec.category}: identical={rec.identical}")

        records = run_bench(
            engine,
            prompts,
            max_tokens=a.max_tokens,
            sampling=sampling,
            peers=peers,
            progress=progress,
            repeats=a.repeats,
            peer_repeats=a.peer_repeats,
            lossy=lossy,
        )
        if bar is not None:
            bar.close()
        cats_summary = summarize(records)
        extra: dict = {}
        if lossy is not None:
            from ..bench.thresholds import summarize_lossy, synthetic_tvd_report, threshold_grid

            ts, ta = lossy.acceptance_thresholds
            print("localspec: exact TVD on synthetic rows...", file=sys.stderr)
            extra = {"lossy": lossy.lossy, "lossy_categories": summarize_lossy(records),
                     "synthetic_tvd": synthetic_tvd_report(threshold_grid(ts, ta))}  # fmt: skip
        config = {
            "dataset": str(a.dataset),
            "drafter": a.drafter,
            "draft_model": a.draft_model,
            "eagle": a.eagle or (str(engine.drafter.model.path) if a.drafter == "eagle3" else None),
            "medusa": a.medusa or (engine.drafter.path if a.drafter == "medusa" else None),
            "draft_shape": getattr(a, "draft_shape", None),
            "max_tokens": a.max_tokens,
            "temperature": a.temperature,
            "per_category": a.per_category,
            "chat_format": bool(a.chat_format),
            "repeats": a.repeats,
            "peer_repeats": a.peer_repeats,
            "lossy": bool(lossy is not None and lossy.lossy),
            "accept_threshold_single": lossy.acceptance_thresholds[0] if lossy is not None else 1.0,
            "accept_threshold_acc": lossy.acceptance_thresholds[1] if lossy is not None else 1.0,
            "peer_llama_server": a.peer_llama_server,
            "peer_kernels": a.peer_kernels,
            **machine_info(engine),
        }
        write_json(out / "bench.json", config, cats_summary, records, extra)
        table = markdown_table(config, cats_summary)
        if lossy is not None:
            from ..bench.thresholds import lossy_markdown, tvd_markdown

            table += "\n" + lossy_markdown(config, extra["lossy_categories"]) + "\n" + tvd_markdown(extra["synthetic_tvd"])
        (out / "bench.md").write_text(table)
        plotted = plot(out / "bench.png", cats_summary)
        print(table)
        print(f"wrote {out / 'bench.json'}, {out / 'bench.md'}" + (f", {out / 'bench.png'}" if plotted else ""), file=sys.stderr)
    finally:
        for servers in peers.values():
            for s in servers:
                s.close()
        engine.close()
    return 0
