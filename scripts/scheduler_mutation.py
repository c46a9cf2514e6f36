"""Mutation check of the junk sequence (docs/serve.md, "The junk sequence is needed").

In a context shared by several requests, ``SequenceCache.commit`` re-tags a step's rejected
cells to the junk sequence (they stay occupied), so that llama.cpp never puts a request's next
token in a hole before its earlier cells. The mutation frees them instead (``junk=None``, what
a context of one request does). Three requests decoded together with full drafted trees
(``adaptive=False``, the setting of tests/test_scheduler.py) must then give log-probabilities
that differ from each request decoded alone; without the mutation they are equal as floats.

    python scripts/scheduler_mutation.py
"""

from __future__ import annotations

import contextlib
import dataclasses

from localspec import Engine, SamplingParams
from localspec.backend import Model
from localspec.backend.kv import SequenceCache
from localspec.costmodel import CostModel
from localspec.models import default_model_path
from localspec.scheduler import BatchScheduler

PROMPTS = [
    "def fibonacci(n):\n    ",
    "List of primes: 2, 3, 5, 7, 11,",
    "The capital of France is",
]
N = 16  # tokens per request
GREEDY = dataclasses.replace(SamplingParams.greedy(), logprobs=0)


def cost_model() -> CostModel:
    """A fixed decode cost (µs by batch size) instead of a calibration: both runs use it."""
    return CostModel({1: 12000.0, 8: 46000.0, 32: 120000.0, 64: 238000.0})


def alone(model: Model) -> list[list[float]]:
    """Each prompt's emitted log-probabilities, decoded by itself (n-gram drafter)."""
    eng = Engine(model, drafter="ngram", n_ctx=2048, cost_model=cost_model())
    try:
        out = []
        for p in PROMPTS:
            eng.reset()
            out.append([lp.logprob for lp in eng.generate(p, max_tokens=N, sampling=GREEDY).logprobs])
        return out
    finally:
        eng.close()


def batched(model: Model) -> list[list[float]]:
    """The prompts decoded together, every drafted tree verified."""
    sched = BatchScheduler(model, parallel=len(PROMPTS), n_ctx=256, cost_model=cost_model(), adaptive=False)
    try:
        jobs = [sched.submit(model.tokenize(p), max_tokens=N, sampling=GREEDY) for p in PROMPTS]
        sched.run_until_idle()
        return [[lp.logprob for lp in j.wait().logprobs] for j in jobs]
    finally:
        sched.close()


@contextlib.contextmanager
def freeing_rejected_cells():
    """The mutation: ``SequenceCache.commit`` frees the step's rejected cells."""
    real = SequenceCache.commit

    def commit(self, tree, lay, path):
        junk, self.junk = self.junk, None
        try:
            real(self, tree, lay, path)
        finally:
            self.junk = junk

    SequenceCache.commit = commit
    try:
        yield
    finally:
        SequenceCache.commit = real


def n_differing(a: list[list[float]], b: list[list[float]]) -> int:
    return sum(x != y for ra, rb in zip(a, b) for x, y in zip(ra, rb)) + sum(abs(len(ra) - len(rb)) for ra, rb in zip(a, b))


def main() -> None:
    model = Model(default_model_path())
    ref = alone(model)
    n = sum(len(r) for r in ref)
    got = batched(model)
    print(f"junk sequence (the product): {n_differing(got, ref)} of {n} log-probabilities differ from alone")
    with freeing_rejected_cells():
        mut = batched(model)
    print(f"rejected cells freed (the mutation): {n_differing(mut, ref)} of {n} differ")


if __name__ == "__main__":
    main()
