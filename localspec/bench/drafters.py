"""Micro-benchmark: what a model drafter (an EAGLE-3 head) costs per tree level, against the
target's own single-token decode, measured in one run.

Engines share one loaded target: one per head runtime (the host's C kernels and llama.cpp's
``eagle3`` graph, ``Eagle3Drafter(runtime=...)``) drafts with the head in a fixed tree shape
every step (so every level runs), one decodes plainly without the feature tap (the target
decode a head must be cheap next to). Prompts alternate between them. For every drafted step
the head drafter records the time of each level (level 0 includes the catch-up of the tokens
emitted since the head last ran); the report gives per runtime and level the median time, the
median's ratio to the plain single-token decode, the head's calls per level (llama.cpp
calls, or host ``run_level`` calls), and
the host time per drafted node (drafting time outside the head's calls: ranking rows,
building the tree).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from ..policy import TreeShape
from ..sampling import SamplingParams

DEFAULT_PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based inks and a wooden press. Within fifty years",
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n    out = []\n",
    "Question: Why is the sky blue during the day but red at sunset?\nAnswer:",
    "Summary of the meeting: the team agreed to move the release to March, because the new storage layer",
]


@dataclass
class LevelCost:
    """One tree level of the head, over all drafted steps.

    Attributes:
        level: 0 = the root's level (with the catch-up), 1.. = deeper levels.
        steps: drafted steps that reached this level.
        t_median_us / t_p90_us: the head's time for this level (µs).
        fraction_of_decode: ``t_median_us`` over the plain single-token target decode.
        calls_per_step: the head's llama.cpp calls at this level per step (1 = folded).
        mean_catch_up: (level 0) mean entries written besides the root's.
    """

    level: int
    steps: int
    t_median_us: float
    t_p90_us: float
    fraction_of_decode: float
    calls_per_step: float
    mean_catch_up: float = 0.0


@dataclass
class DrafterBench:
    shape: str
    t_decode_1_us: float
    levels: list[LevelCost]
    host_us_per_node: float
    drafted_steps: int
    nodes_per_step: float
    mean_acceptance_length: float
    head_calls_outside_drafting: int
    runtime: str = "llama"

    def to_dict(self) -> dict:
        return asdict(self)


class _HeadRun:
    """One head runtime's engine and what its drafted steps recorded."""

    def __init__(self, model, head_path, shape, runtime, plain, n_threads) -> None:
        from ..drafters.eagle3 import Eagle3Drafter
        from ..engine import Engine

        self.runtime = runtime
        self.d = d = Eagle3Drafter(head_path, shape=shape, runtime=runtime)
        self.eng = Engine(model, drafter=d, n_ctx=4096, n_threads=n_threads, cost_model=plain.cost_model, adaptive=False)
        if d.runtime != runtime:
            self.eng.close()
            raise SystemExit(f"localspec: error: the head does not run on the {runtime} runtime: {d.runtime_reason}")
        self.level_t: dict[int, list[float]] = {}
        self.catch_up: list[int] = []
        self.host_per_node: list[float] = []
        self.n_nodes: list[int] = []
        self.accept: list[float] = []
        self.outside = 0
        self.calls_in_steps = 0
        self.n_calls = 0
        if d.host:  # one run_level per level: count them as the head's calls
            levels = d.hub.decode_levels

            def decode_levels(parts, _levels=levels):
                self.n_calls += 1
                return _levels(parts)

            d.hub.decode_levels = decode_levels
        inner = d.hub.extend_many  # what the engine's step calls (the head's shared context)

        def extend_many(drafters, shapes):
            c0, k0 = self.calls(), d.kv_len
            t0 = time.perf_counter()
            trees = inner(drafters, shapes)
            t_us = (time.perf_counter() - t0) * 1e6
            self.calls_in_steps += self.calls() - c0
            levels = d.stats.last_level_us
            tree = trees[list(drafters).index(d)] if d in drafters else None
            if levels and tree is not None and tree.n_nodes > 1:
                self.catch_up.append(d.kv_len - k0 - 1)
                for lv, t in enumerate(levels):
                    self.level_t.setdefault(lv, []).append(t)
                self.host_per_node.append(max(0.0, t_us - sum(levels)) / max(1, tree.n_nodes - 1))
                self.n_nodes.append(tree.n_nodes)
            return trees

        d.hub.extend_many = extend_many

    def calls(self) -> int:
        return self.n_calls if self.d.host else self.d.ctx.n_calls

    def generate(self, prompt, max_tokens, sampling) -> None:
        self.eng.reset()
        calls0, steps0 = self.calls(), self.calls_in_steps
        r = self.eng.generate(prompt, max_tokens=max_tokens, sampling=sampling)
        self.outside += (self.calls() - calls0) - (self.calls_in_steps - steps0)
        self.accept.append(r.stats.mean_acceptance_length)

    def result(self, shape, t_dec: float) -> DrafterBench:
        # calls per level: every call of a step is one level, plus extra catch-up calls at level 0
        total_levels = sum(len(v) for v in self.level_t.values())
        levels = []
        for lv in sorted(self.level_t):
            ts = np.asarray(self.level_t[lv])
            calls = 1.0 + ((self.calls_in_steps - total_levels) / max(1, len(ts)) if lv == 0 else 0.0)
            levels.append(
                LevelCost(
                    level=lv,
                    steps=int(ts.size),
                    t_median_us=float(np.median(ts)),
                    t_p90_us=float(np.percentile(ts, 90)),
                    fraction_of_decode=float(np.median(ts)) / t_dec,
                    calls_per_step=calls,
                    mean_catch_up=float(np.mean(self.catch_up)) if lv == 0 and self.catch_up else 0.0,
                )
            )
        return DrafterBench(
            shape=f"depth {shape.depth}, width {shape.width}, {shape.max_nodes} nodes",
            t_decode_1_us=t_dec,
            levels=levels,
            host_us_per_node=float(np.median(self.host_per_node)) if self.host_per_node else 0.0,
            drafted_steps=len(self.n_nodes),
            nodes_per_step=float(np.mean(self.n_nodes)) if self.n_nodes else 0.0,
            mean_acceptance_length=float(np.mean(self.accept)) if self.accept else 0.0,
            head_calls_outside_drafting=int(self.outside),
            runtime=self.runtime,
        )


