"""Probe gaps sized by the last probe's measured cost (the policy as it is) against the rule
before (``paid_explore_gap`` from ``probe_us``, which prices every planned node as verified,
baked into the stored gap at each probe; the budget check at the larger of that estimate and
the last measured cost), side by side in one run: for each prompt, plain decoding and two
engines of the same drafter (default the shipped EAGLE-3 head alone), the "old" one's policy
patched back to the rule before. Engines alternate prompt by prompt, each round in the
reverse order of the one before; greedy. Prints per category each engine's speed over plain
(summed times, the mean of the rounds), new over old, the head's emitted tokens, and whether
every output equals plain's.

    python scripts/probe_gap_ab.py --dataset question.jsonl --per-category 5 --repeats 2 [--chat-format] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from localspec import Engine, SamplingParams
from localspec.bench.dataset import as_chat, load_questions, resolve_dataset, select_prompts
from localspec.costmodel import calibrate


def patch_old_gaps(pol) -> None:
    """The exploration gaps of the policy before ``probe_cost_us`` (on this instance only)."""

    def paid_old(stats, shape):
        return math.ceil(pol.probe_us(stats, shape) / (pol.explore_budget * pol.step_us(1)))

    def next_old(stats):
        gap = 2 * stats.explore_gap if stats.explore_gap else pol.explore_every
        return min(max(gap, paid_old(stats, stats.last_shape)), pol.max_explore_gap(stats, stats.last_shape))

    pol.paid_explore_gap = paid_old
    pol.next_explore_gap = next_old
    pol.explore_gap_due = lambda stats, shape: max(stats.explore_gap or pol.explore_every, paid_old(stats, shape))
    pol.probe_cost_us = lambda stats, shape: max(pol.probe_us(stats, shape), stats.last_probe_us)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--per-category", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("-n", "--max-tokens", type=int, default=128)
    ap.add_argument("--drafter", default="eagle3")
    ap.add_argument("--chat-format", action="store_true", help="each prompt as a user turn (bench.dataset.as_chat)")
    ap.add_argument("--json", default=None, help="also write the per-prompt numbers here")
    a = ap.parse_args()
    prompts = select_prompts(load_questions(resolve_dataset(a.dataset)), None, a.per_category)
    base = Engine(None, drafter="none", n_ctx=4096)
    if a.chat_format:
        prompts = as_chat(prompts, base.model)
    eng = {"plain": base}
    for name in ("old", "new"):
        eng[name] = Engine(None, drafter=a.drafter, n_ctx=4096, cost_model=calibrate(base.ctx))
    patch_old_gaps(eng["old"].policy)
    greedy, names, rows = SamplingParams.greedy(), list(eng), []
    try:
        for i, bp in enumerate(prompts):
            order = names[i % 3 :] + names[: i % 3]
            row, ids = {"category": bp.category, "qid": bp.question_id}, {}
            for k in range(a.repeats):
                for n in order if k % 2 == 0 else order[::-1]:
                    e = eng[n]
                    e.reset()
                    r = e.generate(bp.text if bp.tokens is None else bp.tokens, max_tokens=a.max_tokens, sampling=greedy, speculative=n != "plain")
                    d = row.setdefault(n, {"t": [], "n": r.stats.n_generated_tokens, "src": dict(r.stats.token_sources)})
                    d["t"].append(r.stats.t_generate_us)
                    ids.setdefault(n, []).append(r.token_ids)
            for n in ("old", "new"):
                row[n]["identical"] = all(x == ids["plain"][0] for x in ids[n])
            rows.append(row)
            print(f"{i + 1}/{len(prompts)}", file=sys.stderr)
    finally:
        for e in eng.values():
            e.close()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f)

    def tps(rs, n):
        return sum(r[n]["n"] for r in rs) / sum(sum(r[n]["t"]) / len(r[n]["t"]) for r in rs)

    src = "eagle3" if a.drafter in ("eagle3", "auto") else a.drafter
    for c in sorted({r["category"] for r in rows}) + ["all"]:
        rs = [r for r in rows if c == "all" or r["category"] == c]
        print(f"{c:15s} old/plain {tps(rs, 'old') / tps(rs, 'plain'):.3f} new/plain {tps(rs, 'new') / tps(rs, 'plain'):.3f} "
              f"new/old {tps(rs, 'new') / tps(rs, 'old'):.3f} head tokens {sum(r['old']['src'].get(src, 0) for r in rs)}/"
              f"{sum(r['new']['src'].get(src, 0) for r in rs)} identical {sum(r['old']['identical'] and r['new']['identical'] for r in rs)}/{len(rs)}")  # fmt: skip


if __name__ == "__main__":
    main()
