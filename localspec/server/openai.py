"""The OpenAI-compatible API of ``localspec serve``: ``/v1/chat/completions``,
``/v1/completions``, ``/v1/models``, over a ``BatchScheduler`` (concurrent requests in one
batched decode).

Requests follow the OpenAI API reference (fields: ``model``, ``prompt`` / ``messages``,
``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``,
``stream`` (+ ``stream_options.include_usage``), ``logprobs`` / ``top_logprobs``,
``presence_penalty``, ``frequency_penalty``, ``logit_bias`` (llama.cpp's forms: ``{"token id": bias}`` or text keys), ``response_format`` with ``json_object`` or
``json_schema``, ``n`` = 1), and localspec's **LOSSY** opt-in ``accept_threshold_single`` /
``accept_threshold_acc`` (numbers in (0, 1]; below 1 the reply's ``timings`` say ``"lossy": true``,
see ``localspec.verify.verify_thresholds``), and ``draft_memory`` (a boolean; false keeps the
request's text out of the server's drafting memory: it neither drafts from it nor is written to
it; docs/drafters.md#drafting-memory). A JSON schema becomes a GBNF grammar through llama.cpp's own
converter (``llama_cpp.llama_grammar.json_schema_to_gbnf``). Fields a request leaves out take
the server's command-line sampling defaults, as llama.cpp's server does.

Responses carry ``usage`` and llama.cpp's ``timings`` (``prompt_n``, ``predicted_n``,
``predicted_ms``, ``predicted_per_second``, ``draft_n``, ``draft_n_accepted``, and ``lossy`` with the
thresholds when they were in effect). Streaming sends
server-sent events, the last ``data: [DONE]``. Every error is an OpenAI error object
``{"error": {"message", "type", "param", "code"}}`` with its HTTP status; a client that
disconnects cancels its request and frees its slot at once. A request the server's shutdown
cuts off is an error, never a finished answer (``OpenAIService.cut_off``): 503 ``code:
"server_shutdown"``, or that error object as the stream's last event (in place of the chunk
with ``finish_reason``), which the official ``openai`` client raises as ``APIError``.

Chat prompts: the model's chat template from its GGUF (rendered as ``localspec chat`` does).
A model without one (the default Gemma 3 270M is a base model) gets the chat app's documented
plain transcript (``The following is a conversation ... User: ... Assistant:``, stop strings
``"\\nUser:"`` / ``"\\nAssistant:"``, see docs/chat.md); the reply's leading space is dropped.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import Response

from ..backend.rpc import RPCError
from ..errors import LocalSpecError
from ..sampling import SamplingParams
from ..text import ReleaseTracker, token_offsets
from ..draft_limits import DraftLimits
from .fields import UNAVAILABLE, RequestError, get_speculation, lone_surrogate_at, lone_surrogate_error
from .prompt import PromptTooLongError, tokenize_bounded
from .sampling_fields import get_seed, parse_logit_bias, resolve_logit_bias, seed_param
from .response import HEALTH_STALL_S, dumps, request_log_line, stall_error

log = logging.getLogger("localspec.server")

MAX_LOGPROBS = 20
MAX_STOPS = 4
SHUTDOWN_CODE = "server_shutdown"  # the error code of an answer cut off by the server's shutdown


def oai_error(status: int, message: str, *, type: str | None = None, param: str | None = None, code=None) -> dict:
    """An OpenAI error object."""
    if type is None:  # 503: llama-server's type, as the editor endpoints and the loading gate answer
        type = {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error",
                503: UNAVAILABLE, 500: "server_error"}.get(status, "invalid_request_error")  # fmt: skip
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class OAIError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None, code=None, type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return oai_error(self.status, self.message, type=self.type, param=self.param, code=self.code)


def json_response(obj, status: int = 200) -> Response:
    return Response(dumps(obj).encode("utf-8"), status_code=status, media_type="application/json")


# -- request parsing -------------------------------------------------------------------------


def _num(body: dict, key: str, lo: float, hi: float, *, integer: bool = False):
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise OAIError(f"'{key}' must be {'an integer' if integer else 'a number'}, got {json.dumps(v)}", param=key)
    if not (lo <= v <= hi) or (isinstance(v, float) and not math.isfinite(v)):
        raise OAIError(f"'{key}' must be in [{lo}, {hi}], got {v}", param=key)
    return v


@dataclass
class OAIRequest:
    kind: str  # "chat" or "completion"
    prompt: Any  # completion: str or token list; chat: list of (role, content)
    max_tokens: int | None
    stream: bool
    include_usage: bool
    stop: list[str]
    sampling: SamplingParams
    logprobs: int | None  # None = off, n = top-n alternatives
    echo: bool = False
    cache_prompt: bool = True  # llama.cpp's field: reuse cached KV of a prompt prefix
    speculative: bool | None = None  # False: no drafter for this request
    draft_limits: DraftLimits | None = None  # llama.cpp's speculative.n_max / p_min
    notes: tuple[str, ...] = ()  # request fields that change nothing here
    logit_bias: list[tuple[int | str, float]] | None = None  # sampling_fields.parse_logit_bias; None: the defaults


def _grammar(body: dict) -> str | None:
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise OAIError("'response_format' must be an object with a 'type'", param="response_format")
    kind = rf["type"]
    if kind == "text":
        return None
    from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf

    if kind == "json_object":
        schema = rf.get("schema")
        if schema is None:
            return JSON_GBNF
    elif kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise OAIError("'response_format.json_schema' must be an object with a 'schema' object",
                           param="response_format")  # fmt: skip
        schema = js.get("schema", {})
    else:
        raise OAIError(f"'response_format.type' must be text, json_object or json_schema, not {kind!r}",
                       param="response_format")  # fmt: skip
    try:
        return json_schema_to_gbnf(json.dumps(schema))
    except Exception as e:  # the converter raises plain exceptions on bad schemas
        raise OAIError(f"the JSON schema could not be converted to a grammar: {e}", param="response_format") from None


def parse_oai(kind: str, body: Any, defaults: SamplingParams) -> OAIRequest:
    """Validate an OpenAI request body.

    Raises:
        OAIError: 400 naming the field.
    """
    if not isinstance(body, dict):
        raise OAIError("the request body must be a JSON object")
    bad = lone_surrogate_at(body, "")
    if bad is not None:  # "\ud800" is valid JSON but no Unicode text: it cannot be tokenized
        raise OAIError(lone_surrogate_error(body), param=bad.replace('"', ""))
    if "model" in body and not isinstance(body["model"], str):
        raise OAIError("'model' must be a string", param="model")
    for key in ("n", "best_of"):
        v = _num(body, key, 1, 128, integer=True)
        if v not in (None, 1):
            raise OAIError(f"'{key}' must be 1: localspec answers one choice per request", param=key)
    for key in ("tools", "functions"):  # asked for, a client waits for tool calls that never come
        if body.get(key):
            raise OAIError(f"'{key}' is not supported: localspec generates text, not tool calls", param=key)
    for key in ("tool_choice", "function_call"):
        if body.get(key) not in (None, "none"):
            raise OAIError(f"'{key}' is not supported: localspec generates text, not tool calls", param=key)
    if kind == "chat":
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise OAIError("'messages' must be a non-empty array", param="messages")
        prompt = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise OAIError(f"messages[{i}] must be an object with a 'role'", param=f"messages[{i}]")
            role = {"developer": "system"}.get(m["role"], m["role"])
            if role not in ("system", "user", "assistant"):
                raise OAIError(f"messages[{i}].role must be system, developer, user or assistant, not {m['role']!r}",
                               param=f"messages[{i}].role")  # fmt: skip
            c = m.get("content")
            if isinstance(c, list):  # content parts: text only
                texts = []
                for part in c:
                    if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise OAIError(f"messages[{i}].content: only text parts are supported", param=f"messages[{i}].content")
                    texts.append(part["text"])
                c = "".join(texts)
            if not isinstance(c, str):
                raise OAIError(f"messages[{i}].content must be a string", param=f"messages[{i}].content")
            prompt.append((role, c))
        lp = body.get("logprobs")
        if lp is not None and not isinstance(lp, bool):
            raise OAIError("'logprobs' must be a boolean", param="logprobs")
        top = _num(body, "top_logprobs", 0, MAX_LOGPROBS, integer=True)
        if top is not None and not lp:
            raise OAIError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        logprobs = (top or 0) if lp else None
        mt = body.get("max_completion_tokens", body.get("max_tokens"))
        max_tokens = _num({"max_tokens": mt}, "max_tokens", 0, 1 << 30, integer=True)
        echo = False
    else:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
            p = p[0]
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            prompt = [int(t) for t in p]
        elif isinstance(p, str) and p:
            prompt = p
        else:
            raise OAIError("'prompt' must be a non-empty string or array of token ids (one prompt per request)",
                           param="prompt")  # fmt: skip
        logprobs = _num(body, "logprobs", 0, MAX_LOGPROBS, integer=True)
        max_tokens = _num(body, "max_tokens", 0, 1 << 30, integer=True)
        if max_tokens is None:
            max_tokens = 16  # the OpenAI default for completions
        echo = body.get("echo") is True
        if echo:
            raise OAIError("'echo' is not supported", param="echo")
        if body.get("suffix") is not None:
            raise OAIError("'suffix' is not supported here; use /infill", param="suffix")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise OAIError("'stream' must be a boolean", param="stream")
    so = body.get("stream_options") or {}
    if not isinstance(so, dict):
        raise OAIError("'stream_options' must be an object", param="stream_options")
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= MAX_STOPS:
        stops = list(stop)
    else:
        raise OAIError(f"'stop' must be a string or an array of at most {MAX_STOPS} strings", param="stop")
    if any(not s for s in stops):
        raise OAIError("'stop' strings must not be empty", param="stop")
    kw: dict[str, Any] = {}
    t = _num(body, "temperature", 0, 2)
    if t is not None:
        kw["temperature"] = float(t)
    tp = _num(body, "top_p", 0, 1)
    if tp is not None:
        kw["top_p"] = float(tp)
    for key in ("presence_penalty", "frequency_penalty"):
        v = _num(body, key, -2, 2)
        if v is not None:
            kw[key] = float(v)
    try:
        kw["seed"] = seed_param(get_seed(body), defaults.seed)
    except RequestError as e:
        raise OAIError(e.message, param="seed") from None
    g = _grammar(body)
    if g is not None:
        kw["grammar"] = g
        kw["grammar_root"] = "root"
    kw["logprobs"] = logprobs
    cache_prompt = body.get("cache_prompt")
    if cache_prompt is None:  # absent or null: the default, as for every other field
        cache_prompt = True
    if not isinstance(cache_prompt, bool):
        raise OAIError("'cache_prompt' must be a boolean", param="cache_prompt")
    draft_memory = body.get("draft_memory")  # localspec extension: keep this request out of the drafting memory
    if draft_memory is not None:
        if not isinstance(draft_memory, bool):
            raise OAIError(f"'draft_memory' must be a boolean, got {json.dumps(draft_memory)}", param="draft_memory")
        kw["draft_memory"] = draft_memory and defaults.draft_memory
    for key in ("accept_threshold_single", "accept_threshold_acc"):  # LOSSY below 1 (localspec extension)
        v = body.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 < v <= 1.0:
            raise OAIError(f"'{key}' must be a number in (0, 1] (1 = lossless), got {json.dumps(v)}", param=key)
        kw[key] = float(v)
    try:
        spec = get_speculation(body)
    except RequestError as e:
        raise OAIError(e.message, param="speculative") from None
    try:  # llama.cpp's /v1 endpoints take its /completion forms: {"token id": bias}, text keys too
        logit_bias = parse_logit_bias(body["logit_bias"]) if body.get("logit_bias") is not None else None
    except RequestError as e:
        raise OAIError(e.message, param="logit_bias") from None
    try:
        sampling = replace(defaults, **kw)
    except (ValueError, TypeError) as e:
        raise OAIError(str(e)) from None
    return OAIRequest(kind, prompt, max_tokens, stream, bool(so.get("include_usage")), stops, sampling, logprobs, echo,
                      cache_prompt, spec.enabled, spec.limits, spec.notes, logit_bias)  # fmt: skip


# -- the service -----------------------------------------------------------------------------


class OpenAIService:
    """Turns OpenAI requests into ``BatchScheduler`` jobs and their results into responses.

    Args:
        scheduler: a started ``BatchScheduler``.
        model_name: the id ``/v1/models`` lists (requests may name any model: there is one).
        sampling: defaults for fields a request leaves out.
        max_queue: most requests waiting for a slot; more get 503.
        stall_s: ``health`` is 503 once requests have waited this long (s) with no step.
    """

    def __init__(self, scheduler, *, model_name: str, sampling: SamplingParams | None = None, max_queue: int = 64,
                 speculative: bool = True, stall_s: float = HEALTH_STALL_S) -> None:  # fmt: skip
        self.scheduler = scheduler
        self.model = scheduler.model
        self.model_name = model_name
        self.sampling = sampling or SamplingParams()
        self.max_queue = max_queue
        self.speculative = speculative
        self.stall_s = stall_s
        self.created = int(time.time())
        self._chat_format = None
        self._lock = threading.Lock()
        self._live: set = set()  # jobs submitted and not yet done
        self._admitting = 0  # requests past the queue check and not yet in the scheduler's queue
        self._closing = False

    def health(self) -> tuple[int, dict]:
        """``/health``: HTTP status and body. ``slots_idle`` / ``slots_processing`` (requests
        in slots), ``requests_waiting`` (queued for a slot), ``last_step_age_s`` (seconds since
        the scheduler's last step ended; null before the first). 503 with ``"status": "error"``
        when requests are present and neither a step has ended nor a request arrived for
        ``stall_s`` seconds (a stuck scheduler); else 200 ``"status": "ok"``."""
        sched = self.scheduler
        now = time.perf_counter() * 1e6  # the scheduler's clock (scheduler._now_us)
        jobs = [s.job for s in list(sched.slots) if s is not None] + list(sched._queue)
        last = sched.t_last_step_us
        n_proc = sum(s is not None for s in list(sched.slots))
        body: dict[str, Any] = {"status": "ok", "slots_idle": sched.parallel - n_proc, "slots_processing": n_proc,
                                "requests_waiting": sched.n_waiting,
                                "last_step_age_s": None if last is None else round((now - last) / 1e6, 3)}  # fmt: skip
        error = stall_error(now / 1e6, [j.t_submit_us / 1e6 for j in jobs], None if last is None else last / 1e6,
                            self.stall_s, "scheduler step")  # fmt: skip
        if error is not None:
            body.update(status="error", error=error)
            return 503, body
        return 200, body

    def stop_accepting(self) -> None:
        """Refuse new requests (503 ``the server is shutting down``) and cancel every queued or
        running one: each is answered at once with the ``cut_off`` error (a stream gets it as its
        last event, then ``[DONE]``), so a shutdown need not wait for long generations.
        Thread-safe; idempotent."""
        with self._lock:
            self._closing = True
            jobs = list(self._live)
        for j in jobs:
            j.cancel()

    def chat_format(self):
        if self._chat_format is None:
            from ..tui.chat_format import chat_format_for

            self._chat_format = chat_format_for(self.model)
        return self._chat_format

    def _tokenize(self, text: str, param: str, *, add_special: bool, parse_special: bool = False) -> list[int]:
        """``text``'s token ids (``prompt.tokenize_bounded``: a text that surely has more tokens
        than a request's context is refused before it is tokenized whole).

        Raises:
            OAIError: 400 ``context_length_exceeded``.
        """
        try:
            return tokenize_bounded(self.model, text, self.scheduler.n_ctx_slot, add_special=add_special,
                                    parse_special=parse_special, hint=" (serve --ctx-per-request)")  # fmt: skip
        except PromptTooLongError as e:
            raise OAIError(str(e), param=param, code="context_length_exceeded") from None

    def prompt_tokens(self, req: OAIRequest) -> tuple[list[int], list[str], bool]:
        """Token ids, extra stop strings, and whether the reply's leading space is dropped.

        Raises:
            OAIError: a prompt that cannot fit, a chat the template refuses.
        """
        if req.kind == "completion":
            if isinstance(req.prompt, list):
                return req.prompt, [], False
            return self._tokenize(req.prompt, "prompt", add_special=True), [], False
        from ..tui.chat_format import Message

        fmt = self.chat_format()
        try:
            text = fmt.render([Message(r, c) for r, c in req.prompt])
        except LocalSpecError as e:
            raise OAIError(str(e), param="messages") from None
        if fmt.uses_template:
            return self._tokenize(text, "messages", add_special=False, parse_special=True), list(fmt.stop), False
        return self._tokenize(text, "messages", add_special=True), list(fmt.stop), True

    def submit(self, req: OAIRequest, on_chunk, on_done):
        """Tokenize ``req`` and queue it (call it off the event loop: tokenizing takes time).

        Raises:
            OAIError: 503 when more than ``max_queue`` requests would wait for a free slot or after
                ``stop_accepting``; 400
                for a prompt that does not fit.
        """
        if self._closing:
            raise OAIError("the server is shutting down", 503)
        sched = self.scheduler
        with self._lock:  # the requests being tokenized count as waiting: a burst cannot pass the check at once
            waiting = sched.n_waiting + self._admitting - (sched.parallel - sched.n_active)  # no slot for them now
            if waiting >= self.max_queue:
                raise OAIError(f"too many requests waiting ({waiting}); try again later", 503)
            self._admitting += 1
        try:
            return self._submit(req, on_chunk, on_done)
        finally:
            with self._lock:
                self._admitting -= 1

    def _submit(self, req: OAIRequest, on_chunk, on_done):
        tokens, extra_stops, strip = self.prompt_tokens(req)
        sampling = req.sampling
        if req.logit_bias is not None:
            try:
                sampling = replace(sampling, logit_bias=resolve_logit_bias(req.logit_bias, self.model))
            except RequestError as e:
                raise OAIError(e.message, param="logit_bias") from None
        n_ctx = self.scheduler.n_ctx_slot
        max_tokens = req.max_tokens if req.max_tokens is not None else max(0, n_ctx - len(tokens))

        def done(j) -> None:
            with self._lock:
                self._live.discard(j)
            on_done(j)

        try:
            job = self.scheduler.submit(tokens, max_tokens=max_tokens, sampling=sampling, stop=req.stop + extra_stops,
                                        speculative=self.speculative and req.speculative is not False,
                                        on_chunk=on_chunk, on_done=done, cache_prompt=req.cache_prompt,
                                        draft_limits=req.draft_limits)  # fmt: skip
        except LocalSpecError as e:
            code = "context_length_exceeded" if "context" in str(e) else None
            raise OAIError(str(e), param="messages" if req.kind == "chat" else "prompt", code=code) from None
        with self._lock:
            if self._closing:  # stop_accepting ran while this was being submitted
                job.cancel()
            elif not job.done.is_set():  # (once done, ``done`` has run or will find nothing to drop)
                self._live.add(job)
        job.strip_space = strip  # type: ignore[attr-defined]
        return job

    # -- responses --------------------------------------------------------------------------

    def _token_text(self, tok: int) -> tuple[str, list[int]]:
        b = self.model.token_bytes(tok)
        return b.decode("utf-8", errors="replace"), list(b)

    def logprobs_chat(self, lps) -> dict | None:
        if lps is None:
            return None
        content = []
        for lp in lps:
            text, raw = self._token_text(lp.token)
            top = []
            for t, v in lp.top:
                tt, tb = self._token_text(t)
                top.append({"token": tt, "logprob": v, "bytes": tb})
            content.append({"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
        return {"content": content}

    def logprobs_completion(self, lps, offsets: list[int] | None = None) -> dict | None:
        """The ``logprobs`` object of a completion choice for ``lps`` (``TokenLogprob``s);
        ``offsets``: each token's character offset in the completion (default: counted from
        the tokens themselves, ``text.token_offsets``)."""
        if lps is None:
            return None
        if offsets is None:
            offsets = token_offsets(self.model.token_bytes, [lp.token for lp in lps])
        tokens, values, tops = [], [], []
        for lp in lps:
            tokens.append(self._token_text(lp.token)[0])
            values.append(lp.logprob)
            tops.append({self._token_text(t)[0]: v for t, v in lp.top})
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": list(offsets)}

    @staticmethod
    def usage(stats) -> dict:
        return {"prompt_tokens": stats.n_prompt_tokens, "completion_tokens": stats.n_generated_tokens,
                "total_tokens": stats.n_prompt_tokens + stats.n_generated_tokens,
                "prompt_tokens_details": {"cached_tokens": stats.n_cached_tokens}}  # fmt: skip

    @staticmethod
    def timings(stats) -> dict:
        """llama.cpp's ``timings`` object, with the speculation figures."""
        ms = stats.t_generate_us / 1e3
        return {
            "prompt_n": stats.n_prompt_tokens - stats.n_cached_tokens,
            "prompt_ms": stats.t_prefill_us / 1e3,
            "cache_n": stats.n_cached_tokens,
            "predicted_n": stats.n_generated_tokens,
            "predicted_ms": ms,
            "predicted_per_second": stats.n_generated_tokens / (ms / 1e3) if ms > 0 else 0.0,
            "draft_n": stats.num_draft_tokens,
            "draft_n_accepted": stats.num_accepted_tokens,
            "n_steps": stats.n_steps,
            "drafter": stats.drafter,
            **({"lossy": True, "accept_threshold_single": stats.accept_threshold_single,
                "accept_threshold_acc": stats.accept_threshold_acc} if stats.lossy else {}),
        }

    @staticmethod
    def finish_reason(result) -> str:
        """The OpenAI ``finish_reason`` of a finished ``result`` (a cancelled one is no finished
        answer: ``cut_off`` answers it)."""
        return "length" if result.finish_reason in ("length", "time") else "stop"

    @staticmethod
    def cut_off(job) -> OAIError | None:
        """The error that answers ``job`` when it was cancelled before its answer finished, else
        None. A client that disconnects cancels its job too, but its response has stopped by
        then (nobody reads it): a cancelled job whose answer is still sent was cut off by the
        server's shutdown (``stop_accepting``, or the scheduler closing), and a partial answer
        with ``finish_reason: "stop"`` would pass for a finished one."""
        r = job.result
        if job.error is not None or r is None or r.finish_reason != "cancelled":
            return None
        n = r.stats.n_generated_tokens
        return OAIError(f"the answer was cut off after {n} token{'s' * (n != 1)}: the server shut down before it "
                        "finished; retry the request", 503, code=SHUTDOWN_CODE)  # fmt: skip

    def final(self, req: OAIRequest, rid: str, job, text: str) -> dict:
        r = job.result
        base = {"id": rid, "created": int(time.time()), "model": self.model_name, "system_fingerprint": "localspec"}
        if req.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": self.logprobs_chat(r.logprobs), "finish_reason": self.finish_reason(r)}  # fmt: skip
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": self.logprobs_completion(r.logprobs),
                      "finish_reason": self.finish_reason(r)}  # fmt: skip
            obj = "text_completion"
        out = {**base, "object": obj, "choices": [choice], "usage": self.usage(r.stats), "timings": self.timings(r.stats)}
        return self.with_notes(req, out)

    @staticmethod
    def with_notes(req: OAIRequest, obj: dict) -> dict:
        """``obj`` with ``localspec.notes`` (request fields that changed nothing) when there are any."""
        if req.notes:
            obj["localspec"] = {"notes": list(req.notes)}
        return obj

    def chunk(self, req: OAIRequest, rid: str, *, text: str | None = None, lps=None, finish: str | None = None,
              role: bool = False, offsets: list[int] | None = None) -> dict:  # fmt: skip
        base = {"id": rid, "created": int(time.time()), "model": self.model_name, "system_fingerprint": "localspec"}
        if req.kind == "chat":
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": self.logprobs_chat(lps), "finish_reason": finish}
            return {**base, "object": "chat.completion.chunk", "choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": self.logprobs_completion(lps, offsets), "finish_reason": finish}
        return {**base, "object": "text_completion", "choices": [choice]}


