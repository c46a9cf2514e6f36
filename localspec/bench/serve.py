"""``localspec bench serve``: aggregate throughput of ``localspec serve`` with 1, 2, 4, 8
concurrent clients, speculative vs plain batched decoding, in one run.

One in-process server (``--parallel`` = the largest concurrency) on 127.0.0.1; for each
concurrency ``c`` the two modes run back to back (order alternating), each with ``c`` client
threads that send the same Spec-Bench first-turn prompts (``/v1/completions``, T=0) through the
official ``openai`` client. Aggregate tokens/s = completion tokens of all requests / wall time
from the first request to the last answer: it includes every request's prompt prefill. The
decode phase alone comes from the responses' ``timings`` (llama.cpp's fields): per request
``predicted_n / predicted_ms`` (tokens/s from its first to its last token, other requests'
prefills in the same steps included), and the **decode-phase aggregate** = completion tokens /
(sum of ``predicted_ms`` / clients), i.e. the rate while ``clients`` requests decode side by
side. Also reports whether the speculative and plain texts are identical (they must be at T=0).
"""

from __future__ import annotations

import concurrent.futures
import time

from ..sampling import SamplingParams


def run_clients(client, prompts: list[str], n_clients: int, max_tokens: int) -> tuple[float, int, list[str], dict]:
    """Send ``prompts`` from ``n_clients`` threads; returns (seconds, completion tokens, texts,
    phases): ``phases`` = ``prompt_ms`` / ``predicted_ms`` summed over the requests (ms) from
    their ``timings``."""

    def one(p: str):
        # cache_prompt false: each mode prefills its prompts itself (the other mode sent the same ones)
        r = client.completions.create(model="bench", prompt=p, max_tokens=max_tokens, temperature=0,
                                      extra_body={"cache_prompt": False})  # fmt: skip
        t = (r.model_extra or {}).get("timings") or {}
        return r.usage.completion_tokens, r.choices[0].text, float(t.get("prompt_ms", 0.0)), float(t.get("predicted_ms", 0.0))

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(n_clients) as ex:
        res = list(ex.map(one, prompts))
    dt = time.perf_counter() - t0
    phases = {"prompt_ms": sum(r[2] for r in res), "predicted_ms": sum(r[3] for r in res)}
    return dt, sum(r[0] for r in res), [r[1] for r in res], phases


def chat_turns(client, conversations: list[tuple[str, str]], *, reply_tokens: int, turn2_tokens: int = 16,
               log=print) -> list[dict]:  # fmt: skip
    """Two-turn chats through ``/v1/chat/completions`` (T=0): turn 1 (a reply of at most
    ``reply_tokens``), then turn 2 (the first question, the reply, the second question;
    ``turn2_tokens``) twice: with the prompt cache (the server kept
    turn 1's cells) and with ``cache_prompt: false``. Rows ``{prompt_tokens, cached_tokens,
    prompt_ms_cached, prompt_ms_uncached, seconds_cached, seconds_uncached, identical}`` per
    conversation; ``prompt_ms`` is the server's ``timings.prompt_ms`` (from arrival to the
    first decoded token)."""

    def chat(messages, cache: bool, max_tokens: int = turn2_tokens):
        t0 = time.perf_counter()
        r = client.chat.completions.create(model="bench", messages=messages, max_tokens=max_tokens, temperature=0,
                                           extra_body={"cache_prompt": cache})  # fmt: skip
        return r, time.perf_counter() - t0

    rows = []
    for q1, q2 in conversations:
        r1, _ = chat([{"role": "user", "content": q1}], True, reply_tokens)
        msgs = [{"role": "user", "content": q1}, {"role": "assistant", "content": r1.choices[0].message.content},
                {"role": "user", "content": q2}]  # fmt: skip
        hit, dt_hit = chat(msgs, True)
        miss, dt_miss = chat(msgs, False)
        th, tm = hit.model_extra["timings"], miss.model_extra["timings"]
        row = {"prompt_tokens": hit.usage.prompt_tokens, "cached_tokens": hit.usage.prompt_tokens_details.cached_tokens,
               "prompt_ms_cached": th["prompt_ms"], "prompt_ms_uncached": tm["prompt_ms"],
               "seconds_cached": dt_hit, "seconds_uncached": dt_miss,
               "identical": hit.choices[0].message.content == miss.choices[0].message.content}  # fmt: skip
        rows.append(row)
        log(f"chat turn 2: {row['prompt_tokens']} prompt tokens, {row['cached_tokens']} cached: prompt "
            f"{row['prompt_ms_cached']:.0f} ms cached, {row['prompt_ms_uncached']:.0f} ms uncached")  # fmt: skip
    return rows


