"""Exact-enumeration oracle for rejection-sampling verification on small vocabularies.

``enumerate_law(run)`` computes the exact output distribution of a randomised procedure by
exploring every branch of it: ``run(chooser)`` makes each random decision through the
``Chooser`` (a categorical draw with known probabilities, or a comparison ``u < t`` of a
uniform ``u``), and ``enumerate_law`` replays it once per branch, multiplying the
probabilities of the decisions taken. Applied to a procedure that draws a draft tree and then
runs the implementation's ``verify_rejection`` on it with the cursor's uniforms replaced by
``BranchUniform`` objects (``enumerated_verify``), it gives the exact law of the emitted
tokens of one step *of the implementation* - nothing of the rule is re-implemented here: the
thresholds the walk compares its uniforms with, and the residual vector it draws the
recovered token from, are read from the walk itself.

Lossless means: the emitted tokens, extended by plain decoding to a fixed length m, follow
the target's joint law of m tokens (``extended_law`` / ``target_law``); with exact
arithmetic the two agree to rounding (~1e-15), so tests compare them to 1e-12.
"""

from __future__ import annotations

import contextlib
import inspect
import textwrap
from collections import defaultdict
from collections.abc import Callable
from unittest import mock

import numpy as np

import localspec.verify as verify_mod


class Chooser:
    """One branch of an enumeration: replays ``prefix`` (option ranks of the first decisions),
    then takes option 0 of every new decision, logging each decision."""

    def __init__(self, prefix: list[int]) -> None:
        self.prefix = prefix
        self.log: list[tuple[int, float]] = []  # (number of options, probability of the taken one)

    def _take(self, probs: list[float]) -> int:
        opts = [i for i, p in enumerate(probs) if p > 0]
        i = len(self.log)
        k = self.prefix[i] if i < len(self.prefix) else 0
        self.log.append((len(opts), probs[opts[k]]))
        return opts[k]

    def categorical(self, probs: np.ndarray) -> int:
        """An index drawn with probabilities ``probs`` (normalised here)."""
        p = np.asarray(probs, dtype=np.float64)
        p = p / p.sum()
        return self._take(list(p))

    def bernoulli(self, t: float) -> bool:
        """True with probability ``min(1, max(0, t))`` (= P(u < t) for u ~ U[0, 1))."""
        t = min(1.0, max(0.0, float(t)))
        return self._take([t, 1.0 - t]) == 0


def enumerate_law(run: Callable[[Chooser], object]) -> dict:
    """Exact law of ``run(chooser)``'s (hashable) result over all branches."""
    law: dict = defaultdict(float)
    stack: list[list[int]] = [[]]
    while stack:
        prefix = stack.pop()
        ch = Chooser(prefix)
        out = run(ch)
        p = 1.0
        for _, q in ch.log:
            p *= q
        law[out] += p
        taken = list(prefix) + [0] * (len(ch.log) - len(prefix))
        for i in range(len(prefix), len(ch.log)):
            for alt in range(1, ch.log[i][0]):
                stack.append(taken[:i] + [alt])
    return dict(law)


class BranchUniform:
    """A uniform on [0, 1) whose comparisons ``u < t`` / ``u <= t`` are decisions of the
    enumeration. The same uniform may be compared several times (the threshold walk compares
    ONE coin per node with growing bounds): it keeps the interval ``[lo, hi)`` that the earlier
    answers left it, and each comparison is a decision with the conditional probability
    ``P(u < t | lo <= u < hi)`` (1 or 0 without a decision when ``t`` is outside the interval).
    A fresh uniform compared once is a plain Bernoulli(t) decision."""

    def __init__(self, chooser: Chooser) -> None:
        self.chooser = chooser
        self.lo, self.hi = 0.0, 1.0

    def __lt__(self, t) -> bool:
        t = float(t)
        if t >= self.hi:
            return True
        if t <= self.lo:
            return False
        below = self.chooser.bernoulli((t - self.lo) / (self.hi - self.lo))
        if below:
            self.hi = t
        else:
            self.lo = t
        return below

    __le__ = __lt__  # u = t has probability 0


class ResidualUniform:
    """The uniform of a residual / bonus draw: ``sample_from(probs, u)`` becomes a decision."""

    def __init__(self, chooser: Chooser) -> None:
        self.chooser = chooser


_real_sample_from = verify_mod.sample_from


