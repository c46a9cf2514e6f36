"""``ModelDrafter``: the base of the level-by-level model drafters (draft model, EAGLE-3 head,
MTP block): what every drafter that grows its tree one model call per level shares.

The history, the request's ``DraftChildSelector``, the acceptance calibration and statistics, and
the step itself, in two phases so that the engine's policy decides the step once, before
any model call (the drafter never asks the policy itself):

* ``propose(max_depth, max_nodes)``: the cheap drafts of the step. A model drafter has none
  and returns the root alone, without touching its model;
* ``extend(shape)``: only when the policy's plan says so, grow the tree level by level with
  that shape (``tree_expand.expand_levels``), then drop the scratch sequences and check the
  draft's KV cache whatever happened (``finally``). The time of each level is recorded
  (``stats.last_level_us``) for the engine's cost model.

A step that does not extend makes no model call; the drafter catches up on its next
``extend``.

**Several requests, one draft context.** A drafter's ``spawn`` (one per batch slot) shares the
loaded model and, once attached with the same ``TargetHandle``, one draft context
(``DraftHub``): each request owns a range of sequence ids (``seq0``, its history, then its
scratch sequences), and ``DraftHub.extend_many`` grows the trees of every request that drafts
in a step together, each level of all of them in ONE decode (each drafter's ``level_part``
gives its entries and takes back its rows). One request (the engine) is the same path with
a context of one range.

Subclasses provide ``attach`` (checks, then ``bind`` to join or create the draft context),
``level_part`` / ``new_level_batch`` / ``decode_parts`` (or, with ``shares_context = False``,
their own ``decode_level``) and ``check_cache``, and may override ``ready`` (can this step
draft at all?) and ``close``.
"""

from __future__ import annotations

import abc
import copy
import os
import time
from collections.abc import Sequence

import numpy as np

from ..backend import Context, Model
from ..backend import readout as _readout
from ..backend.slots import SeqSlots
from ..policy import ModelDraftStats, TreeShape, accepted_length
from ..sampling import SamplingParams
from ..tree import TokenSource, TokenTree
from .base import TargetHandle
from .tree_expand import DraftCalibration, DraftChildSelector, expand_levels, expand_tree


