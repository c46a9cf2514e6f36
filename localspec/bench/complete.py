"""Benchmarks of ``localspec complete`` through its HTTP server, as an editor uses it.

**Keystroke latency** (``bench_latency``): a ~2,000-token prefix of a source file, sent as
llama.vim sends it (lines above the cursor in ``input_prefix``, the current line in
``prompt``) with ``n_predict`` 16; then the same request with only the last line changed
(its second half replaced).
The first request prefills everything (its cache is cleared first); the second reuses the
KV cache of the common prefix and prefills only the changed line. Both generate exactly
``n_predict`` tokens (greedy, ``ignore_eos``), so the difference is the prompt work. Times
are wall-clock from sending the request to receiving the whole response.

**Single-line infilling** (``bench_humaneval``): HumanEval single-line infilling tasks
(Bavarian et al. 2022) sent to ``/infill`` with speculation and without it (greedy, empty
cache each time, alternating which goes first). Reported: whether the texts are identical
(and, where not, the plain run's top-2 logit gap at the first difference), the decode speed
ratio (generated tokens / generation time, prefill excluded, as llama.cpp reports
``predicted_per_second``), the end-to-end ratio, and acceptance.
"""

from __future__ import annotations

import gzip
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from .specbench import divergence, top2_gap

GREEDY = {"samplers": ["temperature"], "temperature": 0.0}


def llama_vim_request(prefix: str, line: str, suffix: str, n_predict: int) -> dict:
    """llama.vim's FIM request (autoload/llama.vim), greedy and with a fixed length."""
    return {
        "id_slot": 0,
        "input_prefix": prefix,
        "input_suffix": suffix,
        "input_extra": [],
        "prompt": line,
        "n_predict": n_predict,
        "stop": [],
        "n_indent": 0,
        "stream": False,
        "cache_prompt": True,
        "t_max_prompt_ms": 500,
        "t_max_predict_ms": 0,
        "ignore_eos": True,
        **GREEDY,
    }