def bench_serve(engine, prompts: list[str], *, clients=(1, 2, 4, 8), per_client: int = 2, max_tokens: int = 64,
                n_ctx: int = 2048, same_prompts: int | None = None, conversations: list[tuple[str, str]] = (),
                chat_max_tokens: int = 16, repeats: int = 1, prefill_chunk: int | None = None,
                log=print) -> tuple[list[dict], list[dict]]:  # fmt: skip
    """Rows ``{clients, mode, requests, seconds, tokens, tokens_per_s, prompt_ms, predicted_ms,
    decode_tokens_per_s, identical}`` (module docstring), and the ``chat_turns`` rows of
    ``conversations`` (first and second turns; turn 1 decodes ``max_tokens`` tokens, turn 2
    ``chat_max_tokens``).

    Args:
        prompts: the prompt texts, categories interleaved.
        per_client: requests per client thread: concurrency ``c`` sends the first
            ``c * per_client`` prompts (so one client sees only the first ``per_client``).
        same_prompts: instead, every concurrency sends the same first ``same_prompts`` prompts,
            spread over its clients (a fairer comparison across concurrencies).
        prefill_chunk: the server's ``--prefill-chunk`` (default ``PREFILL_CHUNK``).
        repeats: rounds; each round runs every concurrency, both modes in ABBA order (spec,
            plain, plain, spec, ...; each row has its ``repeat``): ``summarize`` takes medians,
            the ratio of a concurrency is the median of its adjacent pairs' ratios, and
            rounds spread every concurrency over the whole run, so that a drift or a burst of
            the host's speed falls on both modes and on every concurrency.
    """
    import openai

    from ..scheduler import PREFILL_CHUNK, BatchScheduler
    from ..server.http import AppThread
    from ..server.openai import OpenAIService, create_serve_app

    sched = BatchScheduler(engine.model, parallel=max(clients), n_ctx=n_ctx, drafter="ngram",
                           cost_model=engine.cost_model, n_threads=engine.ctx.n_threads,
                           prefill_chunk=prefill_chunk or PREFILL_CHUNK).start()  # fmt: skip
    oai = OpenAIService(sched, model_name="bench", sampling=SamplingParams.greedy())
    rows = []
    try:
        with AppThread(create_serve_app(oai, max_body_bytes=1 << 20)) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=3600)
            for rep in range(repeats):  # rounds over every concurrency: a drift of the host falls on all
                for i, c in enumerate(clients):
                    n_req = same_prompts if same_prompts else c * per_client
                    ps = [prompts[j % len(prompts)] for j in range(n_req)]
                    texts = {}
                    for mode in (("spec", "plain") if (i + rep) % 2 == 0 else ("plain", "spec")):
                        oai.speculative = mode == "spec"
                        dt, n, texts[mode], ph = run_clients(client, ps, c, max_tokens)
                        dec = n / (ph["predicted_ms"] / 1e3 / c) if ph["predicted_ms"] > 0 else 0.0
                        rows.append({"clients": c, "mode": mode, "repeat": rep, "requests": len(ps), "seconds": dt,
                                     "tokens": n, "tokens_per_s": n / dt, **ph, "decode_tokens_per_s": dec})  # fmt: skip
                        log(f"clients {c} {mode}: {n} tokens in {dt:.1f} s = {n / dt:.2f} tokens/s "
                            f"(decode phase {dec:.2f} tokens/s, prefill {ph['prompt_ms'] / 1e3:.1f} s in all)")  # fmt: skip
                    same = texts["spec"] == texts["plain"]
                    for r in rows[-2:]:
                        r["identical"] = same
            oai.speculative = True
            chat = chat_turns(client, list(conversations), reply_tokens=max_tokens, turn2_tokens=chat_max_tokens, log=log)
    finally:
        sched.close()
    return rows, chat


def summarize(rows: list[dict]) -> list[dict]:
    """Per concurrency: the median of each mode's runs (``plain`` / ``spec`` tokens/s, and the
    decode-phase rates), ``pair_ratios`` (speculative over plain, per repeat) and ``ratio``
    (their median), ``identical`` (every pair)."""
    import statistics

    out = []
    for c in sorted({r["clients"] for r in rows}):
        rs = [r for r in rows if r["clients"] == c]
        by = {m: sorted((r for r in rs if r["mode"] == m), key=lambda r: r.get("repeat", 0)) for m in ("plain", "spec")}
        pairs = [sp["tokens_per_s"] / pl["tokens_per_s"] for pl, sp in zip(by["plain"], by["spec"])]
        dec_pairs = [sp["decode_tokens_per_s"] / pl["decode_tokens_per_s"] for pl, sp in zip(by["plain"], by["spec"])
                     if pl["decode_tokens_per_s"] > 0]  # fmt: skip
        med = statistics.median
        out.append({
            "clients": c, "requests": rs[0]["requests"], "repeats": len(pairs),
            "plain": med(r["tokens_per_s"] for r in by["plain"]), "spec": med(r["tokens_per_s"] for r in by["spec"]),
            "pair_ratios": pairs, "ratio": med(pairs),
            "decode_plain": med(r["decode_tokens_per_s"] for r in by["plain"]),
            "decode_spec": med(r["decode_tokens_per_s"] for r in by["spec"]),
            "decode_ratio": med(dec_pairs) if dec_pairs else float("nan"),
            "identical": all(r["identical"] for r in rs),
        })  # fmt: skip
    return out


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = summarize(rows)
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, style in (("plain", "o--"), ("spec", "o-")):
        pts = [(r["clients"], r[mode]) for r in summary]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label="speculative (n-gram)" if mode == "spec" else "plain batched")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("aggregate tokens/s")
    n = min(r["repeats"] for r in summary)
    ax.set_title("localspec serve throughput" + (f" (medians of {n} ABBA runs)" if n > 1 else ""))
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