class _TimedLevels:
    """A ``LevelDecoder`` that times each ``decode_level`` call of another (µs, in order)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.t_us: list[float] = []

    def decode_level(self, tree, nodes):
        t0 = time.perf_counter()
        rows = self.inner.decode_level(tree, nodes)
        self.t_us.append((time.perf_counter() - t0) * 1e6)
        return rows


class _Family:
    """What a drafter and the drafters it ``spawn``-ed share: the loaded model (closed with the
    last of them when the first loaded it) and the draft context they join (``hub``)."""

    def __init__(self, model: Model | None, owns_model: bool) -> None:
        self.model = model
        self.owns_model = owns_model
        self.n_users = 1
        self.hub: DraftHub | None = None

    def release(self) -> None:
        self.n_users -= 1
        if self.n_users <= 0 and self.owns_model and self.model is not None:
            self.model.close()
            self.model = None


class LevelPart:
    """One request's entries of a shared level decode (``DraftHub``), made by its drafter's
    ``level_part``.

    Attributes:
        entries: what the drafter's batch kind takes (``ModelDrafter.decode_parts``).
        n_out: output rows the entries produce (in order, after the previous parts').
        finish: ``finish(logits, out0) -> rows``: the request's draft logits rows from the
            decode's logits rows ``logits`` ([n_out, n_vocab], this part's), ``out0`` the
            index of its first output row in the decode (pre-norm states).
        undo: called when the decode failed (or None).
    """

    def __init__(self, entries, n_out: int, finish, undo=None) -> None:
        self.entries = entries
        self.n_out = int(n_out)
        self.finish = finish
        self.undo = undo


class DraftHub:
    """One draft context for the model drafters of several requests (a drafter and its
    ``spawn``): each request owns a range of ``seqs_each`` sequence ids (its history in the
    first, scratch sequences for its tree nodes in the rest), and every tree level of all the
    requests that draft in a step is ONE decode (``extend_many``).

    Args:
        model: the draft model (or head / MTP model).
        n_requests: requests (ranges of sequence ids).
        n_ctx: cells per request (the context holds ``n_requests * n_ctx``).
        seqs_each: sequence ids per request (1 + its scratch sequences).
        n_batch: entries of one decode (every request's largest level).
        key: what the context was made for (a drafter re-attached to another target makes another).
        **ctx_args: ``Context`` options (threads, ``ctx_other``, ``mtp``).
    """

    def __init__(self, model: Model, *, n_requests: int, n_ctx: int, seqs_each: int, n_batch: int, key,
                 **ctx_args) -> None:  # fmt: skip
        self.n_requests = int(n_requests)
        self.n_ctx_each = int(n_ctx)
        self.seqs_each = int(seqs_each)
        self.key = key
        self.ctx = Context(model, n_ctx=n_ctx * self.n_requests, n_batch=n_batch,
                           n_seq_max=self.seqs_each * self.n_requests, **ctx_args)  # fmt: skip
        self.batch = None  # the level batch, made by the first drafter that decodes (``new_level_batch``)
        self._free = list(range(self.n_requests - 1, -1, -1))
        self.last_level_us: list[float] = []  # the last extend_many's level times (µs, per-request shares)

    @property
    def full(self) -> bool:
        return not self._free

    def join(self) -> int:
        """A free range of sequence ids: its first id."""
        return self._free.pop() * self.seqs_each

    def leave(self, seq0: int) -> None:
        """Give back the range starting at ``seq0`` (its cells dropped); the context is freed
        with the last (it may have been closed already: an engine reconnecting)."""
        if self.ctx._ctx is not None:
            self.ctx.seq_rm(seq0, -1, -1)
        self._free.append(seq0 // self.seqs_each)
        if len(self._free) == self.n_requests:
            if self.batch is not None and hasattr(self.batch, "close"):
                self.batch.close()
            self.batch = None
            self.ctx.close()

    def decode_levels(self, parts: Sequence[tuple["ModelDrafter", LevelPart]]) -> list[np.ndarray]:
        """One decode of every part's entries (each request's level), then each request's rows."""
        first = parts[0][0]
        if self.batch is None:
            self.batch = first.new_level_batch()
        try:
            first.decode_parts(self.batch, [p for _, p in parts])
        except BaseException:
            for _, p in parts:
                if p.undo is not None:
                    p.undo()
            raise
        logits = self.ctx.logits()
        out, off = [], 0
        for _, p in parts:
            out.append(p.finish(logits[off : off + p.n_out], off))
            off += p.n_out
        return out

    def extend_many(self, drafters: Sequence["ModelDrafter"], shapes: Sequence[TreeShape]) -> list[TokenTree]:
        """``extend`` of several requests' drafters on this context, level by level: every
        request's tree grows by ``expand_levels`` and each level of all of them is one decode
        (``decode_levels``); a request whose tree is done drops out. Each request's tree is
        the one it would draft alone (same shapes, same rows up to the decode's rounding).
        Every drafter's scratch sequences are dropped and its cache checked whatever happens;
        each level's time is shared equally by the requests in it (their statistics).

        Requires: ``propose`` was called on each drafter for this step.
        """
        trees: list[TokenTree | None] = [None] * len(drafters)
        runs = []  # [index, drafter, generator, (builder, nodes), level times]
        done: dict[int, list[float]] = {}  # index -> the level times of its finished tree
        self.last_level_us = []
        t0 = time.perf_counter()
        try:
            for i, (d, shape) in enumerate(zip(drafters, shapes)):
                shape = d._step_shape(shape, d.max_depth, d.max_width)
                if shape is None:
                    trees[i] = TokenTree.root_only(d.history[-1])
                    continue
                gen = expand_levels(d.history[-1], len(d.history) - 1, shape, d.sampler, d.calib, d.source)
                runs.append([i, d, gen, next(gen), []])
            while runs:
                t1 = time.perf_counter()
                rows = self.decode_levels([(d, d.level_part(*level)) for _, d, _, level, _ in runs])
                t_level = (time.perf_counter() - t1) * 1e6 / len(runs)
                self.last_level_us.append(t_level)
                left = []
                for run, r in zip(runs, rows):
                    run[4].append(t_level)
                    try:
                        run[3] = run[2].send(r)
                        left.append(run)
                    except StopIteration as stop:
                        trees[run[0]] = stop.value
                        done[run[0]] = run[4]
                runs = left
        finally:
            for d in drafters:
                if d.slots is not None:
                    d.slots.release()
                d._slot_of = {}
                d.check_cache()
        t_us = (time.perf_counter() - t0) * 1e6 / max(1, len(done))
        for i, levels in done.items():
            drafters[i].stats.observe_draft(t_us, trees[i].n_nodes, levels)
        return trees  # type: ignore[return-value]


