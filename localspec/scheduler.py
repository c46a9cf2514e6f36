"""``BatchScheduler``: several requests, one context, one ``llama_decode`` per step.

Each active request owns a *slot*: a block of ``S`` sequence ids of one shared target
context (its committed tokens in the block's first id, its token tree's leaves in the
others). Every step is the engine's own (``localspec.step.Step``): a tree per request, one
node budget across the requests, every request's pending tokens and tree (and prompt pieces)
in **one** ``llama_decode``, then verify, commit and emit per request::

    step:  propose (per request) -> allocate -> ONE decode -> verify + commit + emit (per request)

Output does not depend on the neighbours. Each row of a batch is computed bit for bit like a
single-token decode (the exact kernels, docs/architecture.md), attention skips the cells of
other sequences, and llama.cpp's CPU attention accumulates a request's own cells in *cell
order* - so every request's cells must stay in position order. llama.cpp reuses freed cells
(the lowest free cell first), which would put a request's new token in a hole left by a
neighbour's rejected draft, before its own earlier cells. The scheduler therefore never
frees a cell while it holds requests or cached prompts: rejected tree nodes and finished
requests are re-tagged to one *junk* sequence (``llama_memory_seq_cp`` then ``seq_rm``: the
cell stays occupied and is attended by nobody), so new cells always go after every used cell.

Prompts are prefilled inside the steps: an admitted request's prompt goes into the batch as
rows without logits, at most ``prefill_chunk`` tokens per step while others decode (a long
prompt joins in pieces instead of stalling every running stream), and the step that takes
its last piece also decodes its first tree.

Prompt cache. The same tokens at the same positions have the same KV bit for bit (exact
kernels), so a prompt that starts like cells already in the cache shares them: the cells get
the new request's sequence id too (``seq_cp``: no copy, nothing computed) and only the rest is
prefilled. Candidates are the running requests' committed cells and up to ``prompt_cache``
*entries*: a finished request's committed cells (prompt and reply, the next chat turn's
prefix), least recently used dropped first. A prompt whose longer prefix a running request is
still prefilling waits for it (prompts that share a header, arriving together).

Compaction. When the cache is full, ``compact()`` clears it and puts back every running
request's and entry's cells *moved*, not recomputed (``llama_state_seq_get_data`` /
``set_data``: the K and V bytes copied; ``Context.save_cells`` saves window by window, because
llama.cpp saves a sliding-window layer's cells only within the window), each sequence in
position order and a prefix that several share stored once.

The step itself is ``localspec.step.Step``, the engine's: every decoding request's tree
sized by one node budget (``SpeculationPolicy.allocate``: as the batch fills, ``t(b)`` grows
and drafts stop paying, so speculation fades, and it returns when the batch empties),
decoded in one ``llama_decode`` with the prompt pieces, then verified, committed and emitted
per request. The scheduler keeps only admission, prompt pieces, the prompt cache and
compaction. Every drafter runs here: each slot has its own (the engine's name and options;
slots after the first are slot 0's ``spawn``, sharing what it loaded and, for a draft model,
an EAGLE-3 head or an MTP block, one draft context whose tree levels are decoded for all
requests together) and keeps it from request to request.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .backend import Model, SequenceCache
from .backend.kv import common_prefix
from .costmodel import CostModel, calibrate
from .drafters import TargetHandle, resolve_drafter
from .draft_limits import DraftLimits
from .errors import ContextOverflowError, InvalidRequestError
from .generation import Generation, check_max_tokens, check_stop, now_us
from .policy import SpeculationPolicy
from .request_state import RequestState
from .results import GenerationResult, StreamChunk
from .sampling import SamplingParams
from .stats import GenerationStats
from .step import Entry, Piece, Step, feature_layers, reads_final_norm, tapped_context

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Engine

log = logging.getLogger("localspec.scheduler")


MAX_SEQ = 256  # llama.cpp's LLAMA_MAX_SEQ
MAX_PARALLEL = MAX_SEQ - 2  # a sequence id per request at least, and the scratch and junk ids

PREFILL_CHUNK = 64
"""Most prompt tokens one step prefills while other requests decode (``BatchScheduler``): on
the 2-core development CPU a running request's longest gap while a 1,000-token prompt joins is
0.22 s with 64, 0.43 s with 128, 3.1 s with the whole prompt in one step, for the same time to
the long prompt's first token (``scripts/prefill_stall.py``, docs/serve.md)."""

IDLE_PREFILL_PIECES = 4
"""When no request decodes, a step prefills up to this many ``prefill_chunk`` pieces."""

PREFIX_WAIT = 32
"""A prompt waits for a running request's prefill when that will give it this many more cached
tokens than it can reuse now."""


