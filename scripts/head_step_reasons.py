"""Why ``auto`` drafted with its EAGLE-3 head on each step, per prompt: counts, not a speed claim.

Runs one ``auto`` engine (the default model and its shipped head) greedily over the first
``--per-category`` Spec-Bench questions of the categories given, in that order (the drafter's
statistics carry over between prompts, as in ``localspec bench``), and prints per prompt: the
step's times (generation, drafting, decode and host, ms), the steps, the tokens the head got
accepted, how many steps the plan ran the head and why (``probe``: a paid probe;
``value``: the head's measured worth where the n-grams verify nothing; ``estimate``: its
expected rate from the per-depth acceptance counts, ``/nothing`` or ``/ngrams`` for what the
n-grams would verify), the verified batch sizes (rows: steps), the steps with the feature tap
on / paused, and the head's worth after the prompt.

Usage: python scripts/head_step_reasons.py --dataset question.jsonl [--categories mt_bench,translation]
       [--per-category 10] [-n 128]
"""

from __future__ import annotations

import argparse
import collections

from localspec import Engine, SamplingParams
from localspec.bench.dataset import load_questions, select_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", required=True, help="Spec-Bench question.jsonl")
    ap.add_argument("--categories", default="mt_bench,translation", help="in this order")
    ap.add_argument("--per-category", type=int, default=10)
    ap.add_argument("-n", "--max-tokens", type=int, default=128)
    a = ap.parse_args()
    cats = a.categories.split(",")
    ps = select_prompts(load_questions(a.dataset), cats, a.per_category)
    order = [p for c in cats for p in ps if p.category == c]
    e = Engine(drafter="auto", n_ctx=4096)
    pol = e.policy
    why: collections.Counter = collections.Counter()
    rows: collections.Counter = collections.Counter()
    times: collections.Counter = collections.Counter()
    tap: collections.Counter = collections.Counter()
    last = [None]

    prefer_model, plan, observe_step, needs_features = pol.prefer_model, pol.plan, pol.observe_step, pol.needs_features

    def prefer(cheap, stats, shape=None, *, t_spent_us=0.0):
        r = prefer_model(cheap, stats, shape, t_spent_us=t_spent_us)
        last[0] = (cheap.n_nodes <= 1 and stats.value > 1.0, cheap.n_nodes <= 1)
        return r

    def planned(cheap, model, **kw):
        last[0] = None
        sp = plan(cheap, model, **kw)
        if sp.shape is not None:
            if sp.probe:
                why["probe"] += 1
            elif last[0] is not None:
                by_value, nothing = last[0]
                why[("value" if by_value else "estimate") + ("/nothing" if nothing else "/ngrams")] += 1
        return sp

    def observed(b, t_decode_us, t_host_us):
        rows[b] += 1
        times["decode"] += t_decode_us
        times["host"] += t_host_us
        return observe_step(b, t_decode_us, t_host_us)

    def needs(stats):
        r = needs_features(stats)
        tap[r] += 1
        return r

    pol.prefer_model, pol.plan, pol.observe_step, pol.needs_features = prefer, planned, observed, needs
    g = SamplingParams.greedy()
    for p in order:
        for c in (why, rows, times, tap):
            c.clear()
        e.reset()
        s = e.generate(p.model_input, max_tokens=a.max_tokens, sampling=g).stats
        print(p.question_id, p.category,
              "gen %.0f draft %.0f decode %.0f host %.0f ms" % (s.t_generate_us / 1e3, s.t_draft_us / 1e3, times["decode"] / 1e3, times["host"] / 1e3),
              "steps", s.n_steps, "head tokens", s.token_sources.get("eagle3", 0), "head steps", dict(why),
              "rows", dict(sorted(rows.items())), "tap on/off %d/%d" % (tap[True], tap[False]),
              "worth %.2f" % e.drafter.model.stats.value, flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