def _sample_from(probs, u):
    if isinstance(u, ResidualUniform):
        return u.chooser.categorical(probs)
    return _real_sample_from(probs, u)


@contextlib.contextmanager
def enumerated_draws():
    """While active, ``localspec.verify`` draws recovered / bonus tokens through the chooser
    of a ``ResidualUniform`` (the vector it draws from is the walk's own)."""
    with mock.patch.object(verify_mod, "sample_from", _sample_from):
        yield


def branching_cursor(cursor, chooser: Chooser):
    """``cursor`` with its accept / residual uniforms replaced by enumeration decisions."""
    cursor.accept_uniform = lambda k: BranchUniform(chooser)
    cursor.residual_uniform = lambda: ResidualUniform(chooser)
    return cursor


def extended_law(step_law: dict, cond: Callable[[tuple], np.ndarray], m: int) -> dict:
    """Law of the first ``m`` tokens when a step's emitted tokens (law ``step_law``: tuple ->
    probability) are followed by plain decoding, ``cond(prefix)`` being the target
    distribution after ``prefix`` (the tokens emitted since the root)."""
    out: dict = defaultdict(float)

    def extend(prefix: tuple, p: float) -> None:
        if len(prefix) >= m:
            out[prefix[:m]] += p
            return
        probs = cond(prefix)
        for t in np.flatnonzero(probs > 0):
            extend(prefix + (int(t),), p * float(probs[t]))

    for toks, p in step_law.items():
        extend(tuple(int(t) for t in toks), p)
    return dict(out)


def target_law(cond: Callable[[tuple], np.ndarray], m: int) -> dict:
    """The target's joint law of ``m`` tokens (plain decoding)."""
    return extended_law({(): 1.0}, cond, m)


def max_abs_diff(a: dict, b: dict) -> float:
    keys = set(a) | set(b)
    return max(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in keys)


def mutant(fn, *replacements: tuple[str, str]):
    """A mutated copy of ``fn`` (a function of ``localspec.verify``): its source with each
    ``(old, new)`` replaced once, compiled in the module's namespace. Raises AssertionError
    when a replaced line no longer exists (the mutation must follow the code)."""
    src = textwrap.dedent(inspect.getsource(fn))
    for old, new in replacements:
        assert src.count(old) == 1, f"mutation target not found once in {fn.__name__}: {old!r}"
        src = src.replace(old, new)
    ns = dict(vars(inspect.getmodule(fn)))
    ns["sample_from"] = lambda probs, u: verify_mod.sample_from(probs, u)  # late-bound (enumerated_draws)
    exec(compile(src, f"<mutant of {fn.__name__}>", "exec"), ns)
    return ns[fn.__name__]


# The mutation of the threshold walk (issue 12): tried children left in the recovered token's
# distribution
MUTATION_THRESHOLD_KEEP_TRIED = ("residual[tried] = 0.0", "pass")

# The two mutations of issue 15: the rule without the renormalisation of the residual
MUTATION_NO_RENORM_POINT_MASS = ("nxt = _normalise(residual)", "nxt = residual")
MUTATION_NO_RENORM_STOCHASTIC = (
    "nxt = _normalise(np.maximum(residual - draft_probs, 0.0))",
    "nxt = np.maximum(residual - draft_probs, 0.0)",
)


def enumerate_trees(build: Callable[[Chooser], object], key: Callable[[object], object] = None) -> list[tuple[float, object]]:
    """Every outcome of a randomised tree construction ``build(chooser)`` with its
    probability: ``[(p, tree), ...]`` (outcomes with the same ``key`` pooled)."""
    trees: dict = {}
    law = enumerate_law(lambda ch: _keep(trees, build(ch), key))
    return [(p, trees[k]) for k, p in law.items()]


def _keep(store: dict, tree, key):
    k = key(tree) if key is not None else len(store)
    store.setdefault(k, tree)
    return k


def step_law(trees: list[tuple[float, object]], walk: Callable[[object, Chooser], tuple]) -> dict:
    """Law of a step's emitted tokens: the trees' law (``enumerate_trees``) times the exact
    law of ``walk(tree, chooser)`` (the verification, run with enumerated uniforms) on each."""
    out: dict = defaultdict(float)
    with enumerated_draws():
        for p, tree in trees:
            for toks, q in enumerate_law(lambda ch: walk(tree, ch)).items():
                out[toks] += p * q
    return dict(out)