class BatchJob:
    """One request submitted to a ``BatchScheduler``.

    ``result`` (a ``GenerationResult``) is set and ``done`` is set when it ends; ``cancel()``
    (thread-safe) ends it after the current step with ``finish_reason == "cancelled"`` and
    frees its slot. ``on_chunk`` (called on the scheduler's thread) receives ``StreamChunk``s.
    ``cache_prompt=False`` prefills the whole prompt even when the prompt cache holds a prefix
    of it (llama.cpp's ``cache_prompt`` field; benchmarks use it). ``draft_limits`` cuts each
    of its draft trees (``DraftLimits``: llama.cpp's per-request ``speculative.n_max`` / ``p_min``).
    """

    _ids = itertools.count(1)

    def __init__(self, prompt: list[int], *, max_tokens: int, sampling: SamplingParams, stop: Sequence[str],
                 speculative: bool, on_chunk: Callable[[StreamChunk], None] | None, tag=None,
                 on_done: Callable[["BatchJob"], None] | None = None, cache_prompt: bool = True,
                 draft_limits: DraftLimits | None = None) -> None:  # fmt: skip
        self.id = next(BatchJob._ids)
        self.draft_limits = draft_limits
        self.prompt = prompt
        self.cache_prompt = cache_prompt
        self.max_tokens = max_tokens
        self.sampling = sampling
        self.stop = list(stop)
        self.speculative = speculative
        self.on_chunk = on_chunk
        self.on_done = on_done
        self.tag = tag
        self.result: GenerationResult | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.cancelled = threading.Event()
        self.t_submit_us = now_us()

    def cancel(self) -> None:
        self.cancelled.set()

    def _set_done(self) -> None:
        self.done.set()
        if self.on_done is not None:
            try:
                self.on_done(self)
            except Exception:  # a client that went away must not stop the scheduler
                log.debug("job %d: on_done failed", self.id, exc_info=True)

    def wait(self, timeout: float | None = None) -> GenerationResult:
        """Block until the job ends; returns its result or raises its error."""
        if not self.done.wait(timeout):
            raise TimeoutError(f"job {self.id} did not finish in {timeout} s")
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


@dataclass
class _CacheEntry:
    """A finished request's KV cells kept for the prompts that follow (``BatchScheduler``'s
    prompt cache): ``tokens`` are at positions ``0..len-1`` of sequence ``seq``."""

    seq: int
    tokens: list[int]
    last_used: int


def _share_plan(seqs: Sequence[tuple[int, Sequence[int]]]) -> tuple[list[tuple[int, int, int | None, int]], int]:
    """How to put ``(seq, tokens)`` sequences back into an empty KV cache with shared prefixes
    stored once: per sequence, in order, ``(seq, n_tokens, parent, k)``: its first ``k`` cells
    are the ``parent``'s (an earlier sequence with the longest common prefix; None when
    ``k == 0``), the rest its own. Also returns the number of cells in all."""
    out: list[tuple[int, int, int | None, int]] = []
    cells = 0
    for i, (seq, toks) in enumerate(seqs):
        parent, k = None, 0
        for pseq, ptoks in seqs[:i]:
            c = common_prefix(toks, ptoks)
            if c > k:
                parent, k = pseq, c
        out.append((seq, len(toks), parent, k))
        cells += len(toks) - k
    return out, cells


@dataclass
class _Slot:
    """One active request: its job, its place (``index``, first sequence id ``base``) and its
    state on the step (``entry``: the ``Generation`` and its ``SequenceCache``, whose pending
    tokens are the prompt's rest while ``prefilling``, afterwards accepted tokens decoded again)."""

    job: BatchJob
    index: int
    entry: Entry
    prefilling: bool = True  # the prompt is not all in KV yet (no tree decoded so far)

    @property
    def base(self) -> int:
        return self.entry.kv.base

    @property
    def gen(self) -> Generation:
        return self.entry.gen

    @property
    def kv(self) -> SequenceCache:
        return self.entry.kv


