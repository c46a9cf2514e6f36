"""The cost table's outlier rule before and after 3a82707, side by side in one run: two `ngram`
engines given the same measured table (``FLAT_START_TABLE``: a quiet calibration of a 2-core
Intel Xeon, t(1) about t(2)), one cleaned by ``costmodel.sanitize_table`` (an entry is replaced
only when it is 2x off both a power law and a line), the other by the power law alone (the
rule before, which replaced that t(1) of 22.4 ms by ~9 ms). Spec-Bench prompts, greedy, the
engines alternating prompt by prompt (``bench.drafters.compare_drafters``).

Prints per category each engine's speed over plain and the old rule's over the new one
(``old/new``, 95% bootstrap interval over prompts). Outputs must be identical.

Usage: python scripts/sanitize_ab.py [--dataset question.jsonl] [--per-category 2] [--repeats 1] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from localspec.bench.dataset import interleave, load_questions, select_prompts
from localspec.bench.drafters import compare_drafters, summarize_versus
from localspec.costmodel import sanitize_table
from localspec.models import default_model_path

FLAT_START_TABLE = {
    1: 22400.0, 2: 21000.0, 3: 24800.0, 4: 27400.0, 5: 32200.0, 6: 34700.0, 7: 39400.0, 8: 40000.0,
    9: 47400.0, 10: 48900.0, 11: 52500.0, 12: 61900.0, 13: 62000.0, 14: 63100.0, 15: 67300.0,
    16: 69300.0, 20: 87500.0, 24: 102600.0, 28: 129900.0, 32: 137400.0, 40: 169800.0, 48: 217700.0,
    56: 236900.0, 64: 276100.0,
}  # fmt: skip


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


def with_rule(rule):
    def configure(engine) -> None:
        cm = engine.policy.cost
        cm.table_us, cm.cache_ref = dict(FLAT_START_TABLE), None
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
    a = ap.parse_args()
    prompts = interleave(select_prompts(load_questions(a.dataset), None, a.per_category))
    names = ("ngram", "ngram#2")
    rows = compare_drafters(str(default_model_path()), prompts, names, max_tokens=128, repeats=a.repeats,
                            configure={"ngram": with_rule(sanitize_table), "ngram#2": with_rule(power_law_only)})  # fmt: skip
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f)
    for e in summarize_versus(rows, names):
        lo, hi = e["last_over_first_ci"]
        print(f"{e['category']}: new {e['ngram']['speed_vs_plain']:.3f}x, old {e['ngram#2']['speed_vs_plain']:.3f}x of plain, "
              f"old/new {e['last_over_first']:.3f} ({lo:.3f}-{hi:.3f}), identical {e['ngram']['identical']}+{e['ngram#2']['identical']}/{2 * e['prompts']}")  # fmt: skip


if __name__ == "__main__":
    main()