class ModelDrafter(abc.ABC):
    """Base of model drafters (see the module docstring).

    Args:
        model: the drafting model: a GGUF path, or a loaded ``Model`` (not closed by the drafter).
        n_gpu_layers: layers to offload on CUDA / Metal builds (when loading from a path).
        max_depth / max_width: largest tree shape the policy may ask for (they size the
            draft context's scratch sequences).
        shape: a fixed ``TreeShape`` for every step (tests, experiments; the engine's plan
            then always drafts with it); default: the shape the engine's policy plans.
        n_threads: CPU threads of the draft context (llama.cpp's ``--threads-draft``);
            default: the target's.
    """

    name = "model"
    source = TokenSource.DRAFT_MODEL
    shares_context = True
    """Whether the drafters of several requests (``spawn``) share one draft context and
    decode each tree level together (``DraftHub``: ``level_part``, ``new_level_batch`` and
    ``decode_parts``); False: a context per request, levels by ``decode_level`` (a subclass
    that overrides it)."""

    def __init__(
        self,
        model: Model | str | os.PathLike,
        *,
        n_gpu_layers: int = 0,
        max_depth: int = 8,
        max_width: int = 8,
        shape: TreeShape | None = None,
        n_threads: int | None = None,
    ) -> None:
        owns = not isinstance(model, Model)
        self.n_threads = n_threads
        self.model = model if isinstance(model, Model) else Model(model, n_gpu_layers=n_gpu_layers)
        self._family = _Family(self.model, owns)
        self.max_depth = max_depth
        self.max_width = max_width
        self.fixed_shape = shape
        self._init_request_state()

    def _init_request_state(self) -> None:
        """The state of one request's drafter (a ``spawn`` starts from it): calibration,
        statistics, history, sampling, and no draft context yet."""
        self.calib = DraftCalibration()
        self.stats = ModelDraftStats(max_depth=self.max_depth, max_width=self.max_width)
        self.history: list[int] = []
        self.sampler: DraftChildSelector | None = None
        self.ctx: Context | None = None
        self.hub: DraftHub | None = None
        self.seq0 = 0  # the sequence holding the history the draft has seen
        self.slots: SeqSlots | None = None
        self._limits = (0, 0)
        self._ran = False
        self._slot_of: dict[int, int] = {}

    def spawn(self) -> "ModelDrafter":
        """A drafter for another request with the same options, sharing the loaded model
        (closed with the last of them), what the policy learns of it (``stats``: its cost,
        its gain, the gap to its next probe, so that a server's slots learn once whether the
        model pays, as one engine does over its requests) and, once attached with the same
        ``TargetHandle``, the draft context (each tree level of both is one decode)."""
        new = copy.copy(self)
        new._init_request_state()
        new.stats = self.stats
        self._family.n_users += 1
        return new

    @property
    def n_slots(self) -> int:
        """Scratch sequences one tree may use (nodes decoded below the root)."""
        return (self.max_depth - 1) * self.max_width

    hub: "DraftHub | None" = None
    seq0 = 0
    slots: SeqSlots | None = None

    level_entries = 8
    """Most entries one request puts in a level decode (sizes the shared context's batch)."""

    n_threads: int | None = None
    """Threads of the draft context (None: the target's). A class default too, for drafters
    whose ``__init__`` does not run this one's (``MtpDrafter``)."""

    d2t = None
    """[n_draft] int64 target id of each draft id when ``decode_level`` returns draft-vocabulary
    rows (EAGLE-3 heads with a reduced vocabulary), else None (rows in target ids)."""

    def set_sampling(self, sampler) -> None:
        """Draft for this request's sampling (a ``RequestState``; None = greedy)."""
        params = sampler.params if sampler is not None else SamplingParams.greedy(seed=0)
        self.sampler = DraftChildSelector(params, self.n_vocab, self.suppress_ids, d2t=self.d2t)

    def begin(self, history: Sequence[int], context: Sequence[Sequence[int]] = ()) -> None:
        self.history = [int(t) for t in history]
        self.calib.reset_request()

    def accept(self, tokens: Sequence[int]) -> None:
        self.history.extend(int(t) for t in tokens)

    def ready(self) -> bool:
        return self.ctx is not None

    @property
    def model_stats(self) -> ModelDraftStats | None:
        """What the policy plans with; None when the model cannot draft this step."""
        return self.stats if self.ready() else None

    @property
    def draft_group(self) -> "DraftHub | None":
        """The shared draft context whose requests draft together (``DraftHub.extend_many``),
        or None (this drafter decodes its levels alone: ``decode_level``)."""
        return self.hub if self.shares_context else None

    def propose(self, max_depth: int, max_nodes: int) -> TokenTree:
        """The cheap phase: no drafts (the root alone) and no model call; ``extend`` drafts."""
        self._limits = (max_depth, max_nodes)
        self._ran = False
        return TokenTree.root_only(self.history[-1])

    def extend(self, shape: TreeShape) -> TokenTree:
        """Draft this step's tree with ``shape`` (clipped to the limits given to ``propose``
        and to the drafter's own); a root-only tree when the model cannot draft now. With a
        shared draft context: ``DraftHub.extend_many`` of this request alone.

        Requires: ``propose`` was called for this step.
        """
        if self.draft_group is not None:
            return self.hub.extend_many([self], [shape])[0]
        root = self.history[-1]
        shape = self._step_shape(shape, self.max_depth, self.max_width)
        if shape is None:
            return TokenTree.root_only(root)
        timed = _TimedLevels(self)
        t0 = time.perf_counter()
        try:
            tree = expand_tree(root, len(self.history) - 1, shape, timed, self.sampler, self.calib, self.source)
        finally:
            self.slots.release()
            self._slot_of = {}
            self.check_cache()
        t_us = (time.perf_counter() - t0) * 1e6
        self.stats.observe_draft(t_us, tree.n_nodes, timed.t_us)
        return tree

    def decode_level(self, tree, nodes):
        """Decode ``nodes`` of the tree under construction; their draft logits rows
        (``tree_expand.LevelDecoder``). With a shared draft context: one decode of this
        request's level alone (``DraftHub.decode_levels``)."""
        return self.hub.decode_levels([(self, self.level_part(tree, nodes))])[0]

    def release_tree(self) -> None:
        """Drop what the tree being drafted holds (scratch sequences; tests that decode levels
        by hand call it where ``extend`` would)."""
        if self.slots is not None:
            self.slots.release()
        self._slot_of = {}

    def _step_shape(self, shape: TreeShape, depth_limit: int, width_limit: int) -> TreeShape | None:
        """This step's ``shape`` clipped to the limits given to ``propose`` and to the
        drafter's own (``depth_limit``, ``width_limit``), or None when it drafts nothing now
        (no room, or not ``ready``). Marks the step as run (``observe`` learns from it)."""
        max_depth, max_nodes = self._limits
        self._ran = True
        if max_depth <= 0 or max_nodes <= 1 or not self.ready():
            return None
        if self.sampler is None:
            self.set_sampling(None)
        hub = getattr(self, "hub", None)
        if hub is not None:  # a shared context's range may hold fewer scratch sequences
            width = max(1, min(shape.width, width_limit))
            depth_limit = min(depth_limit, 1 + (hub.seqs_each - 1) // width)
        return shape.clipped(max_depth=min(max_depth, depth_limit), max_width=width_limit, max_nodes=max_nodes)

    def fork(self, parent: int, node: int) -> int:
        """A scratch sequence for ``node``: its parent's sequence (``seq0`` for the root) copied."""
        seq = self.slots.fork(self._slot_of.get(parent, self.seq0))
        self._slot_of[node] = seq
        return seq

    def bind(self, target: TargetHandle, *, n_ctx: int, ctx_other=None, mtp: bool = False) -> None:
        """Attach to ``target``: join (or make) the draft context, with ``n_ctx`` cells and a
        scratch sequence per decoded tree node for this request (``ctx_other``: a context
        whose tensors the draft borrows; ``mtp``: a context of llama.cpp's MTP type, which
        runs the model's NextN block). A drafter and its ``spawn`` attached with the same
        handle share one context for ``target.n_requests`` requests (``DraftHub``; with more
        than 256 / (scratch + 1) requests each gets fewer scratch sequences, and its trees
        are cut to fit)."""
        self._leave_hub()
        self.n_vocab = target.model.n_vocab
        self.suppress_ids = target.model.suppress_tokens
        n_req = max(1, int(getattr(target, "n_requests", 1))) if self.shares_context else 1
        key = (id(target.model), id(ctx_other), int(n_ctx), bool(mtp), n_req)
        fam = self._family if self.shares_context else _Family(None, False)
        hub = fam.hub
        if hub is None or hub.key != key or hub.full:
            hub = fam.hub = DraftHub(
                self.model,
                n_requests=n_req,
                n_ctx=n_ctx,
                seqs_each=min(256 // n_req, self.n_slots + 1),
                n_batch=max(512, n_req * self.level_entries),
                key=key,
                n_threads=self.n_threads or target.n_threads,
                ctx_other=ctx_other,
                mtp=mtp,
                # a draft model's lm_head costs what the target's does (backend.readout); a head
                # graph (ctx_other) or an MTP block reads another context's tensors: not checked
                readout=_readout.wanted() and ctx_other is None and not mtp,
            )
        self.hub = hub
        self.seq0 = hub.join()
        self.ctx = hub.ctx
        self.slots = SeqSlots(self.ctx, first=self.seq0 + 1, capacity=hub.seqs_each - 1)
        self.sampler = None

    def _leave_hub(self) -> None:
        if self.hub is not None:
            self.hub.leave(self.seq0)
        self.hub = None
        self.ctx = None
        self.slots = None

    def observe(self, tree: TokenTree, emitted: Sequence[int], *, baseline: int | None = None) -> None:
        """Learn from a step: ``tree`` as drafted, the ``emitted`` tokens, and (``AutoDrafter``)
        ``baseline``, the tokens the cheap drafts verified with it got accepted."""
        if not getattr(self, "_ran", False):  # the plan did not run the model this step
            self.stats.skipped()
            return
        self._ran = False
        if tree.n_nodes > 1:
            n = accepted_length(tree, emitted)
            self.stats.observe_accept(n, None if baseline is None else max(0, n - baseline), depth=int(tree.depth.max()),
                                      n_emitted=len(emitted))  # fmt: skip
        self.calib.observe(tree, emitted)

    # -- provided by subclasses ---------------------------------------------------------------

    def level_part(self, tree, nodes) -> LevelPart:
        """This request's entries for a level decode of ``nodes`` of ``tree`` (``nodes ==
        [0]``: the root, with whatever the draft has not seen yet), for ``decode_parts``."""
        raise NotImplementedError(f"{type(self).__name__} decodes its levels alone (decode_level)")

    def new_level_batch(self):
        """A batch for ``decode_parts`` on the draft context (its ``n_batch`` entries)."""
        raise NotImplementedError

    def decode_parts(self, batch, parts: Sequence[LevelPart]) -> None:
        """Put every part's entries into ``batch`` and decode it once on the draft context."""
        raise NotImplementedError

    @abc.abstractmethod
    def check_cache(self) -> None:
        """Check the draft KV cache against the history (raises on a mismatch)."""

    def close(self) -> None:
        """Leave the draft context (freed with its last request), and free the model when the
        drafter (or the one it was spawned from) loaded it and no sibling uses it (idempotent)."""
        self._leave_hub()
        fam, self._family = getattr(self, "_family", None), None
        if fam is not None:
            fam.release()


class StateFedLevels:
    """The level decodes of drafters whose entries read a hidden-state row (EAGLE-3 heads, MTP
    blocks, llama.cpp's extended batch: ``ExtBatch``): a frontier node's entry is its token and
    its parent's output state (``llama_get_embeddings_nextn_ith``), and every entry of a level
    is an output. Mixed into a ``ModelDrafter`` that keeps ``_state`` (node -> its output
    state) and defines ``_level_rows`` (draft logits rows from the decode's) and
    ``state_pos_offset`` (a node at depth ``d`` is an entry at ``root_pos + d + offset``)."""

    level_entries = 16  # the root's level: a catch-up's last entries (``CATCH_UP_OUTPUTS``), every row out
    state_pos_offset = 0

    def new_level_batch(self):
        from ..backend.batch_ext import ExtBatch

        return ExtBatch(self.ctx.handle)

    def decode_parts(self, batch, parts: Sequence[LevelPart]) -> None:
        batch.clear()
        for p in parts:
            for e in p.entries:
                batch.add(**e)
        self.ctx.process(batch)

    def _frontier_part(self, tree, nodes: list[int]) -> LevelPart:
        """Each frontier node's entry in its own scratch sequence (forked from its parent's)."""
        root_pos = len(self.history) - 1 + self.state_pos_offset
        entries = [dict(token=tree.tokens[n], pos=root_pos + tree.depth[n], seq_id=self.fork(tree.parents[n], n),
                        output=True, embd=self._state[tree.parents[n]]) for n in nodes]  # fmt: skip

        def finish(logits, out0):
            for i, n in enumerate(nodes):
                self._state[n] = self._out_state(out0 + i)
            return self._level_rows(logits)

        return LevelPart(entries, len(nodes), finish)

    def _out_state(self, i: int) -> np.ndarray:
        """The output state of output row ``i`` of the last decode ([n_embd] float32, a copy)."""
        from ..backend._llama import ext

        ptr = ext.llama_get_embeddings_nextn_ith(self.ctx.handle, i)
        if not ptr:
            raise RuntimeError(f"the {self.name} drafter's context returned no output state for output {i}")
        return np.ctypeslib.as_array(ptr, shape=(self.n_embd,)).copy()