class _SpaceStripper:
    """Drops the leading space of a transcript reply (streamed in pieces)."""

    def __init__(self, active: bool) -> None:
        self.pending = active

    def __call__(self, text: str) -> str:
        if self.pending and text:
            self.pending = False
            if text.startswith(" "):
                return text[1:]
        return text


class OAIResponse:
    """ASGI response: runs one job, streams or answers once, cancels the job when the client
    disconnects (its slot is freed at the next step)."""

    def __init__(self, service: OpenAIService, req: OAIRequest) -> None:
        self.service = service
        self.req = req

    async def __call__(self, scope, receive, send) -> None:
        svc, req = self.service, self.req
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def put(item) -> None:
            try:
                loop.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:  # the loop is gone (shutting down)
                pass

        rid = ("chatcmpl-" if req.kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]

        def on_done(j) -> None:  # on the scheduler's thread; a client that left is logged too
            self._log(j, rid)
            put(("done", j))

        try:
            # tokenizing a long prompt takes a while: not on the event loop, which serves every
            # other client's stream meanwhile
            job = await anyio.to_thread.run_sync(
                lambda: svc.submit(req, on_chunk=lambda c: put(("chunk", c)), on_done=on_done))
        except OAIError as e:
            await _send_json(send, e.status, e.body())
            return
        strip = _SpaceStripper(getattr(job, "strip_space", False))
        async with anyio.create_task_group() as tg:

            async def watch_disconnect() -> None:
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        job.cancel()
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(watch_disconnect)
            try:
                if req.stream:
                    await self._stream(send, q, job, rid, strip)
                else:
                    await self._once(send, q, job, rid, strip)
            finally:
                if not job.done.is_set():
                    job.cancel()
                tg.cancel_scope.cancel()

    def _log(self, job, rid: str) -> None:
        r = job.result
        if r is not None:
            path = "/v1/chat/completions" if self.req.kind == "chat" else "/v1/completions"
            log.info("%s", request_log_line(rid, path, r.stats, r.finish_reason, r.stats.t_total_us / 1e3))

    async def _once(self, send, q, job, rid, strip) -> None:
        parts = []
        while True:
            kind, item = await q.get()
            if kind == "chunk":
                parts.append(item.text)
            else:
                break
        if job.error is not None:
            # a lost / unreachable RPC worker is the server's trouble, not the request's
            status = 503 if isinstance(job.error, RPCError) else 400 if isinstance(job.error, LocalSpecError) else 500
            await _send_json(send, status, oai_error(status, f"generation failed: {job.error}"))
            return
        cut = self.service.cut_off(job)
        if cut is not None:
            await _send_json(send, cut.status, cut.body())
            return
        await _send_json(send, 200, self.service.final(self.req, rid, job, strip("".join(parts))))

    async def _stream(self, send, q, job, rid, strip) -> None:
        svc, req = self.service, self.req
        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})

        async def event(obj) -> None:
            await send({"type": "http.response.body", "body": f"data: {dumps(obj)}\n\n".encode(), "more_body": True})

        if req.kind == "chat":
            await event(svc.chunk(req, rid, text="", role=True))
        # a token's logprob goes out with the chunk that completes its text: none for text held
        # back (a possible stop string, a split character), none for tokens a stop string cuts
        track = ReleaseTracker(svc.model.token_bytes)
        want = req.logprobs is not None

        def lp_chunk(text: str, out) -> dict:
            lps = [lp for lp, _o in out] if want else None
            return svc.chunk(req, rid, text=text, lps=lps, offsets=[o for _lp, o in out])

        while True:
            kind, item = await q.get()
            if kind == "done":
                break
            if item.token >= 0:
                track.add(item.token, item.logprob)
            out = track.release(item.text)
            text = strip(item.text)
            if text or (want and out):
                await event(lp_chunk(text, out))
        cut = svc.cut_off(job)
        if job.error is None and cut is None:
            out = track.flush(len(job.result.token_ids))
            if want and out:
                await event(lp_chunk("", out))
        if job.error is not None:
            await event(oai_error(500, f"generation failed: {job.error}"))
        elif cut is not None:  # no finish_reason: the headers (200) are out, the error event says it
            await event(cut.body())
        else:
            last = svc.chunk(req, rid, finish=svc.finish_reason(job.result))
            if req.kind == "chat":
                last["choices"][0]["delta"] = {}
            last["timings"] = svc.timings(job.result.stats)
            svc.with_notes(req, last)
            await event(last)
            if req.include_usage:
                await event({"id": rid, "object": last["object"], "created": last["created"], "model": svc.model_name,
                             "choices": [], "usage": svc.usage(job.result.stats)})  # fmt: skip
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


