"""A model drafter with and without ``SpeculationPolicy.select_model_nodes``, side by side in one
run: for each prompt, plain decoding and two engines of the same drafter (default the shipped
EAGLE-3 head alone), one of whose policies never selects (``select_model_nodes`` answers None:
every model step verifies the plan's size, and no step's worth is measured, so the acceptance
estimate decides as before the rule). Engines alternate prompt by prompt, each round in the
reverse order of the one before; greedy. Prints per category each engine's speed over plain,
new over old with its 95% bootstrap interval over prompts, the head's emitted tokens and MAL,
and how many prompts' outputs equal plain's in every round.

    python scripts/model_select_ab.py --dataset question.jsonl --per-category 5 --repeats 2 [--chat-format] [--json out.json]

For ``auto`` the old rule also probed on steps with n-gram drafts, which the override does not
restore: use it for a drafter alone.
"""

from __future__ import annotations

import argparse
import json
import sys

from localspec.backend import Model
from localspec.bench.dataset import as_chat, load_questions, resolve_dataset, select_prompts
from localspec.bench.drafters import compare_drafters, summarize_versus
from localspec.models import resolve_model


def main() -> None:
    run_ab(lambda old: setattr(old.policy, "select_model_nodes", lambda *a, **k: None))


def run_ab(patch_old) -> None:
    """The A/B run on the command line's arguments (``bench.drafters.compare_drafters``: plain
    decoding and two engines of the drafter, alternating, greedy), the "old" one changed by
    ``patch_old(engine)`` (shared by the scripts that set a policy rule back against the one
    in place: ``probe_gap_ab.py``). ``--json`` writes ``compare_drafters``' rows and
    ``summarize_versus``' summary, with the engines labelled ``D`` (old) and ``D#2`` (new)."""
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
    model = Model(resolve_model(None))
    try:
        if args.chat_format:
            prompts = as_chat(prompts, model)
        old, new = args.drafter, f"{args.drafter}#2"
        rows = compare_drafters(model, prompts, [old, new], max_tokens=args.max_tokens, repeats=args.repeats,
                                configure={old: patch_old}, progress=lambda i, n, _r: print(f"{i}/{n}", file=sys.stderr))  # fmt: skip
    finally:
        model.close()
    summary = summarize_versus(rows, [old, new])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"prompts": rows, "summary": summary, "drafter": args.drafter, "old": old, "new": new}, f)
    src = "eagle3" if args.drafter in ("eagle3", "auto") else args.drafter
    print("category        old/plain new/plain new/old (95% interval)  model tokens old/new  MAL old/new  identical old/new")
    for e in summary:
        o, w = e[old], e[new]
        lo, hi = e["last_over_first_ci"]
        print(f"{e['category']:15s} {o['speed_vs_plain']:9.3f} {w['speed_vs_plain']:9.3f} {e['last_over_first']:7.3f} ({lo:.3f}-{hi:.3f})  "
              f"{o['token_sources'].get(src, 0):9d}/{w['token_sources'].get(src, 0):<9d} {o['mal']:5.2f}/{w['mal']:<5.2f}  "
              f"{o['identical']}/{w['identical']} of {e['prompts']}")  # fmt: skip


if __name__ == "__main__":
    main()
