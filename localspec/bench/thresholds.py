"""What the LOSSY acceptance thresholds cost in exactness and buy in acceptance.

Two reports for ``localspec bench --accept-threshold-single / --accept-threshold-acc``:

* **Synthetic rows, exact** (``synthetic_tvd_report``): on small random vocabularies, the exact
  law of one verification step of ``localspec.verify.threshold_walk`` (the implementation
  itself, not a re-derivation) is computed by enumerating every decision it takes: each
  comparison of its one coin per node with a bound is a branch whose probability is the
  conditional probability of the coin given the earlier answers (the coin is uniform on the
  interval they left), and the last token's law is the distribution the walk draws it from.
  The step's emitted tokens, extended by plain decoding to ``depth + 1`` tokens, are compared
  with the target's joint law of as many tokens: ``tvd`` is the exact total variation
  distance (``0.5 * sum |p - q|``, 0 up to rounding at thresholds 1.0), ``mean_accepted`` the
  exact expected number of accepted drafts per step.
* **On the model** (``summarize_lossy``, from ``specbench.run_bench(..., lossy=...)``): the
  same prompts decoded plainly, speculatively lossless and speculatively lossy; acceptance
  and speed of both, and the mean log-probability of the emitted tokens under the target's
  raw distribution (``log_softmax`` of the logits), lossy vs lossless vs plain.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..request_state import RequestState
from ..sampling import SamplingParams
from ..tree import TokenSource, TreeBuilder
from ..verify import threshold_walk

# -- exact enumeration ---------------------------------------------------------------------------


class _Branches:
    """One branch of a depth-first enumeration: replays ``prefix`` (option indices of the
    first decisions), then takes option 0 of every new decision, logging each one."""

    def __init__(self, prefix: list[int]) -> None:
        self.prefix = prefix
        self.log: list[tuple[int, float]] = []  # (number of options, probability of the one taken)

    def decide(self, probs: Sequence[float]) -> int:
        opts = [i for i, p in enumerate(probs) if p > 0]
        i = len(self.log)
        k = self.prefix[i] if i < len(self.prefix) else 0
        self.log.append((len(opts), float(probs[opts[k]])))
        return opts[k]


class _Coin:
    """A uniform coin on (0, 1) compared as ``coin <= bound``; every comparison that its earlier
    answers leave undecided is a branch (the coin stays uniform on the interval they left)."""

    def __init__(self, branches: _Branches) -> None:
        self.b = branches
        self.lo, self.hi = 0.0, 1.0

    def __le__(self, bound) -> bool:
        t = float(bound)
        if t >= self.hi:
            return True
        if t <= self.lo:
            return False
        p = (t - self.lo) / (self.hi - self.lo)
        below = self.b.decide([p, 1.0 - p]) == 0
        if below:
            self.hi = t
        else:
            self.lo = t
        return below


def _enumerate(run: Callable[[_Branches], dict]) -> dict:
    """Exact law: ``run(branches)`` returns ``{outcome: probability given its decisions}``."""
    law: dict = defaultdict(float)
    stack: list[list[int]] = [[]]
    while stack:
        prefix = stack.pop()
        b = _Branches(prefix)
        out = run(b)
        p = math.prod(q for _, q in b.log)
        for k, q in out.items():
            law[k] += p * q
        taken = list(prefix) + [0] * (len(b.log) - len(prefix))
        for i in range(len(prefix), len(b.log)):
            for alt in range(1, b.log[i][0]):
                stack.append(taken[:i] + [alt])
    return dict(law)


class _VocabModel:
    """Just what ``RequestState`` reads of a model, for rows of ``n_vocab`` tokens."""

    def __init__(self, n_vocab: int) -> None:
        self.n_vocab = n_vocab
        self.suppress_tokens = np.zeros(0, dtype=np.int32)


@dataclass
class World:
    """A random target on a small vocabulary: logits after every token prefix (seeded)."""

    n_vocab: int
    seed: int
    scale: float = 1.5

    def __post_init__(self) -> None:
        self._logits: dict[tuple, np.ndarray] = {}
        self._params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
        self._req = RequestState(self._params.with_seed(0), _VocabModel(self.n_vocab), [])
        self._req.processor.use_native = False

    def logits(self, prefix: tuple) -> np.ndarray:
        if prefix not in self._logits:
            g = np.random.default_rng([self.seed, len(prefix), *prefix])
            self._logits[prefix] = (g.standard_normal(self.n_vocab) * self.scale).astype(np.float32)
        return self._logits[prefix]

    def probs(self, prefix: tuple) -> np.ndarray:
        """[n_vocab] float64: the target's distribution after ``prefix``."""
        return self._req.cursor(0).target_probs(self.logits(prefix))

    def cursor(self, params: SamplingParams):
        req = RequestState(params.with_seed(0), _VocabModel(self.n_vocab), [])
        req.processor.use_native = False
        return req.cursor(0)