def bench_drafters(model, head_path, *, shapes=(TreeShape(6, 1, 7, 0.0), TreeShape(4, 3, 16, 0.0)), prompts=None,
                   max_tokens: int = 48, rounds: int = 2, n_threads=None,
                   runtimes=("host", "llama")) -> list[DrafterBench]:  # fmt: skip
    """Measure the head (see the module docstring) for each tree shape and head runtime
    (``Eagle3Drafter(runtime=...)``: ``host``, the C kernels; ``llama``, llama.cpp's graph).
    For each prompt the plain engine and every runtime's engine run one after the other, so
    load bursts spread over all of them.

    Args:
        model: the loaded target ``Model``.
        head_path: the EAGLE-3 head GGUF.
        shapes: fixed tree shapes to draft with (every step drafts).
        prompts: prompts (text, or token ids); default: four short built-in ones (prose, code, Q&A, summary).
        max_tokens: tokens generated per prompt.
        rounds: passes over the prompts.
        runtimes: head runtimes to measure.
    Returns:
        one ``DrafterBench`` per shape and runtime (in that order).
    Raises:
        SystemExit: the head does not run on one of ``runtimes``.
    """
    from ..engine import Engine

    prompts = prompts or DEFAULT_PROMPTS
    greedy = SamplingParams.greedy()
    plain = Engine(model, drafter="none", n_ctx=4096, n_threads=n_threads)
    out = []
    try:
        for shape in shapes:
            runs: list[_HeadRun] = []
            t1: list[float] = []
            try:
                for rt in runtimes:
                    runs.append(_HeadRun(model, head_path, shape, rt, plain, n_threads))
                for _ in range(rounds):
                    for p in prompts:
                        plain.reset()
                        r0 = plain.generate(p, max_tokens=max_tokens, sampling=greedy)
                        t1.append(r0.stats.t_decode_us / max(1, r0.stats.n_steps))
                        for run in runs:
                            run.generate(p, max_tokens, greedy)
            finally:
                for run in runs:
                    run.eng.close()
            t_dec = float(np.median(t1))
            out.extend(run.result(shape, t_dec) for run in runs)
    finally:
        plain.close()
    return out


