"""llama.cpp server sampling fields -> ``SamplingParams``, and what could not be applied.

llama.cpp's server builds its sampler chain from the request's ``samplers`` list (names, or
a string of one-letter codes); only the listed samplers run, so a sampler that is not named
is off: no ``temperature`` in the list means temperature 1 (``dist`` samples the softmax of
what is left), no ``top_k`` means no top-k, and so on. Without a list it uses its default
chain (penalties, dry, top_n_sigma, top_k, typ_p, top_p, min_p, xtc, temperature) with each
sampler's own parameter deciding whether it does anything. Editor plugins send
``{"top_k": 40, "top_p": 0.9, "samplers": ["top_k", "top_p", "infill"]}``.

localspec applies, at every verified position and identically with and without speculation:
penalties, top_k, top_p, min_p, ``infill`` (llama.cpp's own sampler, stateless: see
``localspec.infill_filter``) and temperature, in that order; logit bias, ``ignore_eos`` and a
GBNF ``grammar`` (or ``json_schema``) too. Samplers with state across positions or that
localspec does not implement (dry, xtc, typ_p, top_n_sigma, mirostat, dynatemp, adaptive_p)
are **not applied**: the plan lists them in ``not_applied`` with a note, and the response
says so. Speculation stays on for them: plain decoding would not apply them either, so
turning it off would only make the request slower.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidRequestError
from ..sampling import MASK64, SamplingParams
from .fields import RequestError, get_bool, get_float, get_int, get_str

# localspec's fixed order of the samplers it applies (llama.cpp's default order, infill
# where the plugins put it: after top_p)
APPLIED_ORDER = ("penalties", "top_k", "top_p", "min_p", "infill", "temperature")
# llama.cpp's default chain (common/common.h, common_params_sampling::samplers)
DEFAULT_CHAIN = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
KNOWN = frozenset(DEFAULT_CHAIN) | {"infill", "adaptive_p"}
# one-letter codes (common_sampler_type_to_chr)
_CHARS = {
    "d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "s": "top_n_sigma", "m": "min_p",
    "t": "temperature", "x": "xtc", "i": "infill", "e": "penalties", "a": "adaptive_p",
}  # fmt: skip
_ALIASES = {"nucleus": "top_p", "temp": "temperature", "typ": "typ_p"}


def canonical_sampler_name(name: str) -> str | None:
    """llama.cpp's canonical name of a sampler name or alias (``top-k``, ``topk``, ``temp``,
    ...), or None when unknown."""
    n = name.strip().lower()
    if n in KNOWN:
        return n
    if n in _ALIASES:
        return _ALIASES[n]
    for known in KNOWN:
        if "_" in known and n in (known.replace("_", "-"), known.replace("_", "")):
            return known
    return None


@dataclass
class SamplerFields:
    """The sampling fields of one request, typed; None = absent (the server default applies)."""

    samplers: list[str] | None = None
    unknown_samplers: list[str] = field(default_factory=list)
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None  # -1: a fresh random seed (see get_seed)
    logit_bias: list[tuple[int | str, float]] = field(default_factory=list)
    ignore_eos: bool = False
    grammar: str | None = None
    json_schema: Any = None
    typical_p: float = 1.0
    top_n_sigma: float = -1.0
    dry_multiplier: float = 0.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    mirostat: int = 0
    dynatemp_range: float = 0.0
    accept_threshold_single: float | None = None
    accept_threshold_acc: float | None = None
    draft_memory: bool = True  # False: keep this request out of the drafting memory (localspec extension)


def get_threshold(body: Mapping[str, Any], key: str) -> float | None:
    """A LOSSY acceptance threshold field (``accept_threshold_single`` / ``_acc``): None when
    absent, else a number in (0, 1].

    Raises:
        RequestError: not a number, or outside (0, 1].
    """
    v = get_float(body, key, None) if body.get(key) is not None else None
    if v is not None and not 0.0 < v <= 1.0:
        raise RequestError(f'"{key}" must be in (0, 1] (1 = lossless), got {v}')
    return v


def get_seed(body: Mapping[str, Any]) -> int | None:
    """A request's ``seed`` field: None when absent, -1 for a fresh random seed per request
    (llama.cpp's -1), else a seed in 0..2**64-1, kept whole so that it gives the same text as
    the same seed anywhere else (``localspec generate --seed``, ``Engine.generate``).

    Raises:
        RequestError: not an integer, or outside -1..2**64-1.
    """
    seed = get_int(body, "seed", None)
    if seed is not None and not -1 <= seed <= MASK64:
        raise RequestError(f'"seed" must be in 0..{MASK64}, or -1 for a random seed; got {seed}')
    return seed


def seed_param(seed: int | None, default: int | None) -> int | None:
    """``SamplingParams.seed`` of a ``get_seed`` value: ``default`` (the server's ``--seed``)
    when absent, None (a random seed drawn for the request) for -1."""
    if seed is None:
        return default
    return None if seed < 0 else seed


def parse_sampler_fields(body: Mapping[str, Any]) -> SamplerFields:
    """Read and type-check the sampling fields of a request body.

    Raises:
        RequestError: a field of the wrong type or out of range.
    """
    f = SamplerFields()
    raw = body.get("samplers")
    if raw is not None:
        if isinstance(raw, str):
            names = [_CHARS.get(c) or c for c in raw]
        elif isinstance(raw, list) and all(isinstance(x, str) for x in raw):
            names = list(raw)
        else:
            raise RequestError('"samplers" must be a list of sampler names or a string of sampler letters')
        f.samplers = []
        for n in names:
            c = canonical_sampler_name(n)
            if c is None:
                f.unknown_samplers.append(n)
            else:
                f.samplers.append(c)

    def opt_float(key, lo=None, hi=None):
        return get_float(body, key, None, lo, hi) if body.get(key) is not None else None

    def opt_int(key, lo=None, hi=None):
        return get_int(body, key, None, lo, hi) if body.get(key) is not None else None

    f.temperature = opt_float("temperature", 0.0)
    f.top_k = opt_int("top_k", 0)
    f.top_p = opt_float("top_p", 0.0, 1.0)
    f.min_p = opt_float("min_p", 0.0, 1.0)
    f.repeat_penalty = opt_float("repeat_penalty", 0.0)
    f.repeat_last_n = opt_int("repeat_last_n", -1)
    f.frequency_penalty = opt_float("frequency_penalty")
    f.presence_penalty = opt_float("presence_penalty")
    f.seed = get_seed(body)
    f.logit_bias = parse_logit_bias(body.get("logit_bias"))
    f.ignore_eos = get_bool(body, "ignore_eos", False)
    f.grammar = get_str(body, "grammar", None) or None
    f.json_schema = body.get("json_schema")
    f.typical_p = get_float(body, "typical_p", 1.0)
    f.top_n_sigma = get_float(body, "top_n_sigma", -1.0)
    f.dry_multiplier = get_float(body, "dry_multiplier", 0.0)
    f.xtc_probability = get_float(body, "xtc_probability", 0.0)
    f.xtc_threshold = get_float(body, "xtc_threshold", 0.1)
    f.mirostat = get_int(body, "mirostat", 0, 0, 2)
    f.dynatemp_range = get_float(body, "dynatemp_range", 0.0)
    f.accept_threshold_single = get_threshold(body, "accept_threshold_single")
    f.accept_threshold_acc = get_threshold(body, "accept_threshold_acc")
    f.draft_memory = get_bool(body, "draft_memory", True)
    return f


def parse_logit_bias(raw: Any) -> list[tuple[int | str, float]]:
    """A request's ``logit_bias`` as (token id or text, bias) pairs, from llama.cpp's two forms:
    ``[[token, bias], ...]`` or ``{"token": bias}`` (the OpenAI form); a token is an id or a string
    (all its tokens get the bias); ``false`` bans it.

    Raises:
        RequestError: 400 for another shape, a token that is neither id nor text, a bias that is
            not a number or ``false``.
    """
    if raw is None:
        return []
    if isinstance(raw, Mapping):
        # a key of ASCII digits is a token id (llama.cpp's strtol); any other key is text
        items = [(int(k) if re.fullmatch(r"-?[0-9]+", k) else k, v) for k, v in raw.items()]
    elif isinstance(raw, list):
        items = []
        for el in raw:
            if not (isinstance(el, list) and len(el) == 2):
                raise RequestError('"logit_bias" entries must be [token, bias] pairs')
            items.append((el[0], el[1]))
    else:
        raise RequestError('"logit_bias" must be a list of [token, bias] pairs or an object {token: bias}')
    out = []
    for tok, bias in items:
        if isinstance(tok, bool) or not isinstance(tok, (int, str)):
            raise RequestError('"logit_bias" tokens must be token ids or strings')
        if bias is False:
            val = -math.inf
        elif isinstance(bias, bool) or not isinstance(bias, (int, float)) or math.isnan(bias):
            raise RequestError('"logit_bias" biases must be numbers or false')
        else:
            val = float(bias)
        out.append((tok, val))
    return out


@dataclass
class SamplingPlan:
    """What a request's sampling fields turned into.

    Attributes:
        params: the ``SamplingParams`` the engine applies.
        applied: sampler names in effect, in localspec's order.
        not_applied: samplers the request turned on that localspec cannot apply.
        notes: human-readable remarks for the response (ordering, unknown names, ...).
    """

    params: SamplingParams
    applied: list[str]
    not_applied: list[str]
    notes: list[str]

    def close(self) -> None:
        """Free the llama.cpp sampler of a candidate filter, if any."""
        f = self.params.candidate_filter
        if f is not None:
            f.close()


def resolve_sampling(f: SamplerFields, defaults: SamplingParams, model) -> SamplingPlan:
    """Turn request fields into ``SamplingParams`` with llama.cpp's chain semantics.

    Args:
        f: the parsed fields.
        defaults: the server's sampling defaults (from its command line).
        model: the target ``backend.Model`` (token ids, end-of-generation ids, infill).
    Raises:
        RequestError: a bad logit-bias token, grammar or JSON schema.
    """
    from ..infill_filter import MAX_INFILL_CANDIDATES, InfillFilter

    names = list(f.samplers) if f.samplers is not None else list(DEFAULT_CHAIN)
    notes: list[str] = [f"unknown sampler {n!r} ignored" for n in f.unknown_samplers]
    named = set(names)

    def pick(value, default):
        return default if value is None else value

    kw: dict[str, Any] = {}
    kw["top_k"] = pick(f.top_k, defaults.top_k) if "top_k" in named else 0
    kw["top_p"] = pick(f.top_p, defaults.top_p) if "top_p" in named else 1.0
    kw["min_p"] = pick(f.min_p, defaults.min_p) if "min_p" in named else 0.0
    kw["temperature"] = pick(f.temperature, defaults.temperature) if "temperature" in named else 1.0
    if "penalties" in named:
        kw["repeat_penalty"] = pick(f.repeat_penalty, defaults.repeat_penalty)
        kw["frequency_penalty"] = pick(f.frequency_penalty, defaults.frequency_penalty)
        kw["presence_penalty"] = pick(f.presence_penalty, defaults.presence_penalty)
        kw["penalty_last_n"] = pick(f.repeat_last_n, defaults.penalty_last_n)
    else:
        kw.update(repeat_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0)
    kw["seed"] = seed_param(f.seed, defaults.seed)
    kw["verify"] = defaults.verify
    kw["accept_threshold_single"] = pick(f.accept_threshold_single, defaults.accept_threshold_single)
    kw["accept_threshold_acc"] = pick(f.accept_threshold_acc, defaults.accept_threshold_acc)
    kw["draft_memory"] = f.draft_memory and defaults.draft_memory
    kw["logit_bias"] = _logit_bias(f, model)
    kw["grammar"] = _grammar(f, defaults)

    not_applied: list[str] = []
    if "typ_p" in named and f.typical_p < 1.0:
        not_applied.append("typ_p")
    if "top_n_sigma" in named and f.top_n_sigma > 0.0:
        not_applied.append("top_n_sigma")
    if "dry" in named and f.dry_multiplier > 0.0:
        not_applied.append("dry")
    if "xtc" in named and f.xtc_probability > 0.0 and f.xtc_threshold <= 0.5:
        not_applied.append("xtc")
    if "adaptive_p" in named:
        not_applied.append("adaptive_p")
    if f.mirostat:
        not_applied.append(f"mirostat{'' if f.mirostat == 1 else ' 2'}")
    if "temperature" in named and f.dynatemp_range > 0.0:
        not_applied.append("dynatemp")
    if not_applied:
        notes.append(
            f"not applied (localspec cannot apply them at each position): {', '.join(not_applied)}; "
            "the other samplers were applied"
        )

    use_infill = "infill" in named
    if use_infill and not 1 <= kw["top_k"] <= MAX_INFILL_CANDIDATES:
        use_infill = False
        not_applied.append("infill")
        notes.append(f"infill not applied: it needs top_k in [1, {MAX_INFILL_CANDIDATES}] (plugins send 40)")

    applied = [n for n in APPLIED_ORDER if n in named and (n != "infill" or use_infill)]
    if "penalties" in applied and not (
        kw["repeat_penalty"] != 1.0 or kw["frequency_penalty"] != 0.0 or kw["presence_penalty"] != 0.0
    ):
        applied.remove("penalties")
    in_request_order = [n for n in names if n in applied]
    if in_request_order != applied:
        notes.append(f"samplers applied in localspec's order: {', '.join(applied)}")
    try:
        filt = InfillFilter(model) if use_infill else None
        params = SamplingParams(candidate_filter=filt, **kw)
    except InvalidRequestError as e:
        raise RequestError(str(e)) from None
    return SamplingPlan(params, applied, not_applied, notes)


def resolve_logit_bias(pairs: list[tuple[int | str, float]], model) -> dict[int, float]:
    """``{token id: bias}`` of ``parse_logit_bias``'s pairs; a text's every token gets its bias.

    Raises:
        RequestError: 400 for a token id outside ``model``'s vocabulary.
    """
    bias: dict[int, float] = {}
    for tok, val in pairs:
        ids = model.tokenize(tok, add_special=False) if isinstance(tok, str) else [tok]
        for t in ids:
            if not 0 <= t < model.n_vocab:
                raise RequestError(f'"logit_bias" token id {t} is outside the vocabulary (0..{model.n_vocab - 1})')
            bias[int(t)] = val
    return bias


def _logit_bias(f: SamplerFields, model) -> dict[int, float]:
    bias = resolve_logit_bias(f.logit_bias, model)
    if f.ignore_eos:
        for t in model.eog_ids:
            bias[int(t)] = -math.inf
    return bias


def _grammar(f: SamplerFields, defaults: SamplingParams) -> str | None:
    if f.json_schema is not None:
        import json

        from llama_cpp.llama_grammar import json_schema_to_gbnf

        try:
            schema = f.json_schema if isinstance(f.json_schema, str) else json.dumps(f.json_schema)
            return json_schema_to_gbnf(schema)
        except Exception as e:  # the converter raises plain exceptions on bad schemas
            raise RequestError(f'"json_schema" could not be converted to a grammar: {e}') from None
    return f.grammar if f.grammar is not None else defaults.grammar