def _grown_tree(world: World, widths: Sequence[int], children):
    """A tree grown level by level: under every node at depth d, the tokens ``children(path,
    widths[d])`` (in that order). Returns ``(tree, rows)``, ``rows`` the world's logits of each node."""
    b = TreeBuilder(0)
    paths = {0: ()}
    frontier = [0]
    for w in widths:
        nxt = []
        for node in frontier:
            for t in children(paths[node], w):
                c = b.add(node, int(t), source=TokenSource.NGRAM)
                paths[c] = paths[node] + (int(t),)
                nxt.append(c)
        frontier = nxt
    tree = b.build()
    return tree, np.stack([world.logits(paths[i]) for i in range(tree.n_nodes)])


def top_tree(world: World, widths: Sequence[int]):
    """The tree a good drafter proposes: under every node at depth d, the target's
    ``widths[d]`` most likely tokens, most likely first. Returns ``(tree, rows)``."""
    return _grown_tree(world, widths, lambda path, w: np.argsort(-world.probs(path), kind="stable")[:w])


def random_tree(world: World, widths: Sequence[int], rng: np.random.Generator):
    """A poor drafter's tree: distinct random tokens (``widths[d]`` under each node at depth d)."""
    return _grown_tree(world, widths, lambda path, w: rng.choice(world.n_vocab, size=min(w, world.n_vocab), replace=False))


def exact_step_law(world: World, tree, rows: np.ndarray, threshold_single: float, threshold_acc: float) -> dict:
    """Exact law ``{emitted tokens: probability}`` of one step of ``threshold_walk`` on ``tree``."""
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                            accept_threshold_single=threshold_single, accept_threshold_acc=threshold_acc)  # fmt: skip

    def run(b: _Branches) -> dict:
        cur = world.cursor(params)
        cur.accept_uniform = lambda k: _Coin(b)
        w = threshold_walk(tree, rows, cur, threshold_single, threshold_acc)
        base = tuple(w.tokens)
        return {base + (int(t),): float(p) for t, p in zip(w.final_ids, w.final_probs) if p > 0}

    return _enumerate(run)


def extended_tvd(world: World, step_law: dict, m: int) -> float:
    """Total variation distance between the step's law extended by plain decoding to ``m``
    tokens and the target's joint law of ``m`` tokens (both exact)."""
    ext: dict = defaultdict(float)

    def extend(prefix: tuple, p: float, out: dict) -> None:
        if len(prefix) >= m:
            out[prefix[:m]] += p
            return
        q = world.probs(prefix)
        for t in np.flatnonzero(q > 0):
            extend(prefix + (int(t),), p * float(q[t]), out)

    for toks, p in step_law.items():
        extend(tuple(toks), p, ext)
    tgt: dict = defaultdict(float)
    extend((), 1.0, tgt)
    return 0.5 * sum(abs(ext.get(k, 0.0) - tgt.get(k, 0.0)) for k in set(ext) | set(tgt))


