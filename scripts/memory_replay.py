"""Replay the greedy outputs recorded by `localspec bench memory --out REPORT.json` through
the n-gram drafter with and without a drafting memory, and print the tokens per target call
of each (no model, no clock: independent of the machine's load). See
localspec.bench.memory.replay and replay_policy.

    python scripts/memory_replay.py REPORT.json [--budgets 8,16,32] [--json]
    python scripts/memory_replay.py REPORT.json --costs ~/.cache/localspec/costs.json
    python scripts/memory_replay.py REPORT.json --costs ~/.cache/localspec/costs.json --bound

With --costs (the cost cache, or a JSON object batch size -> µs), each step verifies what the
engine's policy chooses on that cost table, and the time column is the policy's own
estimate of decode time (table + host prior): an estimate, not a measurement.
With --bound as well, each workload's row adds the upper bound of copying drafters on the
same table (``replay_bound``: the right occurrence, verified exactly as far as it agrees),
with and without the run's earlier text.
"""

import argparse
import json

from localspec.bench.memory import replay, replay_bound, replay_policy


def _table(spec: str) -> dict:
    """PATH (one table) or PATH:KEY (the cost cache's entry KEY)."""
    path, _, key = spec.partition(":")
    with open(path) as f:
        data = json.load(f)
    if all(k.isdigit() for k in data):
        return data
    entries = {k: v["table_us"] for k, v in data.items() if isinstance(v, dict) and "table_us" in v}
    if key:
        return entries[key]
    if len(entries) != 1:
        raise SystemExit(f"{path}: {len(entries)} cost tables; name one as {path}:KEY ({', '.join(entries)})")
    return next(iter(entries.values()))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("report")
    p.add_argument("--budgets", default="8,16,32")
    p.add_argument("--costs", default=None, metavar="JSON", help="replay the policy on this cost table (PATH or PATH:KEY of the cost cache) instead of fixed budgets")
    p.add_argument("--bound", action="store_true", help="with --costs: add the upper bound of copying drafters (replay_bound)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    with open(a.report) as f:
        workloads = json.load(f)["workloads"]
    if a.costs:
        table = _table(a.costs)
        rs = replay_policy(workloads, table)
        if a.bound:
            for r, b in zip(rs, replay_bound(workloads, table)):
                r.update({k: v for k, v in b.items() if k not in ("name", "tokens")})
        if a.json:
            print(json.dumps(rs, indent=2))
            return
        extra = " bound own | mem | mem/own |" if a.bound else ""
        print(f"| workload | tokens | calls off | on | tokens/call off | on | est. tok/s off | on | on/off |{extra}\n"
              f"|---|---|---|---|---|---|---|---|---|{'---|---|---|' if a.bound else ''}")
        keys = ["tokens", "calls_off", "calls_on", "est_us_off", "est_us_on"] + (["est_us_own", "est_us_mem"] if a.bound else [])
        tot = dict.fromkeys(keys, 0)
        for r in rs + [None]:
            if r is None:
                r = dict(tot, name="**all**")
            else:
                for k in tot:
                    tot[k] += r[k]
            off, on = r["tokens"] / r["est_us_off"] * 1e6, r["tokens"] / r["est_us_on"] * 1e6
            line = (f"| {r['name']} | {r['tokens']} | {r['calls_off']} | {r['calls_on']} | {r['tokens'] / r['calls_off']:.2f} "
                    f"| {r['tokens'] / r['calls_on']:.2f} | {off:.1f} | {on:.1f} | {on / off:.3f} |")
            if a.bound:
                own, mem = r["tokens"] / r["est_us_own"] * 1e6, r["tokens"] / r["est_us_mem"] * 1e6
                line += f" {own:.1f} | {mem:.1f} | {mem / own:.3f} |"
            print(line)
        return
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
