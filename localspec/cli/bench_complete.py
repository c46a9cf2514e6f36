"""``localspec bench complete``: keystroke latency and single-line infilling through the
completion server (``localspec.bench.complete``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .common import add_drafter_args, add_model_args, make_engine, need_extra, read_text_file


def register(bsub) -> None:
    p = bsub.add_parser(
        "complete",
        help="editor completion: keystroke latency and HumanEval single-line infilling",
        description="Starts the completion server in process on a free loopback port and sends it "
        "llama.vim-shaped /infill requests. Latency: a ~2,000-token prefix, then the same request "
        "with only the last line changed. With --humaneval: speculative vs plain completion of "
        "single-line infilling tasks (identical text, speed ratio, acceptance).",
    )
    p.add_argument("--prefix-file", default=None, help="source file for the latency prefix (default: localspec's engine.py)")
    p.add_argument("--prefix-tokens", type=int, default=2000, help="prefix size in tokens (default 2000)")
    p.add_argument("--latency-n-predict", type=int, default=16, help="n_predict of the latency requests (default 16)")
    p.add_argument("--repeats", type=int, default=3, help="latency pairs (default 3)")
    p.add_argument("--skip-latency", action="store_true", help="only run the infilling bench")
    p.add_argument("--humaneval", default=None, metavar="PATH", help="HumanEval-SingleLineInfilling.jsonl(.gz)")
    p.add_argument("--tasks", type=int, default=40, help="infilling tasks, spread over the file (default 40)")
    p.add_argument("--n-predict", type=int, default=48, help="n_predict of the infilling requests (default 48)")
    p.add_argument("--out", default=None, help="write the results as JSON to this file")
    add_drafter_args(p)
    add_model_args(p)
    p.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    need_extra("httpx", "bench", "bench complete")
    import localspec.engine

    from ..bench.complete import bench_humaneval, bench_latency, load_humaneval_infilling, spread
    from ..sampling import SamplingParams
    from ..server import CompletionService, ServiceConfig
    from ..server.http import ServerThread

    if a.skip_latency and not a.humaneval:
        raise SystemExit("localspec: error: nothing to run (--skip-latency without --humaneval PATH)")
    text = read_text_file(a.prefix_file or localspec.engine.__file__, "--prefix-file")
    try:
        tasks = spread(load_humaneval_infilling(a.humaneval), a.tasks) if a.humaneval else []
    except OSError as e:
        raise SystemExit(f"localspec: error: cannot read --humaneval {a.humaneval!r}: {e.strerror or e}") from None
    engine = make_engine(a, a.drafter)
    service = CompletionService(engine, ServiceConfig(sampling=SamplingParams.greedy()))
    results: dict = {"model": str(engine.model.path), "drafter": engine.drafter_name, "n_threads": engine.ctx.n_threads}
    try:
        with ServerThread(service) as srv:
            if not a.skip_latency:
                tok = lambda s: engine.model.tokenize(s, add_special=False)  # noqa: E731 - vocab only, thread-safe
                lat = bench_latency(srv.url, text, tok, n_prefix_tokens=a.prefix_tokens, n_predict=a.latency_n_predict,
                                    repeats=a.repeats)  # fmt: skip
                results["latency"] = lat
                print(
                    f"latency: prompt {lat['prompt_tokens']} tokens, n_predict {lat['n_predict']}: first request "
                    f"{lat['t_first_ms_median']:.0f} ms, last line changed {lat['t_second_ms_median']:.0f} ms, "
                    f"ratio {lat['ratio_median']:.3f} (median of {a.repeats}; max {lat['ratio_max']:.3f})"
                )
            if tasks:

                def progress(done, total, rec):
                    print(f"  [{done}/{total}] {rec.task_id}: identical={rec.identical} "
                          f"accepted {rec.draft_n_accepted}/{rec.draft_n}", file=sys.stderr)  # fmt: skip

                he = bench_humaneval(srv.url, service, tasks, n_predict=a.n_predict, progress=progress)
                results["humaneval"] = he
                print(
                    f"infilling: {he['n_tasks']} tasks, identical {he['identical']}/{he['n_tasks']}, "
                    f"decode speedup {he['speedup']:.2f}x ({he['spec_tokens_per_s']:.1f} vs "
                    f"{he['plain_tokens_per_s']:.1f} tokens/s), end to end {he['speedup_end_to_end']:.2f}x, "
                    f"accepted {he['num_accepted_tokens']}/{he['num_draft_tokens']} drafts "
                    f"({he['acceptance_rate']:.0%}), mean acceptance length {he['mean_acceptance_length']:.2f}, "
                    f"first line exact {he['line_exact_matches']}/{he['n_tasks']}"
                )
                for d in he["divergences"]:
                    print(f"  divergence {d['task_id']} at token {d['index']}: top-2 gap {d['top2_gap']}")
    finally:
        service.close()
        engine.close()
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))
        print(f"wrote {a.out}", file=sys.stderr)
    return 0