SHAPES = {
    "chain top-1 x3": ("top", (1, 1, 1)),
    "tree top-3 x top-2": ("top", (3, 2)),
    "random tree 2 x 2": ("random", (2, 2)),
}


def synthetic_tvd_report(
    thresholds: Sequence[tuple[float, float]],
    *,
    vocab_sizes: Sequence[int] = (4, 8),
    n_worlds: int = 6,
    seed: int = 0,
) -> list[dict]:
    """Exact TVD and mean accepted drafts of the threshold walk on random small-vocabulary
    targets, for each ``(threshold_single, threshold_acc)`` and each tree shape in ``SHAPES``.

    Returns one dict per (thresholds, shape): ``threshold_single``, ``threshold_acc``,
    ``shape``, ``n_worlds`` (worlds x vocabulary sizes), ``tvd_mean``, ``tvd_max`` and
    ``mean_accepted`` (exact expectation, averaged over the worlds).
    """
    worlds = [World(v, seed * 1000 + 17 * v + i) for v in vocab_sizes for i in range(n_worlds)]
    trees = {}
    for name, (kind, widths) in SHAPES.items():
        rng = np.random.default_rng(seed)
        trees[name] = [top_tree(w, widths) if kind == "top" else random_tree(w, widths, rng) for w in worlds]
    out = []
    for ts, ta in thresholds:
        for name, (_, widths) in SHAPES.items():
            tvds, acc = [], []
            for w, (tree, rows) in zip(worlds, trees[name]):
                law = exact_step_law(w, tree, rows, ts, ta)
                tvds.append(extended_tvd(w, law, len(widths) + 1))
                acc.append(sum(p * (len(k) - 1) for k, p in law.items()))
            out.append({"threshold_single": ts, "threshold_acc": ta, "shape": name, "n_worlds": len(worlds),
                        "tvd_mean": float(np.mean(tvds)), "tvd_max": float(np.max(tvds)),
                        "mean_accepted": float(np.mean(acc))})  # fmt: skip
    return out


def threshold_grid(single: float, acc: float) -> list[tuple[float, float]]:
    """The thresholds the synthetic report covers: lossless, the ones asked for, and each of
    them alone, and a few lower steps of the same kind (sorted from lossless down)."""
    pts = {(1.0, 1.0), (single, acc), (single, 1.0), (1.0, acc)}
    for f in (0.5, 0.25):
        pts.add((1.0 - f * (1.0 - single), 1.0 - f * (1.0 - acc)))
    return sorted(pts, key=lambda p: (-(p[0] + p[1]), -p[0]))