async def _send_json(send, status: int, obj) -> None:
    body = dumps(obj).encode("utf-8")
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def openai_routes(service: OpenAIService, *, max_body_bytes: int):
    """Starlette routes of the OpenAI API."""
    from starlette.routing import Route

    from .http import read_json

    async def run(request: Request, kind: str):
        try:
            try:
                body = await read_json(request, max_body_bytes)
            except RequestError as e:
                raise OAIError(e.message, e.status) from None
            req = parse_oai(kind, body, service.sampling)
        except OAIError as e:
            return json_response(e.body(), e.status)
        return OAIResponse(service, req)

    async def chat(request: Request):
        return await run(request, "chat")

    async def completions(request: Request):
        return await run(request, "completion")

    async def models(_request: Request):
        return json_response({"object": "list", "data": [
            {"id": service.model_name, "object": "model", "created": service.created, "owned_by": "localspec"}]})  # fmt: skip

    async def model(request: Request):
        name = request.path_params["name"]
        if name != service.model_name:
            return json_response(oai_error(404, f"the model {name!r} does not exist; this server has {service.model_name!r}",
                                           code="model_not_found"), 404)  # fmt: skip
        return json_response({"id": name, "object": "model", "created": service.created, "owned_by": "localspec"})

    return [
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{name:path}", model, methods=["GET"]),
    ]


