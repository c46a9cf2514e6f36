"""Counts of what the policy did, with an ESTIMATE of the decode time that a loaded machine
cannot measure: ``auto`` (n-grams + the shipped EAGLE-3 head) under the policy of a git
revision (``--before``, default ae4d81d: before the probes of issue 30 part 4) and under this
tree's, greedy, on held-out Spec-Bench prompts in one engine each (the drafter's statistics
carry over between prompts, as in ``localspec bench``).

Then ``ngram`` alone under this tree's policy, for ``auto``'s "never below its best part".
Per prompt and run: steps, steps the head drafted, tokens the head got accepted, drafted
and accepted tokens, and an estimate of the decode time: the engine's cost table ``t(b)`` for
each step's batch plus the head's measured level times. The counts are exact; the estimate
only ranks the two policies (the table and the head times are what this machine measured,
under whatever load it had) and is no speed claim. Outputs must be identical.

Usage: python scripts/policy_replay.py [--before REV] [--ids 83,171,251,331,411,491] [-n 128]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import types
from pathlib import Path

from localspec import Engine, SamplingParams
from localspec import policy as P

HELDOUT = Path(__file__).resolve().parent.parent / "docs" / "results" / "heldout-specbench.jsonl"
PATCHED = (("SpeculationPolicy", "plan"), ("SpeculationPolicy", "prefer_model"), ("ScoreCalibration", "exponent"))


def policy_at(rev: str) -> types.ModuleType:
    """``localspec/policy.py`` as it was at ``rev``, loaded as a module beside this one."""
    src = subprocess.run(["git", "show", f"{rev}:localspec/policy.py"], capture_output=True, text=True, check=True).stdout
    mod = types.ModuleType("localspec._policy_before")
    mod.__package__ = "localspec"
    sys.modules[mod.__name__] = mod
    exec(compile(src, f"{rev}:localspec/policy.py", "exec"), mod.__dict__)
    return mod


def use(mod) -> None:
    """The plan, ``prefer_model`` and the calibration exponent of ``mod``'s policy (its plans
    as this tree's ``StepPlan``)."""
    for cls, name in PATCHED:
        setattr(getattr(P, cls), name, getattr(getattr(mod, cls), name))
    plan = mod.SpeculationPolicy.plan
    P.SpeculationPolicy.plan = lambda *a, **k: _as_step_plan(plan(*a, **k))


def _as_step_plan(p) -> "P.StepPlan":
    return P.StepPlan(p.n_nodes, p.shape)


def run(ids: list[int], n: int, drafter: str = "auto") -> dict[int, dict]:
    questions = {q["question_id"]: q for q in map(json.loads, HELDOUT.read_text().splitlines()) if q}
    e = Engine(drafter=drafter)
    sizes: list[int] = []
    observe_step = e.policy.observe_step
    e.policy.observe_step = lambda b, td, th: (sizes.append(b), observe_step(b, td, th))[1]
    model = getattr(e.drafter, "model", None)
    out = {}
    try:
        for q in ids:
            tokens = e.tokenize(questions[q]["turns"][0])
            e.reset()
            sizes.clear()
            levels: list[float] = []  # the model's drafting time of each drafted step (µs)
            observe_levels = e.policy.cost.observe_draft_levels
            e.policy.cost.observe_draft_levels = lambda ts: (levels.append(sum(ts)), observe_levels(ts))[1]
            n0 = model.stats.n_steps if model is not None else 0
            try:
                r = e.generate(tokens, max_tokens=n, sampling=SamplingParams.greedy())
            finally:
                e.policy.cost.observe_draft_levels = observe_levels
            est_us = sum(e.policy.cost._table_at(b) for b in sizes) + sum(levels)
            st = r.stats
            out[q] = dict(steps=st.n_steps, head_steps=model.stats.n_steps - n0 if model is not None else 0, head_tokens=st.token_sources.get("eagle3", 0),
                          drafted=st.num_draft_tokens, accepted=st.num_accepted_tokens, est_ms=round(est_us / 1e3, 1),
                          head_ms=round(sum(levels) / 1e3, 1), tokens=r.token_ids)  # fmt: skip
    finally:
        e.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="ae4d81d")
    ap.add_argument("--ids", default="83,171,251,331,411,491")
    ap.add_argument("-n", type=int, default=128)
    a = ap.parse_args()
    ids = [int(x) for x in a.ids.split(",")]
    now_fns = [(cls, name, getattr(getattr(P, cls), name)) for cls, name in PATCHED]
    use(policy_at(a.before))
    before = run(ids, a.n)
    for cls, name, fn in now_fns:
        setattr(getattr(P, cls), name, fn)
    now = run(ids, a.n)
    ngram = run(ids, a.n, "ngram")
    cols = "steps head-steps head-tok drafted/accepted est-ms"
    print(f"id   | auto before: {cols} | auto now: {cols} | ngram now: steps drafted/accepted est-ms | "
          "est before/now | est ngram/auto-now | identical")
    for q in ids:
        b, c, g = before[q], now[q], ngram[q]
        row = [f"{q:4d}"]
        for x in (b, c):
            row.append(f"{x['steps']:5d} {x['head_steps']:4d} {x['head_tokens']:4d} {x['drafted']:4d}/{x['accepted']:<4d} {x['est_ms']:9.1f}")
        row.append(f"{g['steps']:5d} {g['drafted']:4d}/{g['accepted']:<4d} {g['est_ms']:9.1f}")
        row.append(f"{b['est_ms'] / c['est_ms']:.3f} | {g['est_ms'] / c['est_ms']:.3f} | {b['tokens'] == c['tokens'] == g['tokens']}")
        print(" | ".join(row))
    tb, tc, tg = (sum(r[q]["est_ms"] for q in ids) for r in (before, now, ngram))
    print(f"total estimate: auto before {tb:.1f} ms, auto now {tc:.1f} ms, ngram now {tg:.1f} ms; "
          f"before/now {tb / tc:.3f}, ngram/auto-now {tg / tc:.3f}")


if __name__ == "__main__":
    main()