def versus_labels(names: Sequence[str]) -> list[str]:
    """One label per drafter of a ``--versus`` run: the name, and ``name#k`` for its ``k``-th
    repeat (``ngram,ngram,auto`` -> ``ngram, ngram#2, auto``: an A/A/B run, whose two ``ngram``
    engines show the spread that the same drafter has against itself)."""
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n}#{seen[n]}")
    return out


def compare_drafters(model, prompts, drafters=("ngram", "auto"), *, max_tokens: int = 128, n_threads=None,
                     progress=None, repeats: int = 1, configure=None) -> list[dict]:  # fmt: skip
    """Spec-Bench-style prompts decoded plainly and with each drafter, in one run: per prompt
    the runs alternate (the order rotates prompt by prompt) so load bursts spread over all of
    them, each from an empty KV cache, greedy.

    Args:
        prompts: ``bench.dataset.BenchPrompt`` list.
        drafters: drafter labels (``versus_labels``: a name, or ``name#k`` for another engine of
            the same drafter; engine options default: ``auto`` takes the shipped head).
        repeats: rounds per prompt, each running every engine once; the order of a round is the
            reverse of the round before (A B C, C B A, ...: with an even count a drift in the
            machine's speed that is linear over the prompt adds the same time to every engine).
        configure: {label: fn(engine)} called on that label's engine once made (experiments
            that set a policy rule back on one engine: ``scripts/model_select_ab.py``).
    Returns:
        one dict per prompt: ``category``, ``question_id``, and per drafter name (and
        ``"plain"``) ``t_decode_us`` (the median over the rounds: with three or more, a round
        slowed by a burst on the machine does not move it; with two, their mean),
        ``t_decode_us_rounds``,
        ``n_generated_tokens``, ``mean_acceptance_length``, ``n_steps`` (target calls) and
        ``token_sources`` (emitted tokens per ``TokenSource`` name: which drafter supplied
        them), all the first round's, and ``identical`` (token ids equal to the plain run's in
        every round).

    Raises:
        ValueError: ``repeats`` is below 1.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    from ..costmodel import calibrate
    from ..engine import Engine

    greedy = SamplingParams.greedy()
    engines = {}
    try:
        base = Engine(model, drafter="none", n_ctx=4096, n_threads=n_threads)
        engines["plain"] = base
        for name in drafters:
            engines[name] = Engine(model, drafter=name.split("#")[0], n_ctx=4096, n_threads=n_threads,
                                   cost_model=calibrate(base.ctx))  # fmt: skip
            if configure and name in configure:
                configure[name](engines[name])
        names = list(engines)
        rows = []
        for i, bp in enumerate(prompts):
            order = names[i % len(names):] + names[: i % len(names)]
            runs: dict[str, list] = {name: [] for name in names}
            for k in range(repeats):
                for name in order if k % 2 == 0 else order[::-1]:
                    e = engines[name]
                    e.reset()
                    runs[name].append(e.generate(bp.model_input, max_tokens=max_tokens,
                                                 sampling=greedy, speculative=name != "plain"))  # fmt: skip
            plain_ids = runs["plain"][0].token_ids
            row = {"category": bp.category, "question_id": bp.question_id}
            for name, rs in runs.items():
                times = [r.stats.t_generate_us for r in rs]
                row[name] = {
                    "t_decode_us": float(np.median(times)),
                    "t_decode_us_rounds": times,
                    "n_generated_tokens": rs[0].stats.n_generated_tokens,
                    "mean_acceptance_length": rs[0].stats.mean_acceptance_length,
                    "n_steps": rs[0].stats.n_steps,
                    "token_sources": dict(rs[0].stats.token_sources),
                    "identical": all(r.token_ids == plain_ids for r in rs),
                }
            rows.append(row)
            if progress is not None:
                progress(i + 1, len(prompts), row)
        return rows
    finally:
        for e in engines.values():
            e.close()


def ratio_interval(n_a, t_a, n_b, t_b, *, n_boot: int = 2000, level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval, over prompts, of the speed ratio of engine B over engine
    A (tokens per second of the summed times: ``sum(n_b) / sum(t_b)`` over ``sum(n_a) /
    sum(t_a)``), resampling whole prompts with replacement (Efron & Tibshirani, *An
    Introduction to the Bootstrap*, 1993, ch. 13). It says how far the ratio could move on
    another draw of prompts like these; not the timing noise of one prompt's runs, which an
    A/A pair of the same drafter shows.

    Args:
        n_a, t_a, n_b, t_b: [P] per-prompt tokens and decode times (any unit, the same for both).
        n_boot: resamples; level: the interval's coverage; seed: the resampling's RNG seed.
    Returns:
        (low, high); both the ratio itself for a single prompt, both 0.0 where engine A
        emitted nothing or a time is 0 (over all prompts; resamples of only such prompts are
        left out).
    """
    n_a, t_a, n_b, t_b = (np.asarray(x, dtype=np.float64) for x in (n_a, t_a, n_b, t_b))
    p = n_a.size
    if not (n_a.sum() > 0 and t_a.sum() > 0 and t_b.sum() > 0):  # no speed to compare (as ``last_over_first``)
        return 0.0, 0.0
    if p < 2:
        r = float(n_b.sum() / t_b.sum() / (n_a.sum() / t_a.sum()))
        return r, r
    idx = np.random.default_rng(seed).integers(0, p, size=(n_boot, p))
    # a resample of prompts that emitted nothing (a prompt that ends at once) has no speed
    # ratio: it is left out, else one such 0/0 makes the whole interval NaN
    idx = idx[(n_a[idx].sum(1) > 0) & (t_a[idx].sum(1) > 0) & (t_b[idx].sum(1) > 0)]
    ratios = (n_b[idx].sum(1) / t_b[idx].sum(1)) / (n_a[idx].sum(1) / t_a[idx].sum(1))
    lo, hi = np.quantile(ratios, [(1.0 - level) / 2.0, (1.0 + level) / 2.0])
    return float(lo), float(hi)


