"""``ModelDrafter``: the base of the level-by-level model drafters (draft model, EAGLE-3 head,
MTP block): what every drafter that grows its tree one model call per level shares.

The history, the request's ``DraftChildSelector``, the acceptance calibration and statistics, and
the step itself, in two phases so that the engine's policy decides the step once, before
any model call (the drafter never asks the policy itself):

* ``propose(max_depth, max_nodes)``: the cheap drafts of the step. A model drafter has none
  and returns the root alone, without touching its model;
* ``extend(shape)``: only when the policy's plan says so, grow the tree level by level with
  that shape (``tree_expand.expand_tree``, one ``decode_level`` call per level), then drop the
  scratch sequences and check the draft's KV cache whatever happened (``finally``). The time
  of each level is recorded (``stats.last_level_us``) for the engine's cost model.

A step that does not extend makes no model call; the drafter catches up on its next
``extend``.

Subclasses provide ``attach`` (checks, then
``bind`` to create the draft context), ``decode_level`` and ``check_cache``, and may override
``ready`` (can this step draft at all?) and ``close``.
"""

from __future__ import annotations

import abc
import os
import time
from collections.abc import Sequence

from ..backend import Context, Model
from ..backend.slots import SeqSlots
from ..policy import ModelDraftStats, TreeShape, accepted_length
from ..sampling import SamplingParams
from ..tree import TokenSource, TokenTree
from .base import TargetHandle
from .tree_expand import DraftCalibration, DraftChildSelector, expand_tree


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
        self._owns_model = not isinstance(model, Model)
        self.n_threads = n_threads
        self.model = model if isinstance(model, Model) else Model(model, n_gpu_layers=n_gpu_layers)
        self.max_depth = max_depth
        self.max_width = max_width
        self.fixed_shape = shape
        self.calib = DraftCalibration()
        self.stats = ModelDraftStats(max_depth=max_depth, max_width=max_width)
        self.history: list[int] = []
        self.sampler: DraftChildSelector | None = None
        self.ctx: Context | None = None
        self._limits = (0, 0)
        self._ran = False
        self._slot_of: dict[int, int] = {}

    @property
    def n_slots(self) -> int:
        """Scratch sequences one tree may use (nodes decoded below the root)."""
        return (self.max_depth - 1) * self.max_width

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

    def propose(self, max_depth: int, max_nodes: int) -> TokenTree:
        """The cheap phase: no drafts (the root alone) and no model call; ``extend`` drafts."""
        self._limits = (max_depth, max_nodes)
        self._ran = False
        return TokenTree.root_only(self.history[-1])

    def extend(self, shape: TreeShape) -> TokenTree:
        """Draft this step's tree with ``shape`` (clipped to the limits given to ``propose``
        and to the drafter's own); a root-only tree when the model cannot draft now.

        Requires: ``propose`` was called for this step.
        """
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
        return shape.clipped(max_depth=min(max_depth, depth_limit), max_width=width_limit, max_nodes=max_nodes)

    def fork(self, parent: int, node: int) -> int:
        """A scratch sequence for ``node``: its parent's sequence (seq 0 for the root) copied."""
        seq = self.slots.fork(self._slot_of.get(parent, 0))
        self._slot_of[node] = seq
        return seq

    def bind(self, target: TargetHandle, *, n_ctx: int, ctx_other=None, mtp: bool = False) -> None:
        """Attach to ``target``: (re)create the draft context with a scratch sequence per
        decoded tree node (``ctx_other``: a context whose tensors the draft borrows; ``mtp``:
        a context of llama.cpp's MTP type, which runs the model's NextN block)."""
        if self.ctx is not None:
            self.ctx.close()
            self.ctx = None
        self.n_vocab = target.model.n_vocab
        self.suppress_ids = target.model.suppress_tokens
        self.ctx = Context(
            self.model,
            n_ctx=n_ctx,
            n_batch=512,
            n_seq_max=min(256, self.n_slots + 1),
            n_threads=self.n_threads or target.n_threads,
            ctx_other=ctx_other,
            mtp=mtp,
        )
        self.slots = SeqSlots(self.ctx)
        self.sampler = None

    def observe(self, tree: TokenTree, emitted: Sequence[int], *, baseline: int | None = None) -> None:
        """Learn from a step: ``tree`` as drafted, the ``emitted`` tokens, and (``AutoDrafter``)
        ``baseline``, the tokens the cheap drafts verified with it got accepted."""
        if not getattr(self, "_ran", False):  # the plan did not run the model this step
            self.stats.skipped()
            return
        self._ran = False
        if tree.n_nodes > 1:
            n = accepted_length(tree, emitted)
            self.stats.observe_accept(n, None if baseline is None else max(0, n - baseline))
        self.calib.observe(tree, emitted)

    # -- provided by subclasses ---------------------------------------------------------------

    @abc.abstractmethod
    def decode_level(self, tree, nodes):
        """Decode ``nodes`` of the tree under construction; their draft logits rows."""

    @abc.abstractmethod
    def check_cache(self) -> None:
        """Check the draft KV cache against the history (raises on a mismatch)."""

    def close(self) -> None:
        """Free the draft context, and the model when the drafter loaded it (idempotent)."""
        if self.ctx is not None:
            self.ctx.close()
            self.ctx = None
        if self._owns_model:
            self.model.close()
