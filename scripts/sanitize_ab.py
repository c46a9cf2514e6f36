"""Two outlier rules for the cost table side by side in one run: two `ngram` engines given the
same measured table (``--table``; default a quiet calibration of a 2-core Intel Xeon whose t(1)
is about t(2), ``docs/results/cost-table-xeon-2026-12-06.json``), one cleaned by the candidate
(``--candidate``), the other by the power law alone (``costmodel.sanitize_table`` without
samples, which replaces that t(1) of 22.4 ms by ~9 ms). Candidates:

* ``repeated``: ``sanitize_table`` with the sizes whose calibration samples repeated kept
  (``--repeated``, default 1: the Xeon's three rounds measured t(1) within 1.1x);
* ``power_or_line``: an entry is replaced only when it is 2x off both a power law and a line
  ``t0 + c b`` (tried 2026-12-06, not kept, docs/results.md).

Spec-Bench prompts, greedy, the engines alternating prompt by prompt
(``bench.drafters.compare_drafters``). Prints per category each engine's speed over plain and
the old rule's over the candidate (``old/new``, 95% bootstrap interval over prompts). Outputs
must be identical.

Usage: python scripts/sanitize_ab.py [--dataset question.jsonl] [--per-category 2] [--repeats 1]
       [--out FILE] [--table FILE] [--candidate repeated|power_or_line] [--repeated 1,2]
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


def _theil_sen(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    i, j = np.triu_indices(x.size, 1)
    k = float(np.median((y[j] - y[i]) / (x[j] - x[i])))
    return k, float(np.median(y - k * x))


def power_or_line(table_us: dict[int, float], tolerance: float = 2.0) -> tuple[dict[int, float], list[int]]:
    """The candidate rule: an entry more than ``tolerance`` off both a Theil-Sen power law and a
    Theil-Sen line is replaced by the power law's value."""
    sizes = sorted(table_us)
    t = np.array([table_us[b] for b in sizes], dtype=np.float64)
    b = np.array(sizes, dtype=np.float64)
    k, a = _theil_sen(np.log(b), np.log(t))
    power = np.exp(a + k * np.log(b))
    c, t0 = _theil_sen(b, t)
    line = t0 + c * b
    lim = np.log(tolerance)
    off = (np.abs(np.log(t / power)) > lim) & ((line <= 0) | (np.abs(np.log(t / np.maximum(line, 1e-300))) > lim))
    out, bad = dict(table_us), []
    for size, p, o in zip(sizes, power, off):
        if o:
            out[size], bad = float(p), bad + [size]
    return out, bad


def with_rule(rule, table_us: dict[int, float]):
    def configure(engine) -> None:
        cm = engine.policy.cost
        cm.table_us, cm.cache_ref = dict(table_us), None
        cm._clean, cm.outliers = rule(cm.table_us)
        cm.repeated = frozenset()  # the rule decides (an expiry would use the product's)
        cm._invalidate()  # the curves and table ratios of the table replaced
        print(f"{rule.__name__}: t(1..8) ms", {b: round(cm.t_decode_us(b) / 1e3, 1) for b in (1, 2, 4, 8)}, file=sys.stderr)

    return configure


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="/work/shared/data/spec_bench/question.jsonl")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out")
    ap.add_argument("--table", default=str(TABLE), help="JSON with table_us: b -> µs (a raw calibration)")
    ap.add_argument("--candidate", choices=("repeated", "power_or_line"), default="repeated")
    ap.add_argument("--repeated", default="1", help="sizes whose samples repeated, comma-separated")
    a = ap.parse_args()
    if a.candidate == "repeated":
        kept = frozenset(int(b) for b in a.repeated.split(","))

        def candidate(table_us):
            return sanitize_table(table_us, repeated=kept)

        candidate.__name__ = f"repeated={sorted(kept)}"
    else:
        candidate = power_or_line
    table = {int(k): float(v) for k, v in json.loads(Path(a.table).read_text())["table_us"].items()}
    prompts = interleave(select_prompts(load_questions(a.dataset), None, a.per_category))
    names = ("ngram", "ngram#2")
    rows = compare_drafters(str(default_model_path()), prompts, names, max_tokens=128, repeats=a.repeats,
                            configure={"ngram": with_rule(candidate, table), "ngram#2": with_rule(sanitize_table, table)})  # fmt: skip
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f)
    for e in summarize_versus(rows, names):
        lo, hi = e["last_over_first_ci"]
        print(f"{e['category']}: new {e['ngram']['speed_vs_plain']:.3f}x, old {e['ngram#2']['speed_vs_plain']:.3f}x of plain, "
              f"old/new {e['last_over_first']:.3f} ({lo:.3f}-{hi:.3f}), identical {e['ngram']['identical']}+{e['ngram#2']['identical']}/{2 * e['prompts']}")  # fmt: skip


if __name__ == "__main__":
    main()