def summarize_versus(rows: list[dict], drafters) -> list[dict]:
    """Per category: each drafter's decode speed ratio over plain (tokens/s ratio of the
    summed times), its MAL, identical outputs, its emitted tokens per source (summed:
    ``token_sources``), and the ratio of the last drafter over the first with its 95%
    bootstrap interval over the category's prompts (``last_over_first_ci``: ``ratio_interval``)."""
    out = []
    cats = sorted({r["category"] for r in rows})
    for cat in cats + ["all"]:
        rs = [r for r in rows if cat == "all" or r["category"] == cat]
        tps = {}
        entry = {"category": cat, "prompts": len(rs)}
        for name in ["plain", *drafters]:
            n = sum(r[name]["n_generated_tokens"] for r in rs)
            t = sum(r[name]["t_decode_us"] for r in rs)
            tps[name] = n / t * 1e6 if t else 0.0
        for name in drafters:
            entry[name] = {
                "speed_vs_plain": tps[name] / tps["plain"] if tps["plain"] else 0.0,
                "mal": float(np.mean([r[name]["mean_acceptance_length"] for r in rs])),
                "identical": sum(r[name]["identical"] for r in rs),
                "token_sources": dict(sum((Counter(r[name]["token_sources"]) for r in rs), Counter())),
            }
        entry["last_over_first"] = tps[drafters[-1]] / tps[drafters[0]] if tps[drafters[0]] else 0.0
        first, last = drafters[0], drafters[-1]
        entry["last_over_first_ci"] = list(ratio_interval(
            [r[first]["n_generated_tokens"] for r in rs], [r[first]["t_decode_us"] for r in rs],
            [r[last]["n_generated_tokens"] for r in rs], [r[last]["t_decode_us"] for r in rs],
        ))  # fmt: skip
        out.append(entry)
    return out
