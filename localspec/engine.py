"""The engine: one target model, one context, one request at a time on the speculative step.

    prefill the prompt (reusing the previous request's common prefix)
    while not done:  step([this request])   # propose -> verify -> commit -> emit (localspec.step)

The step is ``localspec.step.Step``, the same one the batch scheduler runs over many requests.
The engine keeps the committed token sequence in its context between requests, so a request
that shares a prefix with the previous one (chat turns, editor keystrokes) only prefills the
new part.
"""

from __future__ import annotations

import numbers
import os
import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace

from .backend import Context, Model, SequenceCache
from .backend.model import refuse_head_file
from .backend.kv import common_prefix
from .costmodel import CostModel, calibrate
from .backend.features import FeatureTap, FinalNormTap
from .drafters import Drafter, DraftMemory, TargetHandle, resolve_drafter
from .errors import ContextOverflowError, DecodeError, InvalidRequestError, LocalSpecError, ModelLoadError
from .generation import Generation, check_max_tokens, check_stop, now_us
from .policy import SpeculationPolicy, TreeShape
from .request_state import RequestState
from .results import GenerationResult, StreamChunk, TokenLogprob
from .sampling import SamplingParams
from .step import Entry, Step, feature_layers, reads_final_norm, tapped_context

__all__ = ["Engine", "GenerationResult", "GenerationStream", "StreamChunk", "TokenLogprob"]

MIN_N_CTX = 16
"""Smallest context an engine accepts (tokens)."""
DEFAULT_N_CTX = 8192


def check_engine_sizes(*, n_ctx: int | None, n_threads: int | None, max_tree_nodes: int, n_gpu_layers: int) -> None:
    """The sizes ``Engine`` takes, checked without loading anything (the CLI checks its flags
    with it before a model loads).

    Raises:
        InvalidRequestError: one that is not a whole number in its range (n_ctx at least
            ``MIN_N_CTX``, n_threads 1, max_tree_nodes 1..255, n_gpu_layers -1; None: the default).
    """
    for name, v, lo in (("n_ctx", n_ctx, MIN_N_CTX), ("n_threads", n_threads, 1), ("max_tree_nodes", max_tree_nodes, 1),
                        ("n_gpu_layers", n_gpu_layers, -1)):  # fmt: skip
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < lo):
            raise InvalidRequestError(f"{name} must be a whole number of at least {lo}, got {v!r}")
    if not 1 <= max_tree_nodes <= 255:
        raise InvalidRequestError("max_tree_nodes must be in [1, 255]")


