"""Typed reads of JSON request fields, with llama.cpp-style error bodies.

Every reader takes the decoded JSON object, a key and a default; a present value of the
wrong type or out of range raises ``RequestError`` naming the field, so a client learns
exactly what to fix. Absent keys (and JSON ``null``) give the default. Unknown keys are never
looked at, so they are ignored.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..draft_limits import DraftLimits

# llama.cpp server error types (tools/server/server-common.cpp, format_error_response)
INVALID_REQUEST = "invalid_request_error"
NOT_FOUND = "not_found_error"
SERVER_ERROR = "server_error"
NOT_SUPPORTED = "not_supported_error"
UNAVAILABLE = "unavailable_error"
EXCEED_CONTEXT = "exceed_context_size_error"


class RequestError(Exception):
    """A request the server answers with an error status and a JSON error body.

    Attributes:
        status: HTTP status (400 bad input, 404, 413 body too large, 501, 503 busy, 500).
        message: what is wrong and what to do.
        type: llama.cpp's error type string.
    """

    def __init__(self, message: str, status: int = 400, type: str = INVALID_REQUEST) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type

    def body(self) -> dict:
        """``{"error": {"code", "message", "type"}}`` as llama.cpp's server sends it."""
        return error_body(self.status, self.message, self.type)


def error_body(status: int, message: str, type: str) -> dict:
    return {"error": {"code": status, "message": message, "type": type}}


_MISSING = object()


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def decode_json(raw: str | bytes, what: str) -> Any:
    """``raw`` (UTF-8 when bytes) as JSON, strictly: ``NaN`` / ``Infinity`` are not JSON.

    Args:
        what: what ``raw`` is, for the message (``"the request body"``, ``"the line"``).
    Raises:
        RequestError: 400 when not UTF-8 JSON, or nested too deeply for Python's decoder
            (``RecursionError``, about 1,000 levels).
    """
    try:
        return json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else raw, parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as e:
        raise RequestError(f"{what} is not valid JSON: {e}") from None
    except RecursionError:
        raise RequestError(f"{what} nests arrays or objects too deeply") from None


def _get(d: Mapping[str, Any], key: str):
    v = d.get(key, _MISSING)
    return _MISSING if v is None else v


def get_bool(d: Mapping[str, Any], key: str, default: bool) -> bool:
    v = _get(d, key)
    if v is _MISSING:
        return default
    if not isinstance(v, bool):
        raise RequestError(f'"{key}" must be a boolean (true or false), got {type(v).__name__}')
    return v


def range_text(lo, hi) -> str:
    """``in [lo, hi]``, ``>= lo`` or ``<= hi`` (an open side is not printed as ``None``)."""
    if lo is not None and hi is not None:
        return f"in [{lo}, {hi}]"
    return f">= {lo}" if lo is not None else f"<= {hi}"


def _in_range(key: str, v, lo, hi):
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise RequestError(f'"{key}" must be {range_text(lo, hi)}, got {v}')
    return v


def get_int(d: Mapping[str, Any], key: str, default: int, lo: int | None = None, hi: int | None = None) -> int:
    """An integer (a float with an integral value is accepted, as JSON writers differ)."""
    v = _get(d, key)
    if v is _MISSING:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        raise RequestError(f'"{key}" must be an integer, got {v!r}')
    return _in_range(key, int(v), lo, hi)


def get_float(d: Mapping[str, Any], key: str, default: float, lo: float | None = None, hi: float | None = None) -> float:
    v = _get(d, key)
    if v is _MISSING:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise RequestError(f'"{key}" must be a finite number, got {v!r}')
    return _in_range(key, float(v), lo, hi)


def get_str(d: Mapping[str, Any], key: str, default: str | None) -> str | None:
    v = _get(d, key)
    if v is _MISSING:
        return default
    if not isinstance(v, str):
        raise RequestError(f'"{key}" must be a string, got {type(v).__name__}')
    return v


def get_str_list(d: Mapping[str, Any], key: str, default: list[str] | None) -> list[str] | None:
    """A list of strings; a single string is taken as a one-element list."""
    v = _get(d, key)
    if v is _MISSING:
        return default
    if isinstance(v, str):
        return [v]
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise RequestError(f'"{key}" must be a list of strings')
    return list(v)


