"""A model drafter with and without ``SpeculationPolicy.select_model_nodes``, side by side in one
run: for each prompt, plain decoding and two engines of the same drafter (default the shipped
EAGLE-3 head alone), one of whose policies never selects (``select_model_nodes`` answers None:
every model step verifies the plan's size, and no step's worth is measured, so the acceptance
estimate decides as before the rule). Engines alternate prompt by prompt, each round in the
reverse order of the one before; greedy. Prints per category each engine's speed over plain,
new over old, the head's emitted tokens and MAL, and whether every output equals plain's.

    python scripts/model_select_ab.py --dataset question.jsonl --per-category 5 --repeats 2 [--chat-format] [--json out.json]

For ``auto`` the old rule also probed on steps with n-gram drafts, which the override does not
restore: use it for a drafter alone.
"""

from __future__ import annotations

import argparse
import json
import sys

from localspec import Engine, SamplingParams
from localspec.bench.dataset import as_chat, load_questions, resolve_dataset, select_prompts
from localspec.costmodel import calibrate


def main() -> None:
    run_ab(lambda old: setattr(old.policy, "select_model_nodes", lambda *a, **k: None))


def run_ab(patch_old) -> None:
    """The A/B run on the command line's arguments: plain decoding, and two engines of the
    drafter, the "old" one changed by ``patch_old(engine)`` (shared by the scripts that set a
    policy rule back against the one in place: ``probe_gap_ab.py``)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--per-category", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("-n", "--max-tokens", type=int, default=128)
    ap.add_argument("--drafter", default="eagle3")
    ap.add_argument("--chat-format", action="store_true", help="each prompt as a user turn (bench.dataset.as_chat)")
    ap.add_argument("--json", default=None, help="also write the per-prompt numbers here")
    args = ap.parse_args()
    prompts = select_prompts(load_questions(resolve_dataset(args.dataset)), None, args.per_category)
    base = Engine(None, drafter="none", n_ctx=4096)
    if args.chat_format:
        prompts = as_chat(prompts, base.model)
    engines = {"plain": base}
    for name in ("old", "new"):
        engines[name] = Engine(None, drafter=args.drafter, n_ctx=4096, cost_model=calibrate(base.ctx))
    patch_old(engines["old"])
    greedy = SamplingParams.greedy()
    names, rows = list(engines), []
    try:
        for i, bp in enumerate(prompts):
            order = names[i % 3 :] + names[: i % 3]
            row = {"category": bp.category, "question_id": bp.question_id}
            ids = {}
            for k in range(args.repeats):
                for n in order if k % 2 == 0 else order[::-1]:
                    e = engines[n]
                    e.reset()
                    r = e.generate(bp.text if bp.tokens is None else bp.tokens, max_tokens=args.max_tokens, sampling=greedy, speculative=n != "plain")
                    d = row.setdefault(n, {"t": [], "n": r.stats.n_generated_tokens, "src": dict(r.stats.token_sources),
                                           "mal": r.stats.mean_acceptance_length})  # fmt: skip
                    d["t"].append(r.stats.t_generate_us)
                    ids.setdefault(n, []).append(r.token_ids)
            for n in ("old", "new"):
                row[n]["identical"] = all(x == ids["plain"][0] for x in ids[n])
            rows.append(row)
            print(f"{i + 1}/{len(prompts)}", file=sys.stderr)
    finally:
        for e in engines.values():
            e.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"prompts": rows, "drafter": args.drafter}, f)

    def tps(rs, n):
        return sum(r[n]["n"] for r in rs) / sum(sum(r[n]["t"]) / len(r[n]["t"]) for r in rs)

    src = "eagle3" if args.drafter == "eagle3" else args.drafter
    print("category        old/plain new/plain new/old  model tokens old/new  MAL old/new  identical")
    for c in sorted({r["category"] for r in rows}) + ["all"]:
        rs = [r for r in rows if c == "all" or r["category"] == c]
        print(f"{c:15s} {tps(rs, 'old') / tps(rs, 'plain'):9.3f} {tps(rs, 'new') / tps(rs, 'plain'):9.3f} "
              f"{tps(rs, 'new') / tps(rs, 'old'):7.3f}  {sum(r['old']['src'].get(src, 0) for r in rs):9d}/"
              f"{sum(r['new']['src'].get(src, 0) for r in rs):<9d} {sum(r['old']['mal'] for r in rs) / len(rs):5.2f}/"
              f"{sum(r['new']['mal'] for r in rs) / len(rs):<5.2f}  {sum(r['old']['identical'] and r['new']['identical'] for r in rs)}/{len(rs)}")  # fmt: skip


if __name__ == "__main__":
    main()
