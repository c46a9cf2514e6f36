"""Responses in the llama.cpp server's format (non-OpenAI ``/completion`` and ``/infill``).

Field names follow ``server_task_result_cmpl_final::to_json_non_oaicompat`` and
``server_slot_stats::to_json`` (``tools/server/server-task.cpp``, ``server-common.cpp``): the
plugins read ``content``, ``timings/*`` (prompt_n, prompt_ms, predicted_n, predicted_ms and
their rates), ``tokens_cached`` and ``truncated``. localspec adds one object, ``localspec``,
with the speculation statistics, whether the prompt used FIM, and notes about anything in
the request it could not honour.

JSON is written compactly (``"content":"..."``): llama.vim checks a response with the pattern
``"content"\\s*:"`` before decoding it, which a space after the colon would fail.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..stats import GenerationStats


def dumps(obj: Any) -> str:
    """Compact JSON, UTF-8 text kept as is (as llama.cpp writes it)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def select_fields(paths: Sequence[str], obj: Mapping[str, Any]) -> dict:
    """llama.cpp's ``response_fields``: keep the listed fields; a path ``a/b`` takes ``obj[a][b]``
    and stores it under the key ``"a/b"``; missing paths are left out."""
    out: dict = {}
    for path in paths:
        cur: Any = obj
        ok = True
        for k in path.split("/"):
            if isinstance(cur, Mapping) and k in cur:
                cur = cur[k]
            else:
                ok = False
                break
        if ok:
            out[path] = cur
    return out


def _rate(n: int, ms: float) -> float:
    return 1e3 * n / ms if ms > 0 else 0.0


def timings(stats: GenerationStats, n_predicted: int) -> dict:
    """llama.cpp's ``timings`` object; ``draft_n`` / ``draft_n_accepted`` when anything was drafted."""
    n_prompt = max(0, stats.n_prompt_tokens - stats.n_cached_tokens)
    prompt_ms = stats.t_prefill_us / 1e3
    predicted_ms = stats.t_generate_us / 1e3
    t = {
        "cache_n": stats.n_cached_tokens,
        "prompt_n": n_prompt,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / n_prompt if n_prompt else 0.0,
        "prompt_per_second": _rate(n_prompt, prompt_ms),
        "predicted_n": n_predicted,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / n_predicted if n_predicted else 0.0,
        "predicted_per_second": _rate(n_predicted, predicted_ms),
    }
    if stats.num_draft_tokens:
        t["draft_n"] = stats.num_draft_tokens
        t["draft_n_accepted"] = stats.num_accepted_tokens
    if stats.lossy:  # LOSSY acceptance thresholds: not exactly the target's distribution
        t["lossy"] = True
    return t


def stop_type_of(result, reason: str | None) -> tuple[str, str]:
    """llama.cpp's ``(stop_type, stopping_word)`` for an engine ``GenerationResult`` (None:
    cancelled before it started) that an editor stop (``reason``) may have ended."""
    if reason is not None:
        return "limit", ""
    if result is None or result.finish_reason == "cancelled":
        return "none", ""
    if result.finish_reason == "stop":
        return ("eos", "") if result.stop == "<eog>" else ("word", result.stop or "")
    return "limit", ""  # length, time, full context


def generation_settings(req, params, applied: list[str], seed, speculative: bool) -> dict:
    """The ``generation_settings`` object: what the request ran with."""
    return {
        "n_predict": req.n_predict,
        "seed": seed,
        "temperature": params.temperature,
        "top_k": params.top_k,
        "top_p": params.top_p,
        "min_p": params.min_p,
        "repeat_penalty": params.repeat_penalty,
        "repeat_last_n": params.penalty_last_n,
        "frequency_penalty": params.frequency_penalty,
        "presence_penalty": params.presence_penalty,
        "samplers": applied,
        "stop": req.stop,
        "stream": req.stream,
        "n_indent": req.n_indent,
        "t_max_predict_ms": req.t_max_predict_ms,
        "speculative": speculative,
    }