class APIKeyMiddleware:
    """Requires ``Authorization: Bearer KEY`` on every path but ``/health``."""

    def __init__(self, app, key: str) -> None:
        self.app = app
        self.key = key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in ("/health", "/v1/health"):
            headers = dict(scope.get("headers") or [])
            auth = headers.get(b"authorization", b"").decode("latin-1")
            if auth != f"Bearer {self.key}":
                await _send_json(send, 401, oai_error(401, "invalid or missing API key (Authorization: Bearer KEY)",
                                                      code="invalid_api_key"))  # fmt: skip
                return
        await self.app(scope, receive, send)


def create_serve_app(service: OpenAIService, completion_service=None, *, max_body_bytes: int, api_key: str | None = None):
    """The ``localspec serve`` app: the OpenAI routes, and the editor endpoints (``/infill``,
    ``/completion``, ``/health``, ``/props``) of ``completion_service`` when given."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException

    from .http import create_app

    async def http_error(_request, exc: HTTPException):
        return json_response(oai_error(exc.status_code, str(exc.detail)), exc.status_code)

    async def server_error(_request, exc: Exception):
        return json_response(oai_error(500, f"internal error: {exc}"), 500)

    from starlette.routing import Route

    routes = openai_routes(service, max_body_bytes=max_body_bytes)
    if completion_service is not None:
        editor = create_app(completion_service, max_body_bytes=max_body_bytes)
        routes += [r for r in editor.routes if getattr(r, "path", "") not in ("/v1/models", "/health", "/v1/health")]

    async def health(_request):
        status, body = service.health()
        return json_response(body, status)

    routes += [Route("/health", health, methods=["GET"]), Route("/v1/health", health, methods=["GET"])]
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: server_error})
    if api_key:
        return APIKeyMiddleware(app, api_key)
    return app
