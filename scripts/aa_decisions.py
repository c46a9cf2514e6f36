"""Where the spread between two identical engines comes from: pairs of `ngram` engines, each
pair with one kind of online learning switched off, decoding the same prompts in one run
(``bench.drafters.compare_drafters``: plain decoding and every engine alternate prompt by
prompt, greedy). For each pair: how many prompts took the same number of target calls in
both engines (the same decisions), the spread of those counts, and the spread of the time
ratio per prompt (median of the rounds, and their minimum).

    python scripts/aa_decisions.py --dataset question.jsonl --per-category 3 --repeats 3 --chat-format --pairs online,frozen [--json out.json]

Pairs: ``online`` (the engine as shipped), ``frozen`` (``SpeculationPolicy.observe_step`` does
nothing: the cost model keeps its calibrated table, the host times their priors),
``no-cost`` (the cost model learns nothing online; the host times still do), ``no-host``
(the host times learn nothing; the cost model still does). Measured results:
docs/results.md (the A/A spread on the AMD EPYC, 2026-12-07).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from localspec.backend import Model
from localspec.bench.dataset import as_chat, load_questions, resolve_dataset, select_prompts
from localspec.bench.drafters import compare_drafters
from localspec.models import resolve_model


def _frozen(engine) -> None:
    engine.policy.observe_step = lambda *a, **k: None


def _no_cost(engine) -> None:
    engine.policy.cost.observe = lambda *a, **k: None


def _no_host(engine) -> None:
    p = engine.policy
    observe = p.observe_step

    def keep_host_priors(b, t_decode_us, t_host_us):
        saved = p.t_host_base_us, p.t_host_node_us, p._host_node_load
        observe(b, t_decode_us, t_host_us)
        p.t_host_base_us, p.t_host_node_us, p._host_node_load = saved

    p.observe_step = keep_host_priors


PAIRS = {"online": None, "frozen": _frozen, "no-cost": _no_cost, "no-host": _no_host}


def summarize(rows: list[dict], a: str, b: str) -> dict:
    """Per pair: prompts with equal step counts, spread (sd of the log) of the step ratio and
    of the time ratio per prompt (median of the rounds; minimum of the rounds), and b over a."""
    steps = np.array([[r[a]["n_steps"], r[b]["n_steps"]] for r in rows], dtype=float)
    ra = np.array([r[a]["t_decode_us_rounds"] for r in rows])
    rb = np.array([r[b]["t_decode_us_rounds"] for r in rows])
    med = np.log(np.median(rb, 1) / np.median(ra, 1))
    low = np.log(rb.min(1) / ra.min(1))
    return {
        "same_steps": int(np.sum(steps[:, 0] == steps[:, 1])),
        "prompts": len(rows),
        "steps_sd": float(np.std(np.log(steps[:, 1] / steps[:, 0]))),
        "time_sd_median": float(med.std()),
        "time_sd_min": float(low.std()),
        "b_over_a": float(np.exp(med.mean())),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--per-category", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-n", "--max-tokens", type=int, default=128)
    ap.add_argument("--chat-format", action="store_true", help="each prompt as a user turn (bench.dataset.as_chat)")
    ap.add_argument("--pairs", default="online,frozen", help=f"comma-separated, of {', '.join(PAIRS)}")
    ap.add_argument("--json", default=None, help="also write the per-prompt rows and the summary here")
    args = ap.parse_args()
    pairs = args.pairs.split(",")
    unknown = [p for p in pairs if p not in PAIRS]
    if unknown:
        ap.error(f"unknown pair {unknown[0]!r}; choose from {', '.join(PAIRS)}")
    prompts = select_prompts(load_questions(resolve_dataset(args.dataset)), None, args.per_category)
    labels, configure = [], {}
    for i, kind in enumerate(pairs):
        for j in (0, 1):
            label = f"ngram#{2 * i + j + 1}" if 2 * i + j else "ngram"
            labels.append(label)
            if PAIRS[kind] is not None:
                configure[label] = PAIRS[kind]
    model = Model(resolve_model(None))
    try:
        if args.chat_format:
            prompts = as_chat(prompts, model)
        rows = compare_drafters(model, prompts, labels, max_tokens=args.max_tokens, repeats=args.repeats,
                                configure=configure, progress=lambda i, n, _r: print(f"{i}/{n}", file=sys.stderr))  # fmt: skip
    finally:
        model.close()
    summary = {}
    print("pair      same steps  steps sd  time sd (median / min)  B/A    speed/plain A, B   identical")
    for i, kind in enumerate(pairs):
        a, b = labels[2 * i], labels[2 * i + 1]
        s = summary[kind] = summarize(rows, a, b)
        plain = sum(r["plain"]["t_decode_us"] for r in rows)
        speed = [plain / sum(r[x]["t_decode_us"] for r in rows) for x in (a, b)]
        same = sum(r[a]["identical"] and r[b]["identical"] for r in rows)
        print(f"{kind:9s} {s['same_steps']:4d}/{s['prompts']:<5d} {s['steps_sd']:8.3f}  {s['time_sd_median']:8.3f} / "
              f"{s['time_sd_min']:.3f}       {s['b_over_a']:.3f}  {speed[0]:.3f}, {speed[1]:.3f}   {same}/{len(rows)}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"prompts": rows, "summary": summary, "pairs": pairs, "labels": labels}, f)


if __name__ == "__main__":
    main()