@dataclass
class Outcome:
    """Everything the final response reports about one request.

    Attributes:
        content: the completion text.
        tokens: its token ids.
        stop_type: llama.cpp's ``"eos"`` | ``"word"`` | ``"limit"`` | ``"none"`` (cancelled).
        stopping_word: the stop string that ended it, else "".
        truncated: context was left out (extra chunks beyond the context) or the context filled.
        stats: the engine's ``GenerationStats``.
        localspec: the ``localspec`` object (speculation, FIM, samplers, notes).
    """

    content: str
    tokens: list[int]
    stop_type: str
    stopping_word: str
    truncated: bool
    stats: GenerationStats
    localspec: dict = field(default_factory=dict)


def final_response(
    o: Outcome,
    *,
    id_slot: int,
    model: str,
    prompt_text: str,
    generation_settings: dict,
    return_tokens: bool,
    response_fields: Sequence[str] | None,
) -> dict:
    """The final (``"stop": true``) response object."""
    n_pred = len(o.tokens)
    res = {
        "index": 0,
        "content": o.content,
        "tokens": o.tokens if return_tokens else [],
        "id_slot": max(id_slot, 0),
        "stop": True,
        "model": model,
        "tokens_predicted": n_pred,
        "tokens_evaluated": o.stats.n_prompt_tokens,
        "generation_settings": generation_settings,
        "prompt": prompt_text,
        "has_new_line": "\n" in o.content,
        "truncated": o.truncated,
        "stop_type": o.stop_type,
        "stopping_word": o.stopping_word,
        "tokens_cached": o.stats.n_prompt_tokens + n_pred,
        "timings": timings(o.stats, n_pred),
        "localspec": o.localspec,
    }
    return select_fields(response_fields, res) if response_fields else res


def partial_response(content: str, tokens: list[int], *, id_slot: int, n_predicted: int, n_prompt: int) -> dict:
    """One streamed piece (``"stop": false``)."""
    return {
        "index": 0,
        "content": content,
        "tokens": tokens,
        "stop": False,
        "id_slot": max(id_slot, 0),
        "tokens_predicted": n_predicted,
        "tokens_evaluated": n_prompt,
    }


def sse(obj: Mapping[str, Any]) -> bytes:
    """One server-sent event, ``data: {...}\\n\\n``, as llama.cpp's server streams."""
    return f"data: {dumps(obj)}\n\n".encode("utf-8")


def request_log_line(rid: object, endpoint: str, stats: GenerationStats, finish: str | None, total_ms: float) -> str:
    """The one line a server logs per request (``localspec.server`` logger, INFO), as llama-server
    logs each task: id, endpoint, prompt tokens (cached), completion tokens, drafted and
    accepted draft tokens, the time from arrival to the end (ms), why it ended."""
    return (f"request {rid} {endpoint}: prompt {stats.n_prompt_tokens} tokens ({stats.n_cached_tokens} cached), "
            f"completion {stats.n_generated_tokens} tokens, drafted {stats.num_draft_tokens}, "
            f"accepted {stats.num_accepted_tokens}, {total_ms:.0f} ms, {finish}")  # fmt: skip


HEALTH_STALL_S = 60.0
"""``/health`` answers 503 once requests have waited this long (s) with no step completed."""


def stall_error(now_s: float, t_submit_s: Sequence[float], t_progress_s: float | None, stall_s: float,
                what: str) -> str | None:  # fmt: skip
    """The ``/health`` rule of both servers: a stuck worker is one with requests present
    (``t_submit_s``: their arrival times, s) and neither a step ended (``t_progress_s``, s;
    None before the first) nor a request arrived for more than ``stall_s`` seconds. Returns the
    error line for ``/health``'s 503 body (``what``: the step's name), or None when not stuck."""
    if not t_submit_s:
        return None
    stalled = now_s - max(min(t_submit_s), t_progress_s if t_progress_s is not None else -float("inf"))
    if stalled <= stall_s:
        return None
    return (f"no {what} has ended for {stalled:.1f} s while {len(t_submit_s)} requests are present "
            f"(threshold {stall_s:g} s)")  # fmt: skip
