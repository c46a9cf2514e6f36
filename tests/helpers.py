"""Test drafters and comparison helpers for the real-model tests."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading

import numpy as np

from localspec.bench.specbench import divergence, top2_gap
from localspec.drafters.level_drafter import ModelDrafter
from localspec.drafters.tree_expand import DraftCalibration, DraftChildSelector, expand_tree
from localspec.policy import ModelDraftStats, TreeShape
from localspec.request_state import RequestState
from localspec.sampling import SamplingParams
from localspec.tree import TokenSource, TokenTree, TreeBuilder
from localspec.verify import sample_from, verify_rejection

NEAR_TIE = 0.5  # top-2 logit gap below which batched vs single decodes may disagree on CPU
PROSE = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based inks and a wooden press. "
)
"""Two sentences of plain prose; repeated and cut, the long prompts of the real-model tests
(``tokenize(PROSE * 30)[:620]``)."""


class ScriptedDrafter:
    """Proposes the continuation of a known token sequence (an "oracle"), optionally with
    wrong tokens mixed in, as chains or as trees with decoy branches.

    Args:
        script: the full expected sequence (prompt + continuation).
        chain: draft length per step.
        wrong_every: make every k-th draft token wrong (0 = never).
        decoys: extra wrong siblings per depth (makes a tree).
    """

    name = "scripted"
    source = TokenSource.NGRAM

    def __init__(self, script, chain=4, wrong_every=0, decoys=0, seed=0, decoys_first=False):
        self.script = list(script)
        self.chain = chain
        self.wrong_every = wrong_every
        self.decoys = decoys
        self.decoy_score = 0.95 if decoys_first else 0.1  # best-first order puts decoys first
        self.rng = np.random.default_rng(seed)
        self.history: list[int] = []
        self.proposed = 0

    def begin(self, history):
        self.history = list(history)

    def accept(self, tokens):
        self.history.extend(tokens)

    def observe(self, tree, result):
        pass

    def close(self):
        pass

    def propose(self, max_depth, max_nodes):
        n = len(self.history)
        b = TreeBuilder(self.history[-1])
        if self.history != self.script[:n]:
            return b.build()  # off script: nothing to propose
        node = 0
        for d in range(min(self.chain, max_depth)):
            if n + d >= len(self.script) or len(b) >= max_nodes:
                break
            tok = self.script[n + d]
            self.proposed += 1
            if self.wrong_every and self.proposed % self.wrong_every == 0:
                tok = (tok + 17) % 200000
            for _ in range(self.decoys):
                if len(b) < max_nodes - 1:
                    b.add(node, int(self.rng.integers(1000, 200000)), source=TokenSource.NGRAM, score=self.decoy_score)
            node = b.add(node, tok, source=TokenSource.NGRAM, score=0.9 ** (d + 1) * (0.5 if self.decoy_score > 0.5 else 1))
        return b.build()


class RandomDrafter(ScriptedDrafter):
    """Proposes random tokens (trees of random chains): an adversary for greedy decoding."""

    name = "random"

    def __init__(self, width=3, depth=4, seed=0):
        super().__init__([], seed=seed)
        self.width, self.depth = width, depth

    def propose(self, max_depth, max_nodes):
        b = TreeBuilder(self.history[-1])
        for _ in range(self.width):
            node = 0
            for _d in range(min(self.depth, max_depth)):
                if len(b) >= max_nodes:
                    break
                node = b.add(node, int(self.rng.integers(0, 262144)), source=TokenSource.NGRAM, score=0.5)
        return b.build()


class ScriptedModelDrafter:
    """A model drafter (``ModelDrafter``'s two-phase protocol: ``model_stats``, an empty
    ``propose``, ``extend(shape)``) that drafts a chain of ``shape.depth`` tokens of the known
    continuation ``script`` while ``right`` is true, and wrong tokens (each script token + 1)
    otherwise. Each level takes ``level_us`` (recorded as its measured time, as a real head's
    calls are); ``extends`` counts the steps it drafted.

    Args:
        script: the full expected sequence (prompt + continuation).
        level_us: the time of one draft level, µs.
        right: whether its drafts are the script's.
        score: per-node acceptance estimate (a path of d nodes scores ``score ** d``).
        catch_up_us: the time its first level takes per position it has not seen yet (the
            catch-up of an EAGLE-3 head: every position since its last drafted step, at most
            ``catch_up_window``, all of them after ``begin``), on top of ``level_us``.
        catch_up_window: most positions a catch-up writes (``eagle3.CONTEXT_WINDOW``).
    Attributes:
        draft_us: the measured drafting time of each step it drafted (what it reported).
    """

    name = "scripted-model"
    source = TokenSource.DRAFT_MODEL

    def __init__(self, script, *, level_us: float = 1000.0, right: bool = False, score: float = 0.6,
                 catch_up_us: float = 0.0, catch_up_window: int = 16) -> None:  # fmt: skip
        self.script = [int(t) for t in script]
        self.level_us, self.right, self.score = level_us, right, score
        self.catch_up_us, self.catch_up_window = catch_up_us, catch_up_window
        self.draft_us: list[float] = []
        self._seen = 0  # positions of the history its last drafted step had seen
        self.stats = ModelDraftStats(max_depth=8, max_width=1)
        self.history: list[int] = []
        self.extends = 0
        self._limits = (0, 0)
        self._ran = False
        self.calib = DraftCalibration()

    @property
    def model_stats(self):
        return self.stats

    def begin(self, history, context=()):
        self.history = [int(t) for t in history]
        self._seen = 0

    def accept(self, tokens):
        self.history.extend(int(t) for t in tokens)

    def propose(self, max_depth, max_nodes):
        self._limits, self._ran = (max_depth, max_nodes), False
        return TokenTree.root_only(self.history[-1])

    def extend(self, shape):
        self._ran = True
        n = len(self.history)
        depth = min(shape.depth, self._limits[0], self._limits[1] - 1, len(self.script) - n)
        b = TreeBuilder(self.history[-1])
        node = 0
        for d in range(max(0, depth)):
            tok = self.script[n + d] if self.right else self.script[n + d] + 1
            node = b.add(node, tok, source=self.source, score=self.score ** (d + 1))
        self.extends += 1
        levels = [self.level_us] * max(1, depth)
        levels[0] += self.catch_up_us * min(self.catch_up_window, n - self._seen)
        self._seen = n
        self.draft_us.append(sum(levels))
        self.stats.observe_draft(sum(levels), len(b), levels)
        return b.build()

    observe = ModelDrafter.observe  # the real drafters' learning from a step

    def close(self):
        pass


class PlainReferences:
    """Plain-decoding references memoised per (prompt, n, sampling): with the engine reset
    before each run, plain output is a function of exactly these, so the tests of one module
    that compare against the same reference share one decode."""

    def __init__(self) -> None:
        self._runs: dict = {}

    def get(self, run, eng, prompt, n, sampling):
        """``run(eng, prompt, n, sampling)`` (the module's plain run), decoded once per key."""
        key = (tuple(prompt), n, repr(sampling))
        if key not in self._runs:
            self._runs[key] = run(eng, prompt, n, sampling)
        return self._runs[key]


def bit_identical_here(engine) -> bool:
    """Where the docs promise bit-identity with plain decoding (docs/gpu.md): localspec's exact
    kernels (``LOCALSPEC_KERNELS=exact``, the default) on llama.cpp's CPU backend."""
    from localspec.backend import exact_kernels, supports_gpu_offload

    return exact_kernels() and not (engine.model.n_gpu_layers and supports_gpu_offload())


def assert_same_as_plain(engine, prompt_tokens, plain_ids, spec_ids, max_gap=NEAR_TIE, sampling=None):
    """Speculative output ``spec_ids`` equals plain output ``plain_ids``.

    With the exact kernels on the CPU backend (``bit_identical_here``) they must be identical,
    token for token. Elsewhere (fast kernels, GPU backends) batched and single-token logits
    may differ in the last bits, so the first divergence must sit at a near-tie of the plain
    distribution: the raw top-2 logit gap (greedy) or the gap of the seeded Gumbel-perturbed
    logits (``sampling`` at temperature > 0) below ``max_gap`` (/ temperature). Returns that
    gap, or None when identical.
    """
    div = divergence(plain_ids, spec_ids)
    if div is None:
        return None
    if bit_identical_here(engine):
        raise AssertionError(
            f"speculative output differs from plain decoding at token {div} of {len(plain_ids)} "
            f"({plain_ids[div:div + 4]} vs {spec_ids[div:div + 4]}) although the exact kernels are on"
        )
    assert div < len(plain_ids) and div < len(spec_ids), "one output is a strict prefix of the other"
    prefix = list(prompt_tokens) + list(plain_ids[:div])
    if sampling is not None and not sampling.is_greedy:
        gap = perturbed_gap(engine, prefix, sampling)
        assert gap < max_gap / sampling.temperature, f"seeded outputs diverge at {div}, perturbed gap {gap:.3f}"
        return gap
    engine.reset()
    gap = top2_gap(engine, prefix)
    assert gap < max_gap, f"outputs diverge at {div} where the top-2 gap is {gap:.3f} (not a near-tie)"
    return gap


def assert_greedy_is_target_argmax(engine, prompt_tokens, ids, *, exclude=(), max_gap=NEAR_TIE) -> int:
    """Greedy output ``ids`` is the target's argmax after every prefix: plain greedy decoding's
    output, checked without decoding it token by token.

    ``prompt_tokens`` + ``ids`` go through ``engine.cache`` teacher-forced, as chains of
    ``max_tree_nodes`` rows (a prefill plus ``len(ids) / max_tree_nodes`` decodes instead of
    ``len(ids)`` single-token ones); row i of the chains must rank ``ids[i]`` first among the
    tokens not in ``exclude`` (ids a logit bias of -inf bans). Where the exact kernels are on
    (``bit_identical_here``) a batched row is bit-identical to the single-token row plain
    decoding reads, so this is plain decoding's token at every position: any other token fails.
    Elsewhere a row may rank a near-tie differently, so ``ids[i]`` may trail the row's best by
    less than ``max_gap``. The premise (batched rows bit-identical to single-token rows, and
    speculative output equal to the engine's own plain loop) is tested against real plain
    decodes in test_exact.py; this check shares it with the speculative step, so it does not
    replace those tests. The engine is reset before and after. Returns how many positions
    were checked.

    Raises:
        AssertionError: a position where ``ids[i]`` is not the target's choice (with the gap).
    """
    exact = bit_identical_here(engine)
    ids = [int(t) for t in ids]
    seq = [int(prompt_tokens[-1])] + ids
    ban = np.asarray(sorted(set(exclude)), dtype=np.int64)
    cache = engine.cache
    engine.reset()
    try:
        cache.prefill(list(prompt_tokens[:-1]))
        k = cache.max_tree_nodes
        for s in range(0, len(ids), k):
            chunk = seq[s : min(s + k, len(ids))]
            tree = TokenTree.chain(chunk[0], chunk[1:])
            lay, lg = cache.decode_tree(tree)
            for j in range(len(chunk)):
                row = lg[j].copy()
                row[ban] = -np.inf
                best, want = int(np.argmax(row)), ids[s + j]
                gap = float(row[best] - row[want])
                if best != want and (exact or not gap < max_gap):
                    raise AssertionError(
                        f"token {s + j} of {len(ids)} is {want}, but the target ranks {best} first by {gap:.4f}"
                        + (" although the exact kernels are on" if exact else f" (not a near-tie: >= {max_gap})")
                    )
            cache.commit(tree, lay, list(range(1, len(chunk))))
    finally:
        engine.reset()
    return len(ids)


def tree_of(*paths, root):
    b = TreeBuilder(root)
    for path in paths:
        node = 0
        for t in path:
            node = b.add(node, t, source=TokenSource.NGRAM)
    return b.build()


def chain(root, toks) -> TokenTree:
    return TokenTree.chain(root, toks)


def perturbed_gap(engine, prefix, sampling):
    """Top-2 gap of the seeded Gumbel-perturbed processed logits after ``prefix``: the
    margin by which plain decoding chose its token at that position."""
    from localspec.request_state import RequestState
    from localspec.sampling import gumbel_noise
    from localspec.tree import TokenTree

    engine.reset()
    engine.cache.prefill(prefix[:-1])
    tree = TokenTree.root_only(prefix[-1])
    lay, lg = engine.cache.decode_tree(tree)
    row = lg[0].copy()
    engine.cache.commit(tree, lay, [])
    req = RequestState(sampling, engine.model, prefix)
    c = req.processor.candidates(row, req.penalties.counts if req.penalties else None, None)
    z = np.sort(c.logits + gumbel_noise(req.seed, len(prefix), c.ids))
    engine.reset()
    return float(z[-1] - z[-2]) if z.size > 1 else float("inf")


# -- classic rejection sampling of model-drafted trees on fixed real rows ------------------------

REJECTION_SAMPLING = SamplingParams(temperature=1.0, top_k=4, top_p=1.0, min_p=0.0, verify="rejection")
REJECTION_SHAPES = [TreeShape(2, 1, 3, 0.0), TreeShape(2, 2, 7, 0.0)]  # chain, tree


class PrecomputedDraft:
    """A LevelDecoder answering from draft rows computed once: after the root, and after each
    possible first draft token (trees of depth 2)."""

    def __init__(self, root_row, rows_after):
        self.root_row, self.rows_after = root_row, rows_after

    def decode_level(self, tree, nodes):
        return np.stack([self.root_row if n == 0 else self.rows_after[tree.tokens[n]] for n in nodes])


def assert_rejection_sampling_exact(model, prompt, draft_root, draft_after, shape, target_rows, n=2500):
    """Grow ``n`` sampled draft trees (one per seed) from fixed draft rows, verify each by
    classic rejection sampling on the target's real rows, and check with a chi-square test
    that the first two emitted tokens follow the target's joint distribution.

    Args:
        draft_root: [n_vocab] draft logits after ``prompt``; draft_after: token -> draft
            logits after ``prompt + [token]`` for every token the draft may sample first.
        target_rows: ``(prompt, tokens) -> (root_row, {token: row})`` computes target logits.
    """
    from conftest import chisquare_pvalue

    sp = REJECTION_SAMPLING
    req0 = RequestState(sp.with_seed(0), model, prompt)
    t_root, _ = target_rows(prompt, [])
    target_support = req0.processor.candidates(t_root).ids
    first = np.union1d(np.fromiter(draft_after, dtype=np.int64), target_support)
    t_root, t_after = target_rows(prompt, first)
    draft = PrecomputedDraft(draft_root, draft_after)
    pos = len(prompt)
    counts: dict[tuple[int, int], int] = {}
    stacked: dict[tuple[int, ...], np.ndarray] = {}  # node -> row choice: few distinct trees, stacked once
    for seed in range(n):
        s = sp.with_seed(seed)
        sampler = DraftChildSelector(s, model.n_vocab)
        tree = expand_tree(prompt[-1], pos - 1, shape, draft, sampler, DraftCalibration(), TokenSource.DRAFT_MODEL)
        assert tree.is_stochastic(1)
        # the target row after each node: after its first-level token, or the root's row
        # (deeper rows never decide the first two tokens)
        which = tuple(int(tree.token_ids[tree.path_to(i)[0]]) if tree.depth[i] == 1 else -1 for i in range(tree.n_nodes))
        rows = stacked.get(which)
        if rows is None:
            rows = np.stack([t_after[t] if t >= 0 else t_root for t in which])
            rows.flags.writeable = False  # shared by every seed that grows this tree: verify must not write
            stacked[which] = rows
        res = verify_rejection(tree, rows, RequestState(s, model, prompt).cursor(pos))
        if len(res.tokens) >= 2:
            second = res.tokens[1]
        else:  # the next step decodes the second token
            c = RequestState(s, model, prompt + res.tokens).cursor(pos + 1)
            second = sample_from(c.target_probs(t_after[res.tokens[0]]), c.residual_uniform())
        counts[(res.tokens[0], second)] = counts.get((res.tokens[0], second), 0) + 1
    p1 = req0.cursor(pos).target_probs(t_root)
    keys, expected = [], []
    for a in target_support:
        p2 = RequestState(sp.with_seed(0), model, prompt + [int(a)]).cursor(pos + 1).target_probs(t_after[int(a)])
        for b in np.flatnonzero(p2):
            keys.append((int(a), int(b)))
            expected.append(p1[a] * p2[b])
    assert sum(counts.values()) == sum(counts.get(k, 0) for k in keys)  # nothing outside the support
    assert chisquare_pvalue([counts.get(k, 0) for k in keys], expected) > 1e-3


def serve_app_thread(model, engine, *, max_body_bytes: int, parallel: int = 2):
    """A context manager: ``localspec serve``'s app (OpenAI endpoints over a greedy
    ``BatchScheduler`` of ``parallel`` slots, the editor endpoints over ``engine``) on a real
    HTTP server on 127.0.0.1; yields the ``AppThread`` with ``.sched`` set. Closes the
    scheduler and the editor service and resets ``engine`` on exit."""
    from contextlib import contextmanager

    from conftest import frozen_cost_model
    from localspec.scheduler import BatchScheduler
    from localspec.server import CompletionService, ServiceConfig
    from localspec.server.http import AppThread
    from localspec.server.openai import OpenAIService, create_serve_app

    @contextmanager
    def run():
        sched = BatchScheduler(model, parallel=parallel, n_ctx=512, cost_model=frozen_cost_model()).start()
        oai = OpenAIService(sched, model_name="gemma-test", sampling=SamplingParams.greedy())
        editor = CompletionService(engine, ServiceConfig(sampling=SamplingParams.greedy()))
        try:
            with AppThread(create_serve_app(oai, editor, max_body_bytes=max_body_bytes)) as srv:
                srv.sched = sched
                yield srv
        finally:
            editor.close()
            sched.close()
            engine.reset()

    return run()


@contextlib.contextmanager
def localspec_process(*args: str):
    """``python -m localspec ARGS`` (a server command with ``--port 0``) as a process; yields
    ``(process, url, err)`` once it prints ``listening on URL`` (``err``: its stderr lines, read
    in a thread). A watchdog kills it after 900 s (a hung process fails the test instead of the
    run); on exit it is terminated (killed after 60 s)."""
    proc = subprocess.Popen([sys.executable, "-m", "localspec", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)
    reader.start()
    watchdog = threading.Timer(900, proc.kill)
    watchdog.start()
    try:
        line = proc.stdout.readline()
        assert "listening on " in line, (line, "".join(err))
        yield proc, line.split("listening on ", 1)[1].split()[0].strip(), err
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        proc.wait()
        reader.join(30)