class BatchScheduler:
    """Runs many generation requests together on one target context.

    Args:
        model: a loaded ``Model`` (shared, not closed here).
        parallel: most requests decoded together (slots).
        n_ctx: tokens one request may hold (prompt + generated).
        drafter: a drafter name (``localspec.drafters``: ``"none"``, ``"ngram"``, ``"draft"``,
            ``"eagle3"``, ``"medusa"``, ``"mtp"``, ``"auto"``); each slot makes its own with
            ``drafter_options`` (``resolve_drafter``) and keeps it from request to request.
        drafter_options: the drafter's options (``draft_model``, ``eagle``, ``medusa``, ...).
        max_tree_nodes: largest tree of one request (root included).
        cost_model: the target's decode cost; default: the engine's calibration (cached).
        n_threads: CPU threads (default: all available, at most 16).
        adaptive: False verifies every proposed tree (``max_tree_nodes``), for tests.
        prompt_cache: finished requests whose KV cells are kept for later prompts that start
            with the same tokens (default ``parallel``; 0 keeps none). Running requests'
            cells are shared as well, whatever this is.
        prefill_chunk: most prompt tokens prefilled in one step while other requests decode
            (a long prompt joins the running batch in pieces instead of stopping it); when
            no request decodes, ``IDLE_PREFILL_PIECES`` times as many. Shorter prompts first.
        draft_memory: a ``drafters.DraftMemory`` shared by the requests' drafters (each reads
            it and writes its request when it ends), or None.

    Use ``submit`` (thread-safe) and either ``start()`` a worker thread (the server) or
    drive it with ``run_until_idle()`` (offline batches). ``close()`` ends it.

    Raises:
        InvalidRequestError / ModelLoadError / VocabMismatchError: a drafter that cannot be
            made for this target, or bad sizes.
    """

    def __init__(self, model: Model, *, parallel: int = 4, n_ctx: int = 4096, drafter: str | None = "ngram",
                 max_tree_nodes: int = 32, cost_model: CostModel | None = None, n_threads: int | None = None,
                 adaptive: bool = True, flash_attn: bool | None = None, prompt_cache: int | None = None,
                 prefill_chunk: int = PREFILL_CHUNK, drafter_options: dict | None = None,
                 draft_memory=None) -> None:  # fmt: skip
        drafter = drafter or "none"
        if not 1 <= parallel <= MAX_PARALLEL:
            raise InvalidRequestError(f"parallel must be in 1..{MAX_PARALLEL} (llama.cpp's {MAX_SEQ} sequence ids), got {parallel}")
        if n_ctx < 16:
            raise InvalidRequestError(f"n_ctx must be at least 16 tokens (got {n_ctx})")
        if prefill_chunk < 1:
            raise InvalidRequestError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        n_entries = parallel if prompt_cache is None else int(prompt_cache)
        if n_entries < 0:
            raise InvalidRequestError(f"prompt_cache must be >= 0, got {prompt_cache}")
        # sequence ids: `parallel` blocks of S ids, the prompt cache's entries, one scratch id
        # (moves) and one junk id
        n_entries = min(n_entries, max(0, MAX_SEQ - 2 - parallel))
        self.seqs_per_slot = min((MAX_SEQ - 2 - n_entries) // parallel, max_tree_nodes)
        assert self.seqs_per_slot >= 1  # parallel <= MAX_PARALLEL
        self.model = model
        self.parallel = int(parallel)
        self.n_ctx_slot = int(n_ctx)
        self.max_tree_nodes = int(min(max_tree_nodes, n_ctx // 2 - 1, 255))
        self.drafter_name = drafter
        self.draft_memory = draft_memory  # a DraftMemory the requests' drafters share, or None
        self.usage_log = None  # a usage.UsageLog that finished requests are added to (--record-usage)
        self.adaptive = adaptive
        first_entry = self.parallel * self.seqs_per_slot
        self._free_entry_seqs = list(range(first_entry + n_entries - 1, first_entry - 1, -1))
        self.scratch_seq = first_entry + n_entries
        self.junk_seq = self.scratch_seq + 1
        n_seq_max = self.junk_seq + 1
        step_tokens = self.parallel * 2 * self.max_tree_nodes
        # headroom for junk cells before a compaction; at least one full step after one
        kv = self.parallel * self.n_ctx_slot + max(2 * step_tokens, 1024)
        self.prefill_chunk = int(prefill_chunk)
        n_batch = max(512, step_tokens, n_seq_max) + self.prefill_chunk
        self._ctx_args = dict(n_ctx=kv, n_batch=n_batch, n_seq_max=n_seq_max, n_threads=n_threads, flash_attn=flash_attn)
        self.drafter_options = dict(drafter_options or {})
        self._drafters: list = [None] * self.parallel  # each slot's drafter, kept between requests
        first = self._new_drafter()  # slot 0's: it says what the context must tap
        self._reads = (feature_layers(first), reads_final_norm(first))
        self._tap = self._norm_tap = None
        try:
            self._make_context()
            self._make_drafters(first)
        except BaseException:
            if first is not None and self._drafters[0] is not first:
                first.close()
            self._close_drafters()
            if getattr(self, "ctx", None) is not None:
                self.ctx.close()
            raise
        self.kv_size = self.ctx.n_ctx
        self.n_batch = n_batch
        if cost_model is None:
            cost_model = calibrate(self.ctx, max_size=64)
            self.ctx.clear()
        self.cost_model = cost_model
        self.policy = SpeculationPolicy(self.cost_model, max_nodes=self.max_tree_nodes)
        self._step_obj: Step | None = None
        self.n_used = 0  # KV cells occupied (append-only between compactions)
        self.n_compactions = 0
        self.slots: list[_Slot | None] = [None] * self.parallel
        self.cache: list[_CacheEntry] = []  # the prompt cache (finished requests' cells)
        self._clock = itertools.count(1)  # recency of cache entries
        self.n_cache_hits = 0
        self._queue: collections.deque[BatchJob] = collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.n_steps = 0
        self.t_last_step_us: float | None = None  # when the last step ended (``now_us``)
        # (n_requests decoding, n_tokens, n_prefill_tokens) per step
        self.step_log: collections.deque = collections.deque(maxlen=4096)

    # -- public -------------------------------------------------------------------------------

    def submit(self, prompt: Sequence[int], *, max_tokens: int = 256, sampling: SamplingParams | None = None,
               stop: Sequence[str] = (), speculative: bool = True,
               on_chunk: Callable[[StreamChunk], None] | None = None, tag=None,
               on_done: Callable[[BatchJob], None] | None = None, cache_prompt: bool = True,
               draft_limits: DraftLimits | None = None) -> BatchJob:  # fmt: skip
        """Queue a request (token ids; see ``Engine.tokenize``). ``cache_prompt=False``: prefill
        the whole prompt, reusing no cached prefix.

        Raises:
            InvalidRequestError: empty prompt, bad token ids, a ``max_tokens`` that is not a whole number >= 0,
                a ``stop`` that is not a string or strings (``check_stop``), closed.
            ContextOverflowError: the prompt leaves no room in a request's context.
            GrammarError: the sampling grammar does not parse.
        """
        tokens = [int(t) for t in prompt]
        if not tokens:
            raise InvalidRequestError("the prompt is empty (and the model adds no BOS token)")
        bad = [t for t in tokens if not 0 <= t < self.model.n_vocab]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary (0..{self.model.n_vocab - 1})")
        max_tokens = check_max_tokens(max_tokens)
        stop = check_stop(stop)
        if len(tokens) >= self.n_ctx_slot:
            raise ContextOverflowError.prompt(len(tokens), self.n_ctx_slot, max_tokens=max_tokens,
                                              settings="serve --ctx-per-request, batch --n-ctx, generate_batch(n_ctx=)")  # fmt: skip
        sampling = sampling or SamplingParams()
        job = BatchJob(tokens, max_tokens=max_tokens, sampling=sampling, stop=stop, speculative=speculative,
                       on_chunk=on_chunk, tag=tag, on_done=on_done, cache_prompt=cache_prompt,
                       draft_limits=draft_limits)  # fmt: skip
        # build the sampler now, so a bad grammar is the caller's error, not the worker's
        job._sampler = RequestState(sampling, self.model, tokens)  # type: ignore[attr-defined]
        with self._cv:
            if self._closed:
                job._sampler.close()  # type: ignore[attr-defined]
                raise InvalidRequestError("the scheduler is closed")
            self._queue.append(job)
            self._cv.notify_all()
        return job

    @property
    def n_active(self) -> int:
        return sum(s is not None for s in self.slots)

    @property
    def n_waiting(self) -> int:
        return len(self._queue)

    def start(self) -> "BatchScheduler":
        """Run the scheduler on a background thread until ``close()``."""
        self._thread = threading.Thread(target=self._serve, name="localspec-batch", daemon=True)
        self._thread.start()
        return self

    def run_until_idle(self) -> None:
        """Run steps on this thread until no request is active or waiting."""
        while self._queue or self.n_active:
            self.step()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            jobs = list(self._queue)
            self._queue.clear()
            self._cv.notify_all()
        for s in self.slots:
            if s is not None:
                s.job.cancel()
        if self._thread is not None:
            self._thread.join(30)
        for j in jobs:
            self._end_unstarted(j, "cancelled")
        for s in list(self.slots):
            if s is not None:
                self._finish(s, "cancelled")
        self._close_drafters()
        self.ctx.close()

    def __enter__(self) -> "BatchScheduler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- worker -------------------------------------------------------------------------------

    def _serve(self) -> None:
        while True:
            with self._cv:
                while not self._closed and not self._queue and not self.n_active:
                    self._cv.wait()
                if self._closed:
                    return
            try:
                self.step()
            except Exception as e:  # never let one bad step stop the server
                log.exception("batch step failed")
                self._fail_all(e)

    def _fail_all(self, e: BaseException) -> None:
        for s in list(self.slots):
            if s is not None:
                s.job.error = e
                self._finish(s, "error")
        if self.ctx._ctx is not None:
            self.ctx.clear()
        self._forget_kv()

    def _reconnect_if_lost(self) -> None:
        """A lost RPC worker (or the model reloaded by its engine): the requests in slots end with
        ``WorkerLostError`` (their KV cells were on the old model); the model is loaded again on
        its workers and gets a new context; waiting requests then run on it. While a worker is
        still down, the waiting requests end with its ``RPCError`` instead (no busy retry). Each
        step checks this first, so a server works again once the worker is back."""
        m = self.model
        lost = bool(m._rpc_guards) and m.lost_worker() is not None
        if not lost and self._ctx_generation == m.generation:
            return
        from .backend.rpc import RPCError, WorkerLostError

        def fail(err: BaseException, *, waiting: bool) -> None:
            for s in list(self.slots):
                if s is not None:
                    s.job.error = err
                    self._finish(s, "error")
            if waiting:
                with self._cv:
                    jobs = list(self._queue)
                    self._queue.clear()
                for j in jobs:
                    j.error = err
                    self._end_unstarted(j, "error")

        # the requests in slots had their KV cells on the old model: they end with an error
        try:
            m.check_workers()
            err: BaseException = WorkerLostError("the model was reloaded (its RPC worker was lost)")
        except WorkerLostError as e:
            err = e
        fail(err, waiting=False)
        if lost:
            try:
                m.probe_workers()
            except RPCError as e:  # still down: fail what waits (no busy retry); the next request retries
                fail(e, waiting=True)
                return
        self.ctx.close()
        self._forget_kv()
        if lost:
            m.reload_if_lost()  # a no-op when another user of the model did it
        self._close_drafters()  # model drafters may borrow the old context's tensors
        self._make_context()
        self._make_drafters()

    def step(self) -> None:
        """End cancelled / finished requests, admit waiting ones into the free slots, then run
        one step: every decoding request's pending tokens and tree, and pieces of the prompts
        still being prefilled, in one ``llama_decode``."""
        self._reconnect_if_lost()
        for s in [s for s in self.slots if s is not None]:  # requests that end before decoding more
            j = s.job
            if j.cancelled.is_set():
                self._finish(s, "cancelled")
            elif (reason := s.gen.stop_reason(s.kv.n_free)) is not None:
                self._finish(s, reason)
        self._admit()  # a freed slot takes the next waiting request in this very step
        active = [s for s in self.slots if s is not None]
        if active:
            self._decode_step(active)
            self.t_last_step_us = now_us()  # /health: the age of the last completed step

    def _end_unstarted(self, job: BatchJob, reason: str) -> None:
        sampler = getattr(job, "_sampler", None)
        if sampler is not None:
            sampler.close()
        job.result = GenerationResult("", [], reason, None, [], [] if job.sampling.logprobs is not None else None,
                                      GenerationStats(n_prompt_tokens=len(job.prompt)))  # fmt: skip
        job._set_done()

    # -- admission and the prompt cache -------------------------------------------------------

    def _admit(self) -> None:
        while True:
            with self._cv:
                if not self._queue:
                    return
                free = [i for i, s in enumerate(self.slots) if s is None]
                if not free:
                    return
                job = self._queue[0]
                if not (job.cancelled.is_set() or job.max_tokens == 0):
                    src, k = self._best_prefix(job)
                    if self._prefix_in_flight(job, k):
                        return  # a running request is prefilling a longer prefix of it: wait for it
                    need = len(job.prompt) - k + 2 * self.max_tree_nodes
                    if self.n_used + need > self.kv_size:
                        self.compact(need)
                        if self.n_used + need > self.kv_size:
                            return  # waits for a request to end
                        src, k = self._best_prefix(job)  # the compaction may have dropped entries
                self._queue.popleft()
            if job.cancelled.is_set():
                self._end_unstarted(job, "cancelled")
            elif job.max_tokens == 0:
                self._end_unstarted(job, "length")
            else:
                self._start(job, free[0], src, k)

    def _best_prefix(self, job: BatchJob) -> tuple[int | None, int]:
        """The sequence whose KV cells hold the longest prefix of ``job``'s prompt (a prompt-cache
        entry or a running request's committed tokens) and that length, at most all but the
        prompt's last token (which is decoded as the first tree's root); ``(None, 0)`` if none."""
        if not job.cache_prompt:
            return None, 0
        head = job.prompt[:-1]
        best: tuple[int | None, int] = (None, 0)
        for seq, toks in [(e.seq, e.tokens) for e in self.cache] + [
            (s.base, s.kv.tokens) for s in self.slots if s is not None
        ]:  # fmt: skip
            k = common_prefix(head, toks)
            if k > best[1]:
                best = (seq, k)
        return best

    def _prefix_in_flight(self, job: BatchJob, k: int) -> bool:
        """True when a request still prefilling will soon hold at least ``PREFIX_WAIT`` more tokens
        of ``job``'s prompt than ``k``: admitting ``job`` after those are in KV saves prefilling
        them twice (prompts that share a long header, arriving together)."""
        if not job.cache_prompt:
            return False
        head = job.prompt[:-1]
        for s in self.slots:
            if s is not None and s.prefilling and s.kv.pending:
                k2 = common_prefix(head, s.kv.tokens + s.kv.pending)
                if k2 > s.kv.n_past and k2 >= k + PREFIX_WAIT:
                    return True
        return False

    def _start(self, job: BatchJob, index: int, src: int | None, k: int) -> None:
        base = index * self.seqs_per_slot
        drafter = self._drafters[index] if job.speculative else None
        state: RequestState = job._sampler  # type: ignore[attr-defined]
        gen = Generation(job.prompt, state, drafter,
                         calibration=self.policy.calibration.for_request() if drafter is not None else None,
                         max_tokens=job.max_tokens, stop=job.stop, token_bytes=self.model.token_bytes,
                         is_eog=self.model.is_eog, t_start_us=job.t_submit_us,
                         draft_limits=getattr(job, "draft_limits", None), cancelled=job.cancelled)  # fmt: skip
        gen.stats.n_cached_tokens = k
        kv = SequenceCache(self.ctx, base=base, n_scratch=self.seqs_per_slot - 1, junk=self.junk_seq,
                           n_ctx=self.n_ctx_slot, max_tree_nodes=self.max_tree_nodes)  # fmt: skip
        s = _Slot(job=job, index=index, entry=Entry(gen, kv))
        if drafter is not None:
            if hasattr(drafter, "set_sampling"):
                drafter.set_sampling(state)
            drafter.begin(job.prompt)
            if feature_layers(drafter):  # target features exist for what the slot's drafter has seen
                k = min(k, drafter.n_target_features)
                gen.stats.n_cached_tokens = k
        if k:
            # the cells of the shared prefix get this slot's sequence id too (no copy, no compute):
            # the same tokens at the same positions have the same KV bit for bit (exact kernels)
            self.ctx.seq_cp(src, base, 0, k)
            kv.tokens = list(job.prompt[:k])
            self.n_cache_hits += 1
            for e in self.cache:
                if e.seq == src:
                    e.last_used = next(self._clock)
        kv.pending = list(job.prompt[k:-1])  # prefilled by the next steps (``_decode_step``)
        self.slots[index] = s
        kv.check()
        log.debug("job %d: slot %d, prompt %d tokens, %d cached", job.id, index, len(job.prompt), k)

    def _store(self, s: _Slot) -> None:
        """Keep a finished request's committed cells as a prompt-cache entry (before they go to
        the junk sequence). An entry whose tokens this one extends is replaced; when every entry
        id is taken, the least recently used entry is dropped."""
        toks = list(s.kv.tokens)
        if not toks or (not self.cache and not self._free_entry_seqs):
            return
        for e in list(self.cache):
            k = common_prefix(e.tokens, toks)
            if k == len(toks):  # an entry already holds all of these (and maybe more)
                e.last_used = next(self._clock)
                return
            if k == len(e.tokens):
                self._drop_entry(e)
        if not self._free_entry_seqs:
            self._drop_entry(min(self.cache, key=lambda e: e.last_used))
        seq = self._free_entry_seqs.pop()
        self.ctx.seq_cp(s.base, seq, -1, -1)
        self.cache.append(_CacheEntry(seq, toks, next(self._clock)))

    def _drop_entry(self, e: _CacheEntry) -> None:
        """Forget an entry: its cells go to the junk sequence (kept occupied, see the module
        docstring) unless another sequence holds them."""
        self.cache.remove(e)
        if self.ctx._ctx is not None:
            self.ctx.seq_cp(e.seq, self.junk_seq, -1, -1)
            self.ctx.seq_rm(e.seq, -1, -1)
        self._free_entry_seqs.append(e.seq)

    def _forget_kv(self) -> None:
        """The KV cache is gone (cleared after a failed step, or a new context): no entries."""
        self._free_entry_seqs.extend(e.seq for e in self.cache)
        self.cache.clear()
        self.n_used = 0

    def compact(self, need: int = 0) -> None:
        """Drop the junk cells: clear the KV cache and put back every running request's cells
        and the prompt cache's entries, moved (``Context.save_cells`` / ``restore_cells``: K and
        V bytes copied, nothing recomputed), each sequence in position order, a prefix that
        several sequences share stored once. The least recently used entries are dropped when
        keeping them would leave less than ``need`` cells, or less than a quarter of the cache,
        free.

        Raises:
            KVCacheError: a sequence could not be saved or put back (the step fails; the
                server's requests end with the error and the next ones start on a clear cache).
        """
        self.n_compactions += 1
        live = [(s.base, s.kv.tokens) for s in self.slots if s is not None]
        keep = sorted(self.cache, key=lambda e: -e.last_used)
        while True:
            order, cells = _share_plan(live + [(e.seq, e.tokens) for e in keep])
            if not keep or cells + max(need, self.kv_size // 4) <= self.kv_size:
                break
            keep.pop()
        for e in [e for e in self.cache if e not in keep]:
            self._drop_entry(e)
        saved = [(seq, parent, k, n, self.ctx.save_cells(seq, k, n, scratch=self.scratch_seq))
                 for seq, n, parent, k in order]  # fmt: skip
        self.ctx.clear()
        self.n_used = 0
        for seq, parent, k, n, pieces in saved:
            if k:
                self.ctx.seq_cp(parent, seq, 0, k)
            self.ctx.restore_cells(pieces, seq, scratch=self.scratch_seq)
            self.n_used += n - k
        for s in self.slots:
            if s is not None:
                s.kv.check()
        for e in self.cache:
            self.ctx.expect_positions(e.seq, len(e.tokens), f"prompt-cache entry {e.seq} after a compaction")

    # -- one step -----------------------------------------------------------------------------

    def _step(self) -> Step:
        """The step on the current context (made again when the context is)."""
        if self._step_obj is None or self._step_obj.ctx is not self.ctx:
            self._step_obj = Step(self.ctx, self.policy, max_tree_nodes=self.max_tree_nodes, capacity=self.n_batch,
                                  n_seq_cols=max(self.seqs_per_slot, 1), adaptive=self.adaptive, tap=self._tap,
                                  norm_tap=self._norm_tap)  # fmt: skip
        return self._step_obj

    def _make_context(self) -> None:
        """(Re)create the target context with the tap its drafters read (``FeatureTap`` /
        ``NextnTap`` for EAGLE-3 heads and MTP blocks, ``FinalNormTap`` for Medusa heads)."""
        self.ctx, self._tap, self._norm_tap = tapped_context(self.model, *self._reads, **self._ctx_args)
        self._ctx_generation = self.model.generation

    def _new_drafter(self):
        """A new drafter of the scheduler's name and options (not attached), or None."""
        if self.drafter_name == "none":
            return None
        return resolve_drafter(self.drafter_name, self.model, memory=self.draft_memory, **self.drafter_options)

    def _make_drafters(self, first=None) -> None:
        """Every slot's drafter (``first``, if given, is slot 0's), attached to the current
        context now rather than on the slot's first request (a model drafter loads its head or
        draft model and makes a context: seconds that a request at a fresh slot would wait).
        Slots after the first get slot 0's ``spawn`` when it has one: the drafters share what
        it loaded (a draft model, heads' weights: loaded once) and draft together (one draft
        context, with a range of sequence ids per slot: ``TargetHandle.n_requests``).
        Each keeps its state from request to request, as the engine's drafter does."""
        handle = TargetHandle(self.model, n_ctx=self.n_ctx_slot, n_threads=self.ctx.n_threads,
                              tensor_source=self.ctx, features=self._tap, n_requests=self.parallel)  # fmt: skip
        for i in range(self.parallel):
            if i == 0:
                d = first if first is not None else self._new_drafter()
            else:
                d = self._drafters[0].spawn() if hasattr(self._drafters[0], "spawn") else self._new_drafter()
            if d is None:
                return
            self._drafters[i] = d  # closed by _close_drafters from here on
            attach = getattr(d, "attach", None)
            if attach is not None:
                attach(handle)

    def _close_drafters(self) -> None:
        """Close every slot's drafter (``_make_drafters`` makes them again)."""
        for i, d in enumerate(self._drafters):
            if d is not None:
                d.close()
            self._drafters[i] = None

    def _decode_step(self, active: list[_Slot]) -> None:
        # prompts still prefilling, shortest first: a piece of each within this step's budget (the
        # whole batch when nobody decodes, so a lone request is not slowed down). A request
        # whose prompt is all in after this step decodes its first tree in this step too.
        decoding = [s for s in active if not s.prefilling]
        n_redecode = sum(len(s.kv.pending) for s in decoding)  # accepted tokens decoded again
        # Nobody waiting on a decode: larger pieces (on the 2-core CPU a prompt token costs no
        # less in pieces of 512 than of 64), but not so large that a prompt arriving meanwhile
        # waits long for the step to end. Shortest prompt first: a short prompt arriving while a
        # long one is prefilled gets its first token without waiting for the long one.
        room = self.n_batch - n_redecode - len(active) * self.max_tree_nodes  # every tree at its largest
        budget = min(self.prefill_chunk if decoding else IDLE_PREFILL_PIECES * self.prefill_chunk, room)
        pieces: list[Piece] = []  # prompt tokens of requests still prefilling after this step
        first: list[_Slot] = []  # requests whose first tree is in this step
        for s in sorted((s for s in active if s.prefilling), key=lambda s: (len(s.kv.pending), s.job.id)):
            n = min(len(s.kv.pending), budget)
            budget -= n
            if n == len(s.kv.pending):
                s.prefilling = False
                first.append(s)
                decoding.append(s)
            elif n:
                pieces.append(Piece(s.entry, n))
        n_prompt = sum(p.n for p in pieces) + sum(len(s.kv.pending) for s in decoding) - n_redecode
        # room for every tree at its largest: a compaction must come before the trees' cells
        need = sum(len(s.kv.pending) + self.max_tree_nodes for s in decoding) + sum(p.n for p in pieces)
        if self.n_used + need > self.kv_size:
            self.compact(need)

        def decoded(t_us: float) -> None:  # llama.cpp's split: the prompt time ends with the first token's logits
            for s in first:
                s.gen.stats.t_prefill_us = t_us - s.job.t_submit_us
                s.gen.t_gen0_us = t_us

        step = self._step()
        chunks = step.run([s.entry for s in decoding], pieces, on_decoded=decoded)
        n_tokens = int(step.batch.n_tokens)
        self.n_used += n_tokens
        self.n_steps += 1
        self.step_log.append((len(decoding), n_tokens, n_prompt))
        for s, cs in zip(decoding, chunks):
            if s.job.on_chunk is not None:
                for c in cs:
                    self._call_sink(s, c)
            if s.gen.error is not None:
                s.job.error = s.gen.error
                self._finish(s, "error")
            elif s.gen.done:
                self._finish(s, s.gen.finish_reason)

    def _call_sink(self, s: _Slot, chunk: StreamChunk) -> None:
        try:
            s.job.on_chunk(chunk)
        except Exception:  # a client that went away must not stop the others
            log.debug("job %d: on_chunk failed", s.job.id, exc_info=True)
            s.job.cancel()

    def _finish(self, s: _Slot, reason: str) -> None:
        """End a request: free its slot at once (its committed cells become a prompt-cache
        entry, the rest go to the junk sequence)."""
        job = s.job
        if self.slots[s.index] is s:
            self.slots[s.index] = None
            if self.ctx._ctx is not None:
                if reason != "error":  # after a failed step its cells may not be what the slot says
                    self._store(s)
                for k in range(self.seqs_per_slot):
                    self.ctx.seq_cp(s.base + k, self.junk_seq, -1, -1)
                    self.ctx.seq_rm(s.base + k, -1, -1)
        g = s.gen
        g.stats.n_redecoded_tokens = s.kv.n_redecoded
        tail = g.finish(reason)
        if g.calibration is not None:
            self.policy.calibration.end_request(g.calibration)
        job.result = g.result
        if self.usage_log is not None:
            self.usage_log.add_generation(g)
        if tail is not None and job.on_chunk is not None:
            self._call_sink(s, tail)
        job._set_done()


def generate_batch(engine: "Engine", prompts: Sequence[str | Sequence[int]], *, parallel: int = 4,
                   max_tokens: int | Sequence[int] = 256, sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                   stop: Sequence[str] = (), speculative: bool = True, n_ctx: int | None = None,
                   return_exceptions: bool = False,
                   on_result: Callable[[int, "GenerationResult | BaseException"], None] | None = None,
                   ) -> list:  # fmt: skip
    """``Engine.generate_batch``: generate every prompt, ``parallel`` at a time in one batch.

    Args:
        engine: supplies the model, the drafter (its name and options: every slot makes its own)
            and the cost model.
        prompts: texts (tokenised like ``Engine.generate``) or token-id lists.
        max_tokens / sampling: one value for all prompts, or one per prompt.
        n_ctx: tokens one request may hold (default: the engine's context, at most 4096).
        return_exceptions: put a prompt's exception in its place in the result list instead of
            raising it (after every other prompt has finished).
        on_result: called ``(index, result or exception)`` as each prompt ends (any order).

    Returns:
        ``GenerationResult`` per prompt, in order (or exceptions, see ``return_exceptions``).
        At temperature 0, and for a seed above it, each text is the one ``Engine.generate``
        gives for that prompt alone.

    Prompts that start with the same tokens (a shared header) prefill them once: the
    scheduler's prompt cache shares the cells (``BatchScheduler``, module docstring).
    """
    if isinstance(prompts, (str, bytes, bytearray)):
        raise InvalidRequestError("prompts must be a list of prompts, not one text (Engine.generate takes one)")
    if not isinstance(prompts, Sequence):
        raise InvalidRequestError(f"prompts must be a list of prompts, got {type(prompts).__name__}")
    n = len(prompts)
    one = isinstance(max_tokens, (str, bytes)) or not isinstance(max_tokens, Sequence)  # a number, None, a text
    mt = [check_max_tokens(x) for x in ([max_tokens] * n if one else max_tokens)]
    sp = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * n
    sp = [engine.with_thresholds(x or SamplingParams()) for x in sp]  # the engine's acceptance thresholds
    if len(mt) != n or len(sp) != n:
        raise InvalidRequestError("max_tokens / sampling lists must have one entry per prompt")
    name, options = "none", {}
    if speculative and engine.drafter is not None:
        spec = engine.drafter_spec
        if spec is None or spec[0] != engine.drafter_name:
            raise InvalidRequestError(
                f"generate_batch makes a drafter per request from a drafter name, and this engine's drafter "
                f"{engine.drafter_name!r} is an object; set_drafter(NAME, ...) or speculative=False"
            )
        name, options = spec
    n_ctx = min(engine.n_ctx, 4096) if n_ctx is None else n_ctx
    sched = BatchScheduler(engine.model, parallel=parallel, n_ctx=n_ctx, drafter=name,
                           drafter_options=options, max_tree_nodes=min(engine.max_tree_nodes, 32),
                           cost_model=engine.cost_model, n_threads=engine.ctx.n_threads,
                           adaptive=engine.adaptive, draft_memory=engine.draft_memory)  # fmt: skip
    out: list = [None] * n
    jobs: dict[int, BatchJob] = {}
    try:
        for i, p in enumerate(prompts):
            try:
                toks = engine.prompt_tokens(p)
                jobs[i] = sched.submit(toks, max_tokens=mt[i], sampling=sp[i], stop=stop, speculative=speculative)
            except Exception as e:  # noqa: BLE001 - reported per prompt
                out[i] = e
                if on_result is not None:
                    on_result(i, e)
        pending = dict(jobs)
        while pending:
            sched.step()
            for i in [i for i, j in pending.items() if j.done.is_set()]:
                j = pending.pop(i)
                out[i] = j.error if j.error is not None else j.result
                if on_result is not None:
                    on_result(i, out[i])
    finally:
        sched.close()
    if not return_exceptions:
        for r in out:
            if isinstance(r, BaseException):
                raise r
    return out