class GenerationStream:
    """Iterator of ``StreamChunk`` for one request; ``result`` is set when it ends.

    ``cancel()`` may be called from another thread: the generation stops after the current
    step (a running prefill is aborted) with ``finish_reason == "cancelled"``, and the engine
    stays consistent. ``close()`` (or leaving a ``with`` block) also ends it, and so does
    dropping the last reference to it (``break`` out of ``for chunk in engine.stream(...)``):
    the engine is free for the next request at once, in any thread.

    From its first chunk to its end a stream holds its engine: a request in another thread
    waits for it; a request in the same thread (whose stream would run on the KV cache this
    one is using) raises ``InvalidRequestError``.
    """

    def __init__(self, engine: "Engine", gen: Iterator[StreamChunk]) -> None:
        self._engine = engine
        self._gen = gen
        self.result: GenerationResult | None = None
        self.cancelled = threading.Event()

    def __iter__(self) -> "GenerationStream":
        return self

    def __next__(self) -> StreamChunk:
        return next(self._gen)

    def cancel(self) -> None:
        """Stop this generation (thread-safe); a no-op once it has ended."""
        self.cancelled.set()
        if self._engine._active_stream() is self:
            self._engine.ctx.request_abort()

    def close(self) -> None:
        self._gen.close()

    def __enter__(self) -> "GenerationStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _EngineLock:
    """The engine's lock, which the thread finishing a stream may release although another
    thread started it, and which its holder's thread may not take again.

    A ``GenerationStream`` holds the engine's lock from its first chunk to its end, and its
    consumer may move between threads (a worker thread takes the first token, another reads
    the rest): ``threading.RLock`` then refuses the release (``RuntimeError: cannot release
    un-acquired lock``, replacing the stream's own result or error) unless the second thread
    happens to reuse the first one's ident. The holder's thread asking again is a request
    made while one of its streams is suspended between chunks: run, it would decode on the KV
    cache the suspended stream goes on with (both outputs silently wrong), and waiting would
    never end, so it raises.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None

    def acquire(self) -> bool:
        """Raises:
        InvalidRequestError: this thread holds the lock (a stream of it is still open)."""
        self.refuse_if_held_here()
        self._lock.acquire()
        self._owner = threading.get_ident()
        return True

    def refuse_if_held_here(self) -> None:
        """Raises:
        InvalidRequestError: this thread holds the lock (a stream of it is still open)."""
        if self.held_here():
            raise InvalidRequestError(
                "a stream on this engine is still open in this thread: read it to its end or close() it "
                "first (engine.generate_batch runs several prompts at once)"
            )

    def held_here(self) -> bool:
        """Whether this thread holds the lock."""
        return self._owner == threading.get_ident()

    def release(self) -> None:
        if self._owner is None:
            raise RuntimeError("_EngineLock released more often than acquired")
        self._owner = None
        self._lock.release()

    def __enter__(self) -> "_EngineLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class Engine:
    """A target model with an optional drafter, ready to generate.

    Args:
        model: a ``Model``, a GGUF path, or None for the embedded default model.
        drafter: a drafter name (``"none"``, ``"ngram"``, ``"draft"``, ``"eagle3"``,
            ``"auto"``, ``"mtp"``: the target's own MTP / NextN block), a ``Drafter`` object, or None.
        draft_model: the GGUF of a draft model sharing the target's tokenizer (drafters
            ``"draft"`` and ``"auto"``).
        draft_n_ctx: the draft model's context (default: the target's); a smaller one sees
            only the recent history.
        eagle: the GGUF of an EAGLE-3 head for the target (drafters ``"eagle3"`` and ``"auto"``);
            with no path (and, for ``"auto"``, no draft model), the head shipped for the target
            (default model), if any.
        medusa: the GGUF of Medusa heads for the target (drafters ``"medusa"`` and ``"auto"``);
            for ``"medusa"`` with no path, the heads shipped for the target (default model), if any.
        draft_shape: a fixed ``TreeShape`` for every step of the ``"eagle3"`` or ``"medusa"`` drafter (e.g.
            ``TreeShape(6, 1, 7)``: chains of 6); default: the policy chooses.
        n_ctx: context size in tokens (default: 8192, at most the model's training context).
        n_threads: CPU threads (default: all CPUs this process may use, at most 16).
        n_gpu_layers: layers offloaded to the GPU on CUDA / Metal builds (-1 = all); with
            ``rpc``, layers on the workers (0 = all).
        rpc: llama.cpp RPC workers (``["HOST:PORT", ...]`` or ``"H1:P1,H2:P2"``) holding the
            target's layers; drafters stay on this machine (docs/rpc.md).
        rpc_local_gpu: with ``rpc``, split the layers over this machine's GPUs too.
        tensor_split: with ``rpc``, the share of the layers per device (workers, then GPUs).
        max_tree_nodes: largest verified tree (root included), at most 255.
        cost_model: a ``CostModel``; by default measured (and cached) at start-up.
        adaptive: False verifies every proposed tree up to ``max_tree_nodes`` without asking
            the policy (for tests and experiments).
        accept_threshold_single / accept_threshold_acc: **LOSSY** below 1.0 (the default, lossless):
            SGLang's acceptance thresholds (``verify.verify_thresholds``), in (0, 1], for requests
            whose ``SamplingParams`` leave them None. They apply at temperature > 0 only; the
            results then say ``stats.lossy``.
        draft_memory: a ``drafters.DraftMemory`` the engine's drafters (and its batches) draft
            from and write finished requests to (docs/drafters.md#drafting-memory); None = none.

    Raises:
        ModelLoadError: the model (or draft model / EAGLE-3 head) cannot be loaded.
        VocabMismatchError: the draft model's vocabulary is not the target's.
        InvalidRequestError: bad parameters (e.g. a drafter option the drafter does not take).
    """

    def __init__(
        self,
        model: Model | str | os.PathLike | None = None,
        *,
        drafter: str | Drafter | None = "ngram",
        draft_model: Model | str | os.PathLike | None = None,
        draft_n_ctx: int | None = None,
        eagle: str | os.PathLike | None = None,
        medusa: str | os.PathLike | None = None,
        draft_shape: TreeShape | None = None,
        n_ctx: int | None = None,
        n_threads: int | None = None,
        n_gpu_layers: int = 0,
        max_tree_nodes: int = 64,
        cost_model: CostModel | None = None,
        adaptive: bool = True,
        flash_attn: bool | None = None,
        rpc: str | list[str] | None = None,
        rpc_local_gpu: bool = False,
        tensor_split: list[float] | None = None,
        accept_threshold_single: float = 1.0,
        accept_threshold_acc: float = 1.0,
        draft_memory: "DraftMemory | None" = None,
    ) -> None:
        # validated like a request's (InvalidRequestError: 0 < t <= 1)
        SamplingParams(accept_threshold_single=accept_threshold_single, accept_threshold_acc=accept_threshold_acc)
        self.accept_threshold_single = float(accept_threshold_single)
        self.accept_threshold_acc = float(accept_threshold_acc)
        check_engine_sizes(n_ctx=n_ctx, n_threads=n_threads, max_tree_nodes=max_tree_nodes, n_gpu_layers=n_gpu_layers)
        if not (model is None or isinstance(model, (str, os.PathLike, Model))):
            raise InvalidRequestError(f"model must be a GGUF path, a Model or None, got {model!r}")
        if cost_model is not None and not isinstance(cost_model, CostModel):
            raise InvalidRequestError(f"cost_model must be a CostModel or None, got {cost_model!r}")
        if draft_memory is not None and not isinstance(draft_memory, DraftMemory):
            raise InvalidRequestError(f"draft_memory must be a DraftMemory or None, got {draft_memory!r}")
        if model is None:
            from .models import default_model_path

            model = default_model_path()
        self._owns_model = not isinstance(model, Model)
        if isinstance(model, Model):
            if rpc:
                raise InvalidRequestError("rpc= applies when the engine loads the model (give a path, not a Model)")
            self.model = model
        else:
            refuse_head_file(model, "a model to generate with")
            rpc_args = dict(rpc=rpc, rpc_local_gpu=rpc_local_gpu, tensor_split=tensor_split) if rpc else {}
            self.model = Model(model, n_gpu_layers=n_gpu_layers, **rpc_args)
        if n_ctx is None:
            n_ctx = min(DEFAULT_N_CTX, self.model.n_ctx_train or DEFAULT_N_CTX)
        # llama.cpp needs n_seq_max <= n_ctx (one sequence per tree leaf): a small context
        # gets smaller trees instead of an abort inside llama.cpp
        max_tree_nodes = min(max_tree_nodes, n_ctx // 2 - 1)
        self.max_tree_nodes = max_tree_nodes
        self._ctx_args = dict(n_ctx=n_ctx, n_batch=512, n_seq_max=max_tree_nodes + 1, n_threads=n_threads, flash_attn=flash_attn)
        self.drafter: Drafter | None = None
        self._tap: FeatureTap | None = None
        self._norm_tap: FinalNormTap | None = None
        self._lock = _EngineLock()  # held by a stream from its first chunk to its end
        self._active_stream = _no_stream  # weakref.ref to that stream: its last owner may drop it
        self.adaptive = adaptive
        self.draft_memory = draft_memory  # shared by this engine's drafters (and its batches)
        self.usage_log = None  # a usage.UsageLog that finished requests are added to (--record-usage)
        new = self._new_drafter(
            drafter, draft_model=draft_model, draft_n_ctx=draft_n_ctx, eagle=eagle, medusa=medusa, draft_shape=draft_shape
        )
        try:
            self._make_context(feature_layers(new), reads_final_norm(new))
            self.cost_model = cost_model or calibrate(self.ctx, max_size=max_tree_nodes)
            if self._tap is not None:
                self._tap.clear()
            if self._norm_tap is not None:
                self._norm_tap.clear()
            self.policy = SpeculationPolicy(self.cost_model, max_nodes=max_tree_nodes)
            self._install_drafter(new)
        except BaseException:
            if new is not None and self.drafter is not new:
                new.close()  # idempotent: _install_drafter may have closed it already
            self.close()
            raise

    # -- configuration ------------------------------------------------------------------------

    def set_drafter(self, drafter: str | Drafter | None, **options) -> None:
        """Switch drafter (by name with its options, e.g. ``draft_model=PATH``, or an object).

        The conversation in the KV cache is kept, unless the new drafter reads target
        features the current context does not capture (or the reverse): then the target
        context is recreated with (without) the feature tap.

        Raises:
            InvalidRequestError / VocabMismatchError / ModelLoadError: the new drafter cannot be
                used; the engine keeps its current drafter.
            LocalSpecError: the engine is closed.
        """
        self._require_open()
        with self._lock:
            new = self._new_drafter(drafter, **options)
            old = self.drafter
            if feature_layers(new) != (self._tap.layers if self._tap else None) or reads_final_norm(new) != (
                self._norm_tap is not None
            ):
                self.drafter = None
                if old is not None and old is not new:
                    old.close()
                old = None
                self._make_context(feature_layers(new), reads_final_norm(new))
            self._install_drafter(new)
            if old is not None and old is not new:
                old.close()

    def _new_drafter(self, drafter: str | Drafter | None, **options) -> Drafter | None:
        """A drafter by name (``resolve_drafter``, remembered in ``drafter_spec`` so that
        batches make the same drafter per request) or the object itself."""
        if isinstance(drafter, (str, type(None))):
            new = resolve_drafter(drafter, self.model, memory=self.draft_memory, **options)
            self._next_spec = (drafter, {k: v for k, v in options.items() if v is not None})
            return new
        missing = [m for m in ("begin", "propose", "accept", "observe", "close") if not callable(getattr(drafter, m, None))]
        if missing:
            raise InvalidRequestError(f"drafter must be a drafter name, a Drafter or None, got {type(drafter).__name__} "
                                      f"(without {', '.join(missing)})")  # fmt: skip
        if any(v is not None for v in options.values()):
            raise InvalidRequestError(
                f"options {', '.join(sorted(k for k, v in options.items() if v is not None))} apply to drafter names, "
                "not to a drafter object"
            )
        check = getattr(drafter, "check_target", None)
        if check is not None:
            check(self.model)
        self._next_spec = None
        return drafter

    def _make_context(self, feature_layers: tuple[int, ...] | None, final_norm: bool = False) -> None:
        """(Re)create the target context, with a ``FeatureTap`` when ``feature_layers`` is set,
        or a ``FinalNormTap`` when ``final_norm`` (one ``cb_eval`` per context)."""
        old = getattr(self, "ctx", None)
        if old is not None:
            old.close()
        self.ctx, self._tap, self._norm_tap = tapped_context(self.model, feature_layers, final_norm, **self._ctx_args)
        self._ctx_generation = self.model.generation
        self.cache = SequenceCache(self.ctx, max_tree_nodes=self.max_tree_nodes)

    def _install_drafter(self, drafter: Drafter | None) -> None:
        """Attach ``drafter`` to the target and make it current (on failure, close it)."""
        attach = getattr(drafter, "attach", None)
        if attach is not None:
            try:
                attach(
                    TargetHandle(
                        self.model,
                        n_ctx=self.ctx.n_ctx,
                        n_threads=self.ctx.n_threads,
                        tensor_source=self.ctx,
                        features=self._tap,
                    )
                )
            except BaseException:
                drafter.close()
                raise
        self.drafter = drafter
        self.drafter_spec = getattr(self, "_next_spec", None)
        self.cost_model.reset_draft()  # the draft levels measured were the old drafter's

    @property
    def drafter_name(self) -> str:
        return self.drafter.name if self.drafter is not None else "none"

    @property
    def n_ctx(self) -> int:
        return self.ctx.n_ctx

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        self.reconnect_if_lost()
        return self.model.tokenize(text, add_special=add_special, parse_special=parse_special)

    def close(self) -> None:
        """Free the drafter, the context and (when the engine loaded it) the model. Later
        requests raise ``LocalSpecError`` ("the engine is closed"). A stream still open is
        cancelled first (its result: ``finish_reason == "cancelled"``): this thread's is closed
        at once; one in another thread is waited for, as any request waits for it, and ends at
        its next step (freeing the context under its decode crashed the process)."""
        if not hasattr(self, "_lock"):  # __init__ failed before it
            self._closed = True
            return
        open_stream = self._active_stream()
        if open_stream is not None:
            open_stream.cancel()
            if self._lock.held_here():
                open_stream.close()
        with self._lock:
            self._closed = True
            if self.drafter is not None:
                self.drafter.close()
                self.drafter = None
            if getattr(self, "ctx", None) is not None:
                self.ctx.close()
            if self._owns_model:
                self.model.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def reconnect_if_lost(self) -> None:
        """After a lost RPC worker (``WorkerLostError``): load the target on its workers again,
        with a new context (the KV cache is gone) and the same drafter re-attached. Every request
        calls this first, so an engine (and a server on it) works again once the worker is back.
        A no-op when the workers are fine or the model is local.

        Raises:
            LocalSpecError: the engine is closed.
            RPCError: a worker is still unreachable (the next request tries again).
        """
        self._require_open()

        def needed() -> bool:  # the worker lost, or the model reloaded by another user of it
            return self._ctx_generation != self.model.generation or (
                bool(self.model._rpc_guards) and self.model.lost_worker() is not None
            )

        if not needed():
            return
        with self._lock:
            if not needed():
                return
            lost = self.model.lost_worker() is not None
            if lost:
                self.model.probe_workers()  # still down: raises, and the engine stays as it is
            # drafter contexts may borrow the target context's tensors (EAGLE-3 heads): free them
            # before the target's; attach() below creates them again
            for d in (self.drafter, getattr(self.drafter, "model", None)):
                dctx = getattr(d, "ctx", None)
                if isinstance(dctx, Context):
                    dctx.close()
            self.ctx.close()
            if lost:
                self.model.reload_if_lost()  # a no-op when another user of the model did it
            self._make_context(self._tap.layers if self._tap else None, self._norm_tap is not None)
            if self.drafter is not None:
                self._install_drafter(self.drafter)

    def _require_open(self) -> None:
        """Raises ``LocalSpecError`` once ``close()`` has run."""
        if getattr(self, "_closed", False):
            raise LocalSpecError("the engine is closed: make a new Engine")

    def reset(self) -> None:
        """Forget the KV cache of earlier requests.

        Raises:
            LocalSpecError: the engine is closed.
        """
        self._require_open()
        with self._lock:
            self.cache.reset()

    # -- generation ---------------------------------------------------------------------------

    def generate(self, prompt: str | Sequence[int], **kwargs) -> GenerationResult:
        """Generate a completion of ``prompt``; keyword arguments as ``stream``."""
        s = self.stream(prompt, **kwargs)
        for _ in s:
            pass
        assert s.result is not None
        return s.result

    def prompt_tokens(self, prompt: str | Sequence[int], *, add_special: bool = True,
                      parse_special: bool = False) -> list[int]:  # fmt: skip
        """The token ids a request for ``prompt`` decodes: text tokenised (``stream``'s
        ``add_special`` / ``parse_special``), or token ids checked.

        Raises:
            TypeError: ``prompt`` is neither text nor a sequence of integer token ids.
            InvalidRequestError: a token id outside the vocabulary, or text with a lone surrogate.
        """
        if isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                raise InvalidRequestError(f"the text holds a lone UTF-16 surrogate at character {e.start} (not valid "
                                          "Unicode text)") from None  # fmt: skip
            tokens = self.model.tokenize(prompt, add_special=add_special, parse_special=parse_special)
            bos = self.model.bos
            if parse_special and add_special and self.model.add_bos and tokens[:2] == [bos, bos]:
                # the text already starts with the BOS token: do not add a second one (as the
                # chat app does; llama.cpp only warns)
                tokens = tokens[1:]
            return tokens
        if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Iterable):
            raise TypeError(f"prompt must be text (str) or token ids (a sequence of int), got {type(prompt).__name__}")
        tokens = list(prompt)
        odd = [t for t in tokens if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
        if odd:
            raise TypeError(f"prompt must be text (str) or token ids (a sequence of int), got an item {odd[0]!r}")
        tokens = [int(t) for t in tokens]
        bad = [t for t in tokens if not 0 <= t < self.model.n_vocab]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary (0..{self.model.n_vocab - 1})")
        return tokens

    def stream(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = 256,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] = (),
        speculative: bool = True,
        parse_special: bool = False,
        add_special: bool = True,
        max_time_ms: float | None = None,
        draft_context: Sequence[str | Sequence[int]] = (),
        draft_limits=None,
    ) -> GenerationStream:
        """Start a generation; iterate the returned stream for ``StreamChunk``s.

        Args:
            prompt: text (tokenised with BOS where the model wants it) or token ids.
            max_tokens: most tokens to generate (never exceeded).
            sampling: ``SamplingParams`` (default: llama.cpp's defaults, random seed).
            stop: a stop string or a sequence of them; the text is cut before the first one
                completed.
            speculative: False decodes without the drafter for this request.
            parse_special: tokenise special-token text (e.g. chat markup) as special tokens.
            add_special: add BOS (and EOS) as the model asks when tokenising text; with
                ``parse_special`` a text that already starts with the BOS token gets no second.
            max_time_ms: stop generating (``finish_reason == "time"``) once this much time
                has passed since the first generated token; prefill is not limited.
            draft_context: extra texts or token sequences the drafter may draft from (an
                editor's suffix and other files): the n-gram drafter indexes them too.
            draft_limits: per-request caps on the drafts (``DraftLimits``: most draft nodes per
                step, least node score), or None.
        Raises:
            InvalidRequestError: bad parameters, an empty prompt, or a stream of this engine
                still open in this thread.
            ContextOverflowError: the prompt does not leave room for one generated token.
            TypeError: ``prompt`` is neither text nor a sequence of token ids.
        """
        self._lock.refuse_if_held_here()  # here, not at the first chunk: the stream would be dead
        max_tokens = check_max_tokens(max_tokens)
        stop = check_stop(stop)
        self.reconnect_if_lost()
        sampling = self.with_thresholds(sampling or SamplingParams())
        t_start = now_us()
        tokens = self.prompt_tokens(prompt, add_special=add_special, parse_special=parse_special)
        if not tokens:
            raise InvalidRequestError("the prompt is empty (and the model adds no BOS token)")
        if len(tokens) >= self.ctx.n_ctx:
            raise ContextOverflowError.prompt(len(tokens), self.ctx.n_ctx, max_tokens=max_tokens,
                                              settings="Engine(n_ctx=), --n-ctx")  # fmt: skip
        if max_time_ms is not None and (isinstance(max_time_ms, bool) or not isinstance(max_time_ms, numbers.Real)
                                        or not max_time_ms > 0):  # NaN too  # fmt: skip
            raise InvalidRequestError(f"max_time_ms must be a number of milliseconds > 0 or None, got {max_time_ms!r}")
        extra = [self.prompt_tokens(c, add_special=False) for c in draft_context]
        state = RequestState(sampling, self.model, tokens)
        drafter = self.drafter if speculative else None
        stream = GenerationStream(self, iter(()))
        gen = Generation(tokens, state, drafter,
                         calibration=self.policy.calibration.for_request() if drafter is not None else None,
                         max_tokens=max_tokens, stop=stop, token_bytes=self.model.token_bytes,
                         is_eog=self.model.is_eog, max_time_ms=max_time_ms, t_start_us=t_start,
                         draft_limits=draft_limits, cancelled=stream.cancelled)  # fmt: skip
        stream._gen = self._run(weakref.ref(stream), gen, extra)  # weak: no cycle keeps a dropped stream alive
        return stream

    def with_thresholds(self, sampling: SamplingParams) -> SamplingParams:
        """``sampling`` with the engine's acceptance thresholds where it leaves them None (the
        same object when the engine's are 1.0).

        Raises:
            InvalidRequestError: ``sampling`` is not a ``SamplingParams``.
        """
        if not isinstance(sampling, SamplingParams):
            raise InvalidRequestError(f"sampling must be a SamplingParams (e.g. SamplingParams.greedy()), got {sampling!r}")
        kw = {}
        if sampling.accept_threshold_single is None and self.accept_threshold_single != 1.0:
            kw["accept_threshold_single"] = self.accept_threshold_single
        if sampling.accept_threshold_acc is None and self.accept_threshold_acc != 1.0:
            kw["accept_threshold_acc"] = self.accept_threshold_acc
        return replace(sampling, **kw) if kw else sampling

    def generate_batch(self, prompts, **kwargs) -> list:
        """Generate every prompt, several at a time in one batched decode (``--parallel``).

        Keyword arguments and result: ``localspec.scheduler.generate_batch``. The batch runs
        on its own context over this engine's model; outputs equal ``generate`` one prompt at
        a time at temperature 0 and for a seed above it.
        """
        from .scheduler import generate_batch

        self.reconnect_if_lost()
        return generate_batch(self, prompts, **kwargs)

    def plain_tokens_per_s(self) -> float:
        """Estimated plain-decoding speed on this machine now (from the measured cost model)."""
        return 1e6 / self.cost_model.t_decode_us(1)

    def _prefill(self, gen: Generation, draft_context: list[list[int]]) -> None:
        """Put the prompt but its last token in the KV cache, reusing the previous request's
        common prefix, and start the drafter on it."""
        prompt, drafter, cache = gen.prompt, gen.drafter, self.cache
        common = common_prefix(cache.tokens, prompt[:-1])
        features = self._tap if feature_layers(drafter) else None
        if drafter is not None:
            if hasattr(drafter, "set_sampling"):
                drafter.set_sampling(gen.state)
            if draft_context:
                drafter.begin(prompt, context=draft_context)
            else:
                drafter.begin(prompt)
            if features is not None:  # re-prefill what the drafter has no target features for
                common = min(common, drafter.n_target_features)
        gen.stats.n_cached_tokens = common
        cache.truncate(common)
        if gen.cancelled.is_set():
            raise _Cancelled
        self._step().clear_taps()

        def on_chunk(n_done: int, _n_total: int) -> None:
            rows = self._tap.take()
            if features is not None:
                drafter.add_target_features(common + n_done - rows.shape[0], rows)

        try:
            cache.prefill(prompt[common:-1], on_chunk=on_chunk if self._tap is not None else None)
        except DecodeError:
            if gen.cancelled.is_set():
                raise _Cancelled from None
            raise
        if self._norm_tap is not None:
            self._norm_tap.clear()  # the prefill asks for no logits: no rows
        gen.stats.t_prefill_us = now_us() - gen.t_start_us

    def _run(self, stream: "weakref.ref[GenerationStream]", gen: Generation,
             draft_context: list[list[int]]) -> Iterator[StreamChunk]:  # fmt: skip
        """prefill -> (one step over this request)* -> finish; the KV keeps the prompt and the
        kept tokens for the next request. ``stream`` (a weak reference) gets the result."""
        with self._lock:
            self._active_stream = stream
            self.ctx.clear_abort()
            redecoded0 = self.cache.n_redecoded
            entry = Entry(gen, self.cache)
            step = self._step()
            try:
                self._prefill(gen, draft_context)
                while (reason := gen.stop_reason(self.cache.n_free)) is None:
                    try:
                        chunks = step.run([entry])[0]
                    except DecodeError:
                        if gen.cancelled.is_set():
                            raise _Cancelled from None
                        raise
                    if gen.error is not None:
                        raise gen.error
                    yield from chunks
                    if gen.done:
                        break
                else:
                    gen.finish_reason = reason
            except _Cancelled:
                gen.finish_reason = "cancelled"
            except GeneratorExit:  # the consumer closed the stream early
                gen.finish_reason = "cancelled"
                raise
            except BaseException:  # the step failed (the exception goes on to the caller)
                gen.finish_reason = "error"
                raise
            finally:
                self._active_stream = _no_stream
                live = not self.ctx.closed  # else a stream finalized after its context (at exit)
                if live:
                    self.ctx.clear_abort()
                    self._step().clear_taps()
                tail = gen.finish()
                if live:  # KV: keep the prompt and the kept tokens that were decoded
                    self.cache.truncate(min(self.cache.n_past, len(gen.prompt) + len(gen.out_tokens)))
                gen.stats.n_redecoded_tokens = self.cache.n_redecoded - redecoded0
                if gen.calibration is not None:
                    self.policy.calibration.end_request(gen.calibration)
                if (s := stream()) is not None:
                    s.result = gen.result
                if self.usage_log is not None:
                    self.usage_log.add_generation(gen)
            if tail is not None:
                yield tail

    def _step(self) -> Step:
        """The step on the current context (made again when the context is)."""
        if getattr(self, "_step_obj", None) is None or self._step_obj.ctx is not self.ctx:
            self._step_obj = Step(self.ctx, self.policy, max_tree_nodes=self.max_tree_nodes,
                                  capacity=2 * self.max_tree_nodes, n_seq_cols=self.ctx.n_seq_max,
                                  adaptive=self.adaptive, tap=self._tap, norm_tap=self._norm_tap)  # fmt: skip
        self._step_obj.adaptive = self.adaptive  # an attribute tests and benchmarks set
        return self._step_obj


class _Cancelled(Exception):
    pass


def _no_stream() -> None:
    """``Engine._active_stream`` when no stream runs (called like the stream's weak reference)."""
    return None