def require(d: Mapping[str, Any], key: str) -> Any:
    if _get(d, key) is _MISSING:
        raise RequestError(f'"{key}" is required')
    return d[key]


def lone_surrogate_at(v: Any, path: str) -> str | None:
    """The JSON path of the first string (value or key) under ``v`` that holds a lone UTF-16
    surrogate (``"\\ud800"`` is valid JSON but no Unicode text), else None. Iterative, so that
    any depth the JSON parser accepted is walked."""

    def bad(s: str) -> bool:
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False

    stack: list[tuple[Any, str]] = [(v, path)]
    while stack:
        x, p = stack.pop()
        if isinstance(x, str):
            if bad(x):
                return p
        elif isinstance(x, Mapping):
            items = []
            for k, y in x.items():
                sub = f"{p}.{k}" if p else f'"{k}"'
                if isinstance(k, str) and bad(k):
                    return sub.encode("utf-8", "backslashreplace").decode("ascii")
                items.append((y, sub))
            stack.extend(reversed(items))  # first key first
        elif isinstance(x, list):
            stack.extend(reversed([(y, f"{p}[{i}]") for i, y in enumerate(x)]))
    return None


def lone_surrogate_error(v: Any) -> str | None:
    """The one-line error for a request (or a ``batch`` line) ``v`` holding a lone surrogate
    (``lone_surrogate_at``: it names the field), else None."""
    path = lone_surrogate_at(v, "")
    return None if path is None else f"{path} holds a lone UTF-16 surrogate (not valid Unicode text); send UTF-8 text"


@dataclass(frozen=True)
class SpeculationFields:
    """A request's speculation fields.

    Attributes:
        enabled: ``speculative: false`` = no drafter for this request (localspec's field);
            None = the server's default.
        limits: llama.cpp's ``speculative.n_max`` / ``speculative.p_min`` as ``DraftLimits``
            (None when the request gives neither).
        notes: fields given that change nothing here, for the response's notes.
    """

    enabled: bool | None = None
    limits: DraftLimits | None = None
    notes: tuple[str, ...] = ()


def get_speculation(d: Mapping[str, Any]) -> SpeculationFields:
    """``speculative`` (a boolean, or an object with ``n_max`` / ``n_min`` / ``p_min``) and
    llama.cpp's dotted fields ``speculative.n_max``, ``speculative.n_min``,
    ``speculative.p_min`` (``tools/server/server-task.cpp``, ``params_from_json_cmpl``).
    ``n_max`` maps to ``DraftLimits.max_nodes`` (draft tokens per step), ``p_min`` to
    ``DraftLimits.min_score`` (the drafter's estimated acceptance of a draft path); ``n_min``
    (a least draft length) has no counterpart: the policy drafts what is worth verifying.

    Raises:
        RequestError: a field of the wrong type or out of range, named as the request has it.
    """
    spec = _get(d, "speculative")
    enabled = None
    nested: Mapping[str, Any] = {}
    if isinstance(spec, Mapping):
        nested = spec
    elif spec is not _MISSING:
        enabled = get_bool(d, "speculative", True)
    vals: dict[str, Any] = {}
    for key, read in (("n_max", lambda m, k: get_int(m, k, -1, 0)), ("n_min", lambda m, k: get_int(m, k, -1, 0)),
                      ("p_min", lambda m, k: get_float(m, k, -1.0, 0.0, 1.0))):  # fmt: skip
        dotted = f"speculative.{key}"
        if _get(d, dotted) is not _MISSING:
            vals[key] = read(d, dotted)
        elif _get(nested, key) is not _MISSING:
            vals[key] = read({dotted: nested[key]}, dotted)
    limits = None
    if "n_max" in vals or "p_min" in vals:
        limits = DraftLimits(max_nodes=vals.get("n_max"), min_score=vals.get("p_min"))
    notes = ()
    if "n_min" in vals:
        notes = ("ignored (no counterpart): speculative.n_min; localspec drafts what its policy finds worth verifying",)
    return SpeculationFields(enabled, limits, notes)