def tvd_markdown(rows: list[dict]) -> str:
    n = rows[0]["n_worlds"] if rows else 0
    lines = [
        f"Synthetic rows, exact: the threshold walk enumerated on {n} random targets per row (vocabularies of "
        "4 and 8 tokens): total variation distance of one step's output (extended by plain decoding to depth + 1 "
        "tokens) from the target's joint law, and the expected accepted drafts per step.",
        "",
        "| single | acc | tree | TVD mean | TVD max | accepted / step |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['threshold_single']:g} | {r['threshold_acc']:g} | {r['shape']} | {r['tvd_mean']:.4f} "
                     f"| {r['tvd_max']:.4f} | {r['mean_accepted']:.3f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


# -- on the model ----------------------------------------------------------------------------------


def summarize_lossy(records) -> dict:
    """Per category, from ``PromptRecord`` s with ``spec_lossy`` set: speed ratios over plain
    (lossless and lossy speculation), mean acceptance length, acceptance rate, and the mean
    log-probability of the emitted tokens under the target (plain, lossless, lossy)."""
    from .specbench import _rate

    cats: dict[str, list] = {}
    for r in records:
        if r.spec_lossy is not None:
            cats.setdefault(r.category, []).append(r)
    out = {}
    for cat, rs in cats.items():
        def rate(kind):
            return _rate(sum(getattr(r, kind).n_tokens for r in rs), sum(getattr(r, kind).t_decode_us for r in rs))

        def mal(kind):
            steps = sum(getattr(r, kind).n_steps for r in rs)
            return sum(getattr(r, kind).n_step_tokens or getattr(r, kind).n_tokens for r in rs) / steps if steps else 0.0

        def acc(kind):
            d = sum(getattr(r, kind).num_draft_tokens for r in rs)
            return sum(getattr(r, kind).num_accepted_tokens for r in rs) / d if d else 0.0

        def mean_lp(kind):
            n = sum(getattr(r, kind).n_tokens for r in rs if getattr(r, kind).sum_logprob is not None)
            s = sum(getattr(r, kind).sum_logprob for r in rs if getattr(r, kind).sum_logprob is not None)
            return s / n if n else None

        def host(kind):
            steps = sum(getattr(r, kind).n_steps for r in rs)
            return sum(getattr(r, kind).t_host_us for r in rs) / steps if steps else 0.0

        p, s, sl = rate("plain"), rate("spec"), rate("spec_lossy")
        out[cat] = {
            "n_prompts": len(rs),
            "speedup_lossless": s / p if p else 0.0,
            "speedup_lossy": sl / p if p else 0.0,
            "lossy_over_lossless": sl / s if s else 0.0,
            "mean_acceptance_length_lossless": mal("spec"),
            "mean_acceptance_length_lossy": mal("spec_lossy"),
            "acceptance_rate_lossless": acc("spec"),
            "acceptance_rate_lossy": acc("spec_lossy"),
            "mean_logprob_plain": mean_lp("plain"),
            "mean_logprob_lossless": mean_lp("spec"),
            "mean_logprob_lossy": mean_lp("spec_lossy"),
            "lossy_identical_to_plain_fraction": sum(r.lossy_identical for r in rs) / len(rs),
            "t_host_us_per_step_lossless": host("spec"),
            "t_host_us_per_step_lossy": host("spec_lossy"),
        }
    return out


def lossy_markdown(config: dict, lossy: dict) -> str:
    head = ["category", "prompts", "decode ratio lossless", "decode ratio LOSSY", "LOSSY / lossless", "MAL lossless",
            "MAL LOSSY", "accept rate lossless", "accept rate LOSSY", "mean logprob plain", "lossless", "LOSSY",
            "host µs/step lossless", "LOSSY"]  # fmt: skip
    lines = [
        f"**LOSSY** acceptance thresholds: single {config.get('accept_threshold_single'):g}, acc "
        f"{config.get('accept_threshold_acc'):g} (SGLang's rule; the LOSSY output is not exactly the target's "
        "distribution). Same prompts and seeds decoded plainly, speculatively lossless and speculatively LOSSY; mean "
        "log-probability of the emitted tokens under the target's raw distribution.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]

    def lp(x):
        return "-" if x is None else f"{x:.3f}"

    for cat, c in lossy.items():
        lines.append(
            f"| {cat} | {c['n_prompts']} | {c['speedup_lossless']:.2f}x | {c['speedup_lossy']:.2f}x "
            f"| {c['lossy_over_lossless']:.2f}x | {c['mean_acceptance_length_lossless']:.2f} "
            f"| {c['mean_acceptance_length_lossy']:.2f} | {100 * c['acceptance_rate_lossless']:.0f}% "
            f"| {100 * c['acceptance_rate_lossy']:.0f}% | {lp(c['mean_logprob_plain'])} | {lp(c['mean_logprob_lossless'])} "
            f"| {lp(c['mean_logprob_lossy'])} | {c['t_host_us_per_step_lossless']:.0f} | {c['t_host_us_per_step_lossy']:.0f} |"
        )
    return "\n".join(lines) + "\n"
