"""Requests of the llama.cpp server API that editor plugins use: ``/infill`` and ``/completion``.

``parse_request`` type-checks a decoded JSON body into a ``CompletionRequest`` and raises
``RequestError`` (HTTP 400) for anything malformed; unknown fields are ignored, known fields
localspec does not implement are listed so the response can say so. Field names and
meanings are llama.cpp's (``tools/server/server-schema.cpp``; README of ``tools/server``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from .fields import RequestError, get_bool, get_speculation, get_float, get_int, get_str, get_str_list, lone_surrogate_error, require
from ..draft_limits import DraftLimits
from .prompt import ExtraChunk
from .sampling_fields import SamplerFields, parse_sampler_fields

# Fields llama.cpp's server accepts that change nothing here (told in the response notes).
_NOT_IMPLEMENTED = ("n_probs", "lora", "n_keep", "n_discard", "n_cache_reuse", "min_keep", "post_sampling_probs")

# The most completions one request may ask for (``n_cmpl`` / ``n``). llama-server bounds it by
# its slot count (``server-schema.cpp``: 1 to ``n_parallel``); the editor server runs a
# request's completions one after another on one slot, so it bounds them by this count
# instead (llama.vscode asks for 3), and a larger one is a 400, not minutes of a busy slot.
MAX_CMPL = 16


@dataclass
class CompletionRequest:
    """One completion request, validated.

    Attributes:
        kind: ``"infill"`` (prefix + suffix + extra context) or ``"completion"`` (a prompt).
        input_prefix / input_suffix / input_extra: the infill context.
        prompt: infill: text after the prefix (string); completion: text or token ids.
        n_predict: most tokens to generate; -1 = until end of generation or a full context;
            0 = only process the prompt into the cache (editors warm the cache this way).
        stream: send partial results as server-sent events (HTTP) / lines (stdio).
        stop: stop strings (not included in the output).
        cache_prompt: reuse the KV cache of the previous request's common prefix.
        n_indent / t_max_predict_ms: editor stopping rules (``server.stops``).
        t_max_prompt_ms: accepted and ignored, as llama.cpp does (see docs/complete.md).
        response_fields: keep only these fields of the final response ("a/b" paths allowed).
        return_tokens: include the generated token ids in ``tokens``.
        id_slot / client_id: who sent it; a newer request with the same key cancels an
            older one (``client_key``).
        n_cmpl: completions asked for, 1 to ``MAX_CMPL`` (one after another on the request's
            slot; a streamed request streams one).
        speculative: False forces plain decoding (localspec extension); None = server default.
        draft_limits: llama.cpp's ``speculative.n_max`` / ``speculative.p_min`` (``DraftLimits``).
        speculation_notes: speculation fields that change nothing here (``speculative.n_min``).
        sampler_fields: the sampling fields.
        not_implemented: known llama.cpp fields present in the request that are ignored.
    """

    kind: Literal["infill", "completion"]
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraChunk] = field(default_factory=list)
    prompt: str | list[int] = ""
    n_predict: int = -1
    stream: bool = False
    stop: list[str] = field(default_factory=list)
    cache_prompt: bool = True
    n_indent: int = 0
    t_max_predict_ms: float = 0.0
    t_max_prompt_ms: float = 0.0
    response_fields: list[str] | None = None
    return_tokens: bool = False
    id_slot: int = -1
    client_id: str | None = None
    n_cmpl: int = 1
    speculative: bool | None = None
    draft_limits: DraftLimits | None = None
    speculation_notes: tuple[str, ...] = ()
    sampler_fields: SamplerFields = field(default_factory=SamplerFields)
    not_implemented: list[str] = field(default_factory=list)

    @property
    def is_warmup(self) -> bool:
        """A request that only fills the cache (``n_predict`` 0), as editors send in the
        background with new context chunks."""
        return self.n_predict == 0

    @property
    def client_key(self) -> str | None:
        """Requests with the same key come from the same client: ``client_id`` when given,
        else the slot id (both plugins send ``id_slot: 0``); None = independent."""
        if self.client_id is not None:
            return f"client:{self.client_id}"
        if self.id_slot >= 0:
            return f"slot:{self.id_slot}"
        return None


def parse_request(kind: str, body: Any, *, default_n_predict: int = -1) -> CompletionRequest:
    """Validate a decoded JSON request body.

    Args:
        kind: ``"infill"`` or ``"completion"``.
        body: the decoded JSON value.
        default_n_predict: ``n_predict`` when the request has none.
    Raises:
        RequestError: not an object, a required field missing, a field of the wrong type or
            out of range.
    """
    if not isinstance(body, Mapping):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    _refuse_lone_surrogates(body)
    r = CompletionRequest(kind="infill" if kind == "infill" else "completion")
    if r.kind == "infill":
        r.input_prefix = _text(body, "input_prefix")
        r.input_suffix = _text(body, "input_suffix")
        r.input_extra = _extra(body.get("input_extra"))
        r.prompt = get_str(body, "prompt", "") or ""
    else:
        r.prompt = _completion_prompt(require(body, "prompt"))
    n = body.get("n_predict", body.get("max_tokens"))
    r.n_predict = get_int({"n_predict": n}, "n_predict", default_n_predict, -1, 2**31 - 1)
    r.stream = get_bool(body, "stream", False)
    r.stop = get_str_list(body, "stop", []) or []
    r.cache_prompt = get_bool(body, "cache_prompt", True)
    r.n_indent = get_int(body, "n_indent", 0, 0)
    r.t_max_predict_ms = get_float(body, "t_max_predict_ms", 0.0)
    r.t_max_prompt_ms = get_float(body, "t_max_prompt_ms", 0.0)
    r.response_fields = get_str_list(body, "response_fields", None)
    r.return_tokens = get_bool(body, "return_tokens", False)
    r.id_slot = get_int(body, "id_slot", -1, -1)
    cid = body.get("client_id")
    if cid is not None and (isinstance(cid, bool) or not isinstance(cid, (str, int))):
        raise RequestError('"client_id" must be a string or an integer')
    r.client_id = None if cid is None else str(cid)
    r.n_cmpl = get_int(body, "n_cmpl", get_int(body, "n", 1, 1, MAX_CMPL), 1, MAX_CMPL)
    spec = get_speculation(body)
    r.speculative, r.draft_limits, r.speculation_notes = spec.enabled, spec.limits, spec.notes
    r.sampler_fields = parse_sampler_fields(body)
    r.not_implemented = [k for k in _NOT_IMPLEMENTED if body.get(k) not in (None, 0, False, [], {})]
    return r


def _refuse_lone_surrogates(body: Mapping[str, Any]) -> None:
    """Raises ``RequestError`` (400) naming the field when any string in the request holds a
    lone surrogate: such text cannot be tokenised or echoed back as UTF-8."""
    error = lone_surrogate_error(body)
    if error is not None:
        raise RequestError(error)


def _text(body: Mapping[str, Any], key: str) -> str:
    v = require(body, key)
    if not isinstance(v, str):
        raise RequestError(f'"{key}" must be a string, got {type(v).__name__}')
    return v


def _extra(raw: Any) -> list[ExtraChunk]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise RequestError('"input_extra" must be an array of {"filename": string, "text": string}')
    out = []
    for i, chunk in enumerate(raw):
        if not isinstance(chunk, Mapping) or not isinstance(chunk.get("text"), str):
            raise RequestError(f'"input_extra"[{i}] must be an object with a "text" string')
        name = chunk.get("filename", "tmp")
        if not isinstance(name, str):
            raise RequestError(f'"input_extra"[{i}].filename must be a string')
        out.append(ExtraChunk(chunk["text"], name))
    return out


def _completion_prompt(v: Any) -> str | list[int]:
    if isinstance(v, str):
        return v
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return list(v)
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str):
        return v[0]
    raise RequestError('"prompt" must be a string or a non-empty list of token ids (one prompt per request)')