def split_source(text: str, tokenize, n_tokens: int) -> tuple[str, str, str]:
    """(lines above the cursor, the cursor's line up to its middle, the lines below): the
    first lines of ``text`` making about ``n_tokens`` tokens."""
    lines = text.splitlines(keepends=True)
    taken, n = [], 0
    for ln in lines:
        if n >= n_tokens and ln.strip():
            break
        taken.append(ln)
        n += len(tokenize(ln))
    if len(taken) < 2:
        raise ValueError(f"the prefix file is too short for {n_tokens} tokens")
    cur = taken[-1].rstrip("\n")
    below = "".join(lines[len(taken) : len(taken) + 20])
    return "".join(taken[:-1]), cur[: max(1, len(cur) // 2)], below


@dataclass
class LatencyPair:
    """One first request and its edited repeat: wall-clock times (client side) and the
    server's own timings (prompt processing, generation)."""

    t_first_ms: float
    t_second_ms: float
    prompt_tokens: int
    first_prompt_n: int
    second_prompt_n: int
    second_cache_n: int
    first_prompt_ms: float
    first_predicted_ms: float
    second_prompt_ms: float
    second_predicted_ms: float

    @property
    def ratio(self) -> float:
        return self.t_second_ms / self.t_first_ms


def _post(client: httpx.Client, body: dict) -> tuple[dict, float]:
    t0 = time.perf_counter()
    r = client.post("/infill", json=body)
    t_ms = (time.perf_counter() - t0) * 1e3
    r.raise_for_status()
    return r.json(), t_ms


def bench_latency(url: str, text: str, tokenize, *, n_prefix_tokens: int = 2000, n_predict: int = 16,
                  repeats: int = 3) -> dict:  # fmt: skip
    """First request vs. the same request with its last line changed (see module docstring)."""
    prefix, line, suffix = split_source(text, tokenize, n_prefix_tokens)
    changed = line[: len(line) // 2] + "value_2 = 0"  # the line's end replaced, as an edit does
    pairs = []
    with httpx.Client(base_url=url, timeout=600) as c:
        for _ in range(repeats):
            first, t1 = _post(c, {**llama_vim_request(prefix, line, suffix, n_predict), "cache_prompt": False})
            second, t2 = _post(c, llama_vim_request(prefix, changed, suffix, n_predict))
            f, s = first["timings"], second["timings"]
            pairs.append(
                LatencyPair(
                    t1, t2, first["tokens_evaluated"], f["prompt_n"], s["prompt_n"], s["cache_n"],
                    f["prompt_ms"], f["predicted_ms"], s["prompt_ms"], s["predicted_ms"],
                )  # fmt: skip
            )
    ratios = [p.ratio for p in pairs]
    return {
        "n_prefix_tokens_asked": n_prefix_tokens,
        "prompt_tokens": pairs[0].prompt_tokens,
        "n_predict": n_predict,
        "t_first_ms_median": statistics.median(p.t_first_ms for p in pairs),
        "t_second_ms_median": statistics.median(p.t_second_ms for p in pairs),
        "ratio_median": statistics.median(ratios),
        "ratio_max": max(ratios),
        "pairs": [{**asdict(p), "ratio": p.ratio} for p in pairs],
    }


def load_humaneval_infilling(path: str | Path) -> list[dict]:
    """Tasks of a HumanEval infilling JSONL(.gz) file (task_id, prompt, suffix, canonical_solution)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def spread(items: list, n: int) -> list:
    """``n`` items evenly spaced over the list (all of them when n >= len)."""
    if n >= len(items):
        return list(items)
    step = len(items) / n
    return [items[int(i * step)] for i in range(n)]


@dataclass
class TaskRecord:
    task_id: str
    prompt_tokens: int
    identical: bool
    plain_n: int
    spec_n: int
    plain_ms: float  # generation time (predicted_ms)
    spec_ms: float
    plain_wall_ms: float
    spec_wall_ms: float
    draft_n: int
    draft_n_accepted: int
    spec_steps: int
    line_exact: bool  # the first generated line equals the canonical one
    divergence_index: int | None = None
    divergence_gap: float | None = None
    extra: dict = field(default_factory=dict)


def bench_humaneval(url: str, service, tasks: list[dict], *, n_predict: int = 48, progress=None) -> dict:
    """Speculative vs. plain ``/infill`` on ``tasks`` (see module docstring)."""
    records: list[TaskRecord] = []
    with httpx.Client(base_url=url, timeout=600) as c:
        for i, t in enumerate(tasks):
            body = {
                "input_prefix": t["prompt"], "input_suffix": t["suffix"], "prompt": "", "n_predict": n_predict,
                "cache_prompt": False, "return_tokens": True, **GREEDY,
            }  # fmt: skip
            runs: dict[str, tuple[dict, float]] = {}
            for kind in ("plain", "spec") if i % 2 == 0 else ("spec", "plain"):
                runs[kind] = _post(c, {**body, "speculative": kind == "spec"})
            (plain, p_wall), (spec, s_wall) = runs["plain"], runs["spec"]
            div = divergence(plain["tokens"], spec["tokens"])
            canonical = t["canonical_solution"].strip("\n").split("\n")[0].strip()
            rec = TaskRecord(
                task_id=t["task_id"],
                prompt_tokens=spec["tokens_evaluated"],
                identical=div is None,
                plain_n=plain["timings"]["predicted_n"],
                spec_n=spec["timings"]["predicted_n"],
                plain_ms=plain["timings"]["predicted_ms"],
                spec_ms=spec["timings"]["predicted_ms"],
                plain_wall_ms=p_wall,
                spec_wall_ms=s_wall,
                draft_n=spec["timings"].get("draft_n", 0),
                draft_n_accepted=spec["timings"].get("draft_n_accepted", 0),
                spec_steps=spec["localspec"]["n_steps"],
                line_exact=spec["content"].lstrip("\n").split("\n")[0].strip() == canonical,
            )
            if div is not None and div < len(plain["tokens"]):
                rec.divergence_index = div
                rec.divergence_gap = service.call(lambda e, t=t, p=plain: _gap_at(e, t, p["tokens"][:div]))
            records.append(rec)
            if progress is not None:
                progress(i + 1, len(tasks), rec)
    return summarize_humaneval(records)


def _gap_at(engine, task: dict, generated: list[int]) -> float:
    from ..server.prompt import build_infill_prompt

    b = build_infill_prompt(engine.model, task["prompt"], task["suffix"], "", [], n_ctx=engine.n_ctx, n_predict=0)
    engine.reset()
    return top2_gap(engine, b.tokens + generated)


def summarize_humaneval(records: list[TaskRecord]) -> dict:
    pn, sn = sum(r.plain_n for r in records), sum(r.spec_n for r in records)
    p_rate = 1e3 * pn / sum(r.plain_ms for r in records)
    s_rate = 1e3 * sn / sum(r.spec_ms for r in records)
    dn, da = sum(r.draft_n for r in records), sum(r.draft_n_accepted for r in records)
    steps = sum(r.spec_steps for r in records)
    return {
        "n_tasks": len(records),
        "identical": sum(r.identical for r in records),
        "divergences": [
            {"task_id": r.task_id, "index": r.divergence_index, "top2_gap": r.divergence_gap}
            for r in records
            if not r.identical
        ],
        "plain_tokens_per_s": p_rate,
        "spec_tokens_per_s": s_rate,
        "speedup": s_rate / p_rate,
        "speedup_end_to_end": sum(r.plain_wall_ms for r in records) / sum(r.spec_wall_ms for r in records),
        "num_draft_tokens": dn,
        "num_accepted_tokens": da,
        "acceptance_rate": da / dn if dn else 0.0,
        "mean_acceptance_length": sn / steps if steps else 0.0,
        "line_exact_matches": sum(r.line_exact for r in records),
        "tasks": [asdict(r) for r in records],
    }
