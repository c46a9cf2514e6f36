"""What ``--drafter auto`` costs beyond ``--drafter ngram`` where its head does not draft (issue 30,
part 4): the same Spec-Bench prompts decoded plainly, with ``ngram`` and with ``auto``, the order
rotating prompt by prompt, one engine each (as ``localspec bench drafters --versus``), greedy.

Time is this thread's CPU time (``time.thread_time``; with ``--threads 1`` llama.cpp computes on
the calling thread), scaled to the generation loop by the engine's own split of wall time
(``t_generate_us`` over generation plus prefill), so other processes on a loaded machine
inflate it less than wall time; it is still no quiet measurement. ``--idle`` never probes the
head (``probe_due`` is False): what remains is auto's per-step cost with the head idle (the
feature tap in every target decode, the rows given to the head, the plan's model part).
``--frozen`` keeps each policy's cost table and host times as calibrated (no online update),
so that ngram and auto make the same decisions step for step (the same steps; with
``--idle`` the difference is auto's own cost), where otherwise timing noise makes their
trees diverge.
Prints the head's steps and probes, the CPU and wall seconds and steps of each drafter, and
auto over ngram in tokens per CPU second and per wall second. Outputs must be identical.

Usage: python scripts/auto_idle_cost.py [--ids 241,242,481,482] [--idle] [--frozen] [-n 96] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from localspec import Engine, SamplingParams
from localspec import policy as P
from localspec.costmodel import calibrate

QUESTIONS = Path("/work/shared/data/spec_bench/question.jsonl")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default=str(QUESTIONS))
    ap.add_argument("--ids", default="241,242,481,482")
    ap.add_argument("--idle", action="store_true", help="never probe the head")
    ap.add_argument("--frozen", action="store_true", help="no online update of the cost table and host times")
    ap.add_argument("-n", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    qs = {q["question_id"]: q for q in map(json.loads, Path(a.dataset).read_text().splitlines()) if q}
    ids = [int(x) for x in a.ids.split(",")]
    if a.idle:
        P.SpeculationPolicy.probe_due = lambda self, stats, shape, **kw: False
    base = Engine(drafter="none", n_threads=a.threads)
    cost = calibrate(base.ctx)
    engines = {"plain": base, "ngram": Engine(drafter="ngram", n_threads=a.threads, cost_model=cost),
               "auto": Engine(drafter="auto", n_threads=a.threads, cost_model=cost)}  # fmt: skip
    if a.frozen:
        for e in engines.values():
            e.policy.observe_step = lambda b, t_decode_us, t_host_us: None
    cpu = dict.fromkeys(engines, 0.0)
    wall = dict.fromkeys(engines, 0.0)
    steps = dict.fromkeys(engines, 0)
    try:
        for k, q in enumerate(ids):
            names = list(engines)
            names = names[k % 3 :] + names[: k % 3]
            out = {}
            for name in names:
                e = engines[name]
                e.reset()
                tokens = e.tokenize(qs[q]["turns"][0])
                c0 = time.thread_time()
                r = e.generate(tokens, max_tokens=a.n, sampling=SamplingParams.greedy(), speculative=name != "plain")
                st = r.stats
                cpu[name] += (time.thread_time() - c0) * st.t_generate_us / max(1.0, st.t_generate_us + st.t_prefill_us)
                wall[name] += st.t_generate_us / 1e6
                steps[name] += st.n_steps
                out[name] = r.token_ids
            print(q, "identical:", out["plain"] == out["ngram"] == out["auto"], flush=True)
        st = engines["auto"].drafter.model.stats
        print(f"head: {st.n_steps} drafted steps, {st.n_probes} probes, {st.explore_spent_us / 1e3:.1f} ms charged to probes")
        for name in engines:
            print(f"{name}: CPU {cpu[name]:.2f} s, wall {wall[name]:.2f} s, {steps[name]} steps")
        print(f"auto over ngram: {cpu['ngram'] / cpu['auto']:.3f}x by CPU time, {wall['ngram'] / wall['auto']:.3f}x by wall time")
    finally:
        for e in engines.values():
            e.close()


if __name__ == "__main__":
    main()
