"""Micro-benchmarks of the C kernels (``localspec.native``) against the numpy / Python
reference, on the same inputs: per kernel the median time of each, their ratio, and whether
both gave the same result.

Rows are 262,144 wide (the default model's vocabulary). By default they are synthetic and
shaped like Gemma 3 270M logits (mean -6, sd 3.7, a heavier upper tail; top-p 0.95 keeps a
few thousand tokens); ``real_rows`` takes them from the default model instead. Verified
trees follow the target's own choices for ``spine_depth`` levels (so walks go deep) and are
padded with decoy branches to 64 nodes.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from .. import native
from ..drafters.ngram import NgramDrafter
from ..drafters.ngram_index import NgramIndex
from ..request_state import RequestState
from ..sampling import LogitsProcessor, SamplingParams
from ..tree import TokenSource, TokenTree, TreeBuilder
from ..verify import verify
from .ngram import synthetic_history

T08_P095 = SamplingParams(temperature=0.8, top_k=0, top_p=0.95, min_p=0.0)


@dataclass
class KernelTiming:
    """One kernel: median µs per call of each implementation and whether they agreed."""

    kernel: str
    native_us: float
    reference_us: float
    same: bool

    @property
    def speedup(self) -> float:
        return self.reference_us / self.native_us if self.native_us > 0 else float("inf")

    def to_dict(self) -> dict:
        return {**asdict(self), "speedup": self.speedup}


def gemma_like_rows(rng: np.random.Generator, n_rows: int, n_vocab: int = 262144) -> np.ndarray:
    """[n_rows, n_vocab] float32 rows shaped like Gemma 3 logits."""
    x = rng.normal(-6.0, 3.7, (n_rows, n_vocab))
    x += rng.exponential(1.5, (n_rows, n_vocab)) * (rng.random((n_rows, n_vocab)) < 0.01)
    return x.astype(np.float32)


def model_rows(n_rows: int = 64) -> np.ndarray:
    """[n_rows, n_vocab] float32 logits of the default model along a chain of prompt tokens."""
    from ..backend import Context, Model, SequenceCache
    from ..models import default_model_path

    text = (
        "The engine verifies a tree of draft tokens in one batched call of the target model, "
        "then keeps the accepted path and drops the rest. " * 4
    )
    with Model(default_model_path()) as model:
        ctx = Context(model, n_ctx=1024, n_seq_max=2)
        try:
            cache = SequenceCache(ctx, max_tree_nodes=n_rows)
            toks = model.tokenize(text)
            cache.prefill(toks[:8])
            tree = TokenTree.chain(toks[8], toks[9 : 8 + n_rows])
            _, logits = cache.decode_tree(tree)
            return np.array(logits[:n_rows], dtype=np.float32)
        finally:
            ctx.close()


def spine_tree(
    rng: np.random.Generator, params: SamplingParams, rows: np.ndarray, n_nodes: int, depth: int, seed: int, pos: int
) -> TokenTree:
    """A ``n_nodes`` tree whose first ``depth`` levels are the reference walk's own choices
    (node i uses ``rows[i]``), padded with random decoy children of the spine."""
    ref = LogitsProcessor(params, rows.shape[1], use_native=False)
    b = TreeBuilder(int(rng.integers(rows.shape[1])))
    node = 0
    spine = [0]
    for d in range(depth):
        tok = ref.choose(rows[node], pos + d, seed) if params.verify == "gumbel" else int(np.argmax(rows[node]))
        node = b.add(node, tok, source=TokenSource.NGRAM)
        spine.append(node)
    while len(b) < n_nodes:
        b.add(spine[int(rng.integers(len(spine)))], int(rng.integers(rows.shape[1])), source=TokenSource.NGRAM)
    return b.build()


class _VocabModel:
    """What ``RequestState`` needs of a model, for synthetic rows."""

    def __init__(self, n_vocab: int) -> None:
        self.n_vocab = n_vocab
        self.suppress_tokens = np.zeros(0, dtype=np.int32)


def _median_us(fn: Callable[[], object], reps: int) -> tuple[float, object]:
    out = fn()  # warm-up (workspaces, caches), and the result to compare
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times), out


def _pair(name: str, make: Callable[[], Callable[[], object]], reps: int, same=lambda a, b: a == b) -> KernelTiming:
    """Time ``make()`` with the native path on and then off (``make`` builds fresh state)."""
    with native.use(True):
        t_nat, r_nat = _median_us(make(), reps)
    with native.use(False):
        t_ref, r_ref = _median_us(make(), reps)
    return KernelTiming(name, t_nat, t_ref, bool(same(r_nat, r_ref)))


def _verify_once(tree: TokenTree, rows: np.ndarray, params: SamplingParams, pos: int):
    def run():
        req = RequestState(params, _VocabModel(rows.shape[1]), [])
        cur = req.cursor(pos)
        res = verify(tree, rows, cur)
        return res.path, res.tokens

    return run


def bench_kernels(*, reps: int = 5, rows: np.ndarray | None = None, seed: int = 0, spine_depth: int = 16) -> list[KernelTiming]:
    """Time every kernel both ways (see module docstring).

    Args:
        reps: timed calls per kernel and implementation (median reported).
        rows: [>= 64, n_vocab] float32 logits rows (default: synthetic, 262,144 wide).
        spine_depth: accepted depth the Gumbel trees are built for.
    Raises:
        RuntimeError: the native kernels are not available.
    """
    if not native.AVAILABLE:
        raise RuntimeError(f"the native kernels are not available: {native.LOAD_ERROR}")
    rng = np.random.default_rng(seed)
    if rows is None:
        rows = gemma_like_rows(rng, 64)
    n_vocab = rows.shape[1]
    row = rows[0]
    out: list[KernelTiming] = []

    def choose(params):
        def make():
            proc = LogitsProcessor(params, n_vocab)
            return lambda: [proc.choose(rows[i], 100 + i, 7) for i in range(4)]

        return make

    out.append(_pair("choose greedy (argmax), 4 rows", choose(SamplingParams.greedy()), reps))
    out.append(_pair("choose T=0.8 top-p=0.95, 4 rows", choose(T08_P095), reps))
    out.append(_pair("choose llama.cpp defaults (top-k 40), 4 rows", choose(SamplingParams()), reps))
    out.append(_pair("choose T=1 untruncated, 4 rows", choose(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)), reps))

    def target_probs():
        cur = RequestState(T08_P095.with_seed(1), _VocabModel(n_vocab), []).cursor(0)
        return lambda: cur.target_probs(row)

    out.append(_pair("target_probs T=0.8 top-p=0.95 (dense)", target_probs, reps, lambda a, b: bool(np.abs(a - b).max() <= 1e-6)))

    def lse():
        if native.enabled():
            from ..native import rows as nrows

            return lambda: nrows.logsumexp(row)

        def ref():
            x = row.astype(np.float64)
            m = x.max()
            return float(m + np.log(np.exp(x - m).sum()))

        return ref

    out.append(_pair("logsumexp (logprobs)", lse, reps, lambda a, b: abs(a - b) <= 1e-9 * max(1.0, abs(b))))

    for label, params, depth, n_nodes in [
        ("verify 64-node tree, greedy", SamplingParams.greedy(), spine_depth, 64),
        ("verify 64-node tree, Gumbel T=0.8 top-p=0.95", T08_P095, spine_depth, 64),
        ("verify 64-node chain (all accepted), Gumbel T=0.8 top-p=0.95", T08_P095, 63, 64),
        ("verify 64-node tree, rejection T=0.8 top-p=0.95", SamplingParams(**{**T08_P095.__dict__, "verify": "rejection"}), spine_depth, 64),
    ]:
        p = params.with_seed(seed + 5)
        tree = spine_tree(rng, p, rows, n_nodes, depth, p.seed, pos=200)
        timing = _pair(label, lambda: _verify_once(tree, rows, p, 200), reps)
        with native.use(True):
            path, _ = _verify_once(tree, rows, p, 200)()
        timing.kernel += f" (accepted {len(path)})"
        out.append(timing)

    hist = synthetic_history(8192 + 400, seed=seed)

    def ngram_step():
        d = NgramDrafter() if native.enabled() else NgramDrafter(index=NgramIndex(8))
        d.begin(hist[:8192])
        state = {"i": 0}

        def step():
            i = state["i"] = state["i"] + 1
            d.accept([hist[8192 + i]])
            t = d.propose(16, 64)
            return t.token_ids.tolist(), t.parents.tolist(), t.score.tolist()

        return step

    out.append(_pair("n-gram drafter step (append + propose), 8k history", ngram_step, max(reps, 50)))
    return out
