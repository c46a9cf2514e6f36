"""The cost table's outlier rule before and after 3a82707, side by side in one run: two `ngram`
engines given the same measured table (``--table``; default a quiet calibration of a 2-core
Intel Xeon whose t(1) is about t(2), ``docs/results/cost-table-xeon-2026-12-06.json``), one
cleaned by ``costmodel.sanitize_table`` (an entry is replaced only when it is 2x off both a
power law and a line), the other by the power law alone (the rule before, which replaced that
t(1) of 22.4 ms by ~9 ms). Spec-Bench prompts, greedy, the
engines alternating prompt by prompt (``bench.drafters.compare_drafters``).

Prints per category each engine's speed over plain and the old rule's over the new one
(``old/new``, 95% bootstrap interval over prompts). Outputs must be identical.

Usage: python scripts/sanitize_ab.py [--dataset question.jsonl] [--per-category 2] [--repeats 1] [--out FILE] [--table FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from localspec.bench.dataset import interleave, load_questions, select_prompts
from localspec.bench.drafters import compare_drafters, summarize_versus
from localspec.costmodel import sanitize_table
from localspec.models import default_model_path

TABLE = Path(__file__).resolve().parent.parent / "docs/results/cost-table-xeon-2026-12-06.json"


def power_law_only(table_us: dict[int, float], tolerance: float = 2.0) -> tuple[dict[int, float], list[int]]:
    """The rule before: entries more than ``tolerance`` off a Theil-Sen power law are replaced."""
    sizes = sorted(table_us)
    y = np.log(np.array([table_us[b] for b in sizes]))
    x = np.log(np.array(sizes, dtype=np.float64))
    i, j = np.triu_indices(len(sizes), 1)
    k = float(np.median((y[j] - y[i]) / (x[j] - x[i])))
    a = float(np.median(y - k * x))
    out, bad = dict(table_us), []
    for b, yi, fi in zip(sizes, y, a + k * x):
        if abs(yi - fi) > np.log(tolerance):
            out[b], bad = float(np.exp(fi)), bad + [b]
    return out, bad


def with_rule(rule, table_us: dict[int, float]):
    def configure(engine) -> None:
        cm = engine.policy.cost
        cm.table_us, cm.cache_ref = dict(table_us), None
        cm._clean, cm.outliers = rule(cm.table_us)
        cm._curve = None
        print(f"{rule.__name__}: t(1..8) ms", {b: round(cm.t_decode_us(b) / 1e3, 1) for b in (1, 2, 4, 8)}, file=sys.stderr)

    return configure


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="/work/shared/data/spec_bench/question.jsonl")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out")
    ap.add_argument("--table", default=str(TABLE), help="JSON with table_us: b -> µs (a raw calibration)")
    a = ap.parse_args()
    table = {int(k): float(v) for k, v in json.loads(Path(a.table).read_text())["table_us"].items()}
    prompts = interleave(select_prompts(load_questions(a.dataset), None, a.per_category))
    names = ("ngram", "ngram#2")
    rows = compare_drafters(str(default_model_path()), prompts, names, max_tokens=128, repeats=a.repeats,
                            configure={"ngram": with_rule(sanitize_table, table), "ngram#2": with_rule(power_law_only, table)})  # fmt: skip
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f)
    for e in summarize_versus(rows, names):
        lo, hi = e["last_over_first_ci"]
        print(f"{e['category']}: new {e['ngram']['speed_vs_plain']:.3f}x, old {e['ngram#2']['speed_vs_plain']:.3f}x of plain, "
              f"old/new {e['last_over_first']:.3f} ({lo:.3f}-{hi:.3f}), identical {e['ngram']['identical']}+{e['ngram#2']['identical']}/{2 * e['prompts']}")  # fmt: skip


if __name__ == "__main__":
    main()
