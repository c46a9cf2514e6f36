"""Probe gaps sized by the last probe's measured cost (the policy as it is) against the rule
before (``paid_explore_gap`` from ``probe_us``, which prices every planned node as verified,
baked into the stored gap at each probe; the budget check at the larger of that estimate and
the last measured cost), side by side in one run: for each prompt, plain decoding and two
engines of the same drafter (default the shipped EAGLE-3 head alone), the "old" one's policy
patched back to the rule before; the run and its report are ``model_select_ab.run_ab``'s.

    python scripts/probe_gap_ab.py --dataset question.jsonl --per-category 5 --repeats 2 [--chat-format] [--json out.json]
"""

from __future__ import annotations

import math

from model_select_ab import run_ab


def patch_old_gaps(engine) -> None:
    """The exploration gaps of the policy before ``probe_cost_us`` (on this engine's policy only)."""
    pol = engine.policy

    def paid_old(stats, shape):
        return math.ceil(pol.probe_us(stats, shape) / (pol.explore_budget * pol.step_us(1)))

    def next_old(stats):
        gap = 2 * stats.explore_gap if stats.explore_gap else pol.explore_every
        return min(max(gap, paid_old(stats, stats.last_shape)), pol.max_explore_gap(stats, stats.last_shape))

    pol.paid_explore_gap = paid_old
    pol.next_explore_gap = next_old
    pol.explore_gap_due = lambda stats, shape: max(stats.explore_gap or pol.explore_every, paid_old(stats, shape))
    pol.probe_cost_us = lambda stats, shape: max(pol.probe_us(stats, shape), stats.last_probe_us)


if __name__ == "__main__":
    run_ab(patch_old_gaps)
