"""Replay the greedy outputs recorded by `localspec bench memory --out REPORT.json` through
the n-gram drafter with and without a drafting memory, at fixed verification budgets, and
print the tokens per target call of each (no model, no clock: independent of the machine's
load). See localspec.bench.memory.replay.

    python scripts/memory_replay.py REPORT.json [--budgets 8,16,32] [--json]
"""

import argparse
import json

from localspec.bench.memory import replay


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("report")
    p.add_argument("--budgets", default="8,16,32")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    with open(a.report) as f:
        workloads = json.load(f)["workloads"]
    rows = {int(b): replay(workloads, budget=int(b)) for b in a.budgets.split(",")}
    if a.json:
        print(json.dumps(rows, indent=2))
        return
    print("| workload | tokens | budget | calls off | calls on | tokens/call off | on | on/off |\n|---|---|---|---|---|---|---|---|")
    for b, rs in rows.items():
        tot = {"tokens": 0, "calls_off": 0, "calls_on": 0}
        for r in rs:
            for k in tot:
                tot[k] += r[k]
            print(f"| {r['name']} | {r['tokens']} | {b} | {r['calls_off']} | {r['calls_on']} | {r['tokens_per_call_off']:.2f} "
                  f"| {r['tokens_per_call_on']:.2f} | {r['tokens_per_call_on'] / r['tokens_per_call_off']:.3f} |")
        off, on = tot["tokens"] / tot["calls_off"], tot["tokens"] / tot["calls_on"]
        print(f"| **all** | {tot['tokens']} | {b} | {tot['calls_off']} | {tot['calls_on']} | {off:.2f} | {on:.2f} | {on / off:.3f} |")


if __name__ == "__main__":
    main()
