"""``localspec bench serve``: aggregate throughput of ``localspec serve`` with 1, 2, 4, 8
concurrent clients, plain batched decoding and one or more drafters, in one run.

One in-process server per drafter (``--parallel`` = the largest concurrency) on 127.0.0.1,
plain decoding served by the first one with speculation off; for each concurrency ``c`` the
modes (plain and each drafter) run back to back (``mode_order``), each with ``c`` client
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
import hashlib
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


def texts_digest(texts: list[str]) -> str:
    """SHA-256 (hex) of a run's texts in prompt order (UTF-8, each followed by a NUL byte): equal
    digests, equal texts, without storing them."""
    return hashlib.sha256(b"".join(t.encode() + b"\0" for t in texts)).hexdigest()


def mode_order(drafters: list[str], t: int) -> list[str]:
    """The modes of one concurrency's turn ``t`` (= concurrency index + round): the drafters
    rotated by ``t // 2``, then ``"plain"``; reversed when ``t`` is odd. Two turns in a row
    (forward, then backward) give every mode the same mean position, so a linear drift of the
    host's speed falls on all modes alike; the rotation puts each drafter in each place in turn.
    With one drafter this is ABBA: ``[d, plain]``, ``[plain, d]``, ``[d, plain]``, ...
    (e.g. ``ngram, auto``: ``[ngram, auto, plain]``, ``[plain, auto, ngram]``,
    ``[auto, ngram, plain]``, ``[plain, ngram, auto]``)."""
    k = (t // 2) % len(drafters)
    order = [*drafters[k:], *drafters[:k], "plain"]
    return order if t % 2 == 0 else order[::-1]


def bench_serve(engine, prompts: list[str], *, drafters=(("ngram", {}),), clients=(1, 2, 4, 8), per_client: int = 2,
                max_tokens: int = 64, n_ctx: int = 2048, same_prompts: int | None = None,
                conversations: list[tuple[str, str]] = (), chat_max_tokens: int = 16, repeats: int = 1,
                prefill_chunk: int | None = None, log=print) -> tuple[list[dict], list[dict]]:  # fmt: skip
    """Rows ``{clients, mode, repeat, requests, seconds, tokens, tokens_per_s, prompt_ms,
    predicted_ms, decode_tokens_per_s, texts_sha256, identical}`` (module docstring; ``mode`` is
    ``"plain"`` or a drafter name; ``texts_sha256``: ``texts_digest`` of its texts; a drafter's
    ``identical``: its texts equal plain decoding's in that turn, plain's: every drafter's do),
    and the ``chat_turns`` rows of ``conversations`` (first and second turns, on the first
    drafter's server with speculation on; turn 1 decodes ``max_tokens`` tokens, turn 2
    ``chat_max_tokens``).

    Args:
        engine: supplies the model, the measured cost model and the thread count.
        drafters: ``(name, options)`` pairs (``BatchScheduler``'s ``drafter`` and
            ``drafter_options``), distinct names other than ``"none"``.
        prompts: the prompt texts, categories interleaved.
        per_client: requests per client thread: concurrency ``c`` sends the first
            ``c * per_client`` prompts (so one client sees only the first ``per_client``).
        same_prompts: instead, every concurrency sends the same first ``same_prompts`` prompts,
            spread over its clients (a fairer comparison across concurrencies).
        prefill_chunk: the servers' ``--prefill-chunk`` (default ``PREFILL_CHUNK``).
        repeats: rounds; each round runs every concurrency, its modes in ``mode_order`` (each
            row has its ``repeat``): ``summarize`` takes medians, a drafter's ratio at a
            concurrency is the median of its ratios over plain of the same round, and rounds
            spread every concurrency over the whole run, so that a drift or a burst of the
            host's speed falls on every mode and on every concurrency.

    Raises:
        ValueError: no drafters, a repeated name, or ``"none"``.
        InvalidRequestError / ModelLoadError: a drafter that cannot be made (``BatchScheduler``),
            before any request.
    """
    import contextlib

    import openai

    from ..scheduler import PREFILL_CHUNK, BatchScheduler
    from ..server.http import AppThread
    from ..server.openai import OpenAIService, create_serve_app

    names = [name for name, _ in drafters]
    if not names or len(set(names)) != len(names) or "none" in names or "plain" in names:
        raise ValueError(f"drafters must be distinct drafter names other than none, got {names}")
    rows = []
    with contextlib.ExitStack() as stack:
        servers = {}  # drafter name -> (OpenAIService, openai client)
        for name, options in drafters:
            sched = BatchScheduler(engine.model, parallel=max(clients), n_ctx=n_ctx, drafter=name, drafter_options=options,
                                   cost_model=engine.cost_model, n_threads=engine.ctx.n_threads,
                                   prefill_chunk=prefill_chunk or PREFILL_CHUNK)  # fmt: skip
            stack.callback(sched.close)
            sched.start()
            oai = OpenAIService(sched, model_name="bench", sampling=SamplingParams.greedy())
            srv = stack.enter_context(AppThread(create_serve_app(oai, max_body_bytes=1 << 20)))
            servers[name] = oai, openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=3600)
        for rep in range(repeats):  # rounds over every concurrency: a drift of the host falls on all
            for i, c in enumerate(clients):
                n_req = same_prompts if same_prompts else c * per_client
                ps = [prompts[j % len(prompts)] for j in range(n_req)]
                texts, turn = {}, []
                for mode in mode_order(names, i + rep):
                    oai, client = servers[names[0] if mode == "plain" else mode]
                    oai.speculative = mode != "plain"
                    dt, n, texts[mode], ph = run_clients(client, ps, c, max_tokens)
                    dec = n / (ph["predicted_ms"] / 1e3 / c) if ph["predicted_ms"] > 0 else 0.0
                    turn.append({"clients": c, "mode": mode, "repeat": rep, "requests": len(ps), "seconds": dt,
                                 "tokens": n, "tokens_per_s": n / dt, **ph, "decode_tokens_per_s": dec,
                                 "texts_sha256": texts_digest(texts[mode])})  # fmt: skip
                    log(f"clients {c} {mode}: {n} tokens in {dt:.1f} s = {n / dt:.2f} tokens/s "
                        f"(decode phase {dec:.2f} tokens/s, prefill {ph['prompt_ms'] / 1e3:.1f} s in all)")  # fmt: skip
                same = {m: texts[m] == texts["plain"] for m in names}
                for r in turn:
                    r["identical"] = all(same.values()) if r["mode"] == "plain" else same[r["mode"]]
                rows.extend(turn)
        oai, client = servers[names[0]]
        oai.speculative = True
        chat = chat_turns(client, list(conversations), reply_tokens=max_tokens, turn2_tokens=chat_max_tokens, log=log)
    return rows, chat


def drafter_modes(rows: list[dict]) -> list[str]:
    """The drafter modes of ``rows`` in the order they were given (their first appearance:
    the first turn runs them in that order), e.g. ``["ngram", "auto"]``; an older file's
    speculative rows are the one mode ``"spec"``."""
    return list(dict.fromkeys(r["mode"] for r in rows if r["mode"] != "plain"))


def summarize(rows: list[dict]) -> list[dict]:
    """Per concurrency: ``plain`` and ``decode_plain`` (the medians of plain decoding's
    tokens/s and decode-phase rates), and per drafter under ``drafters[name]``:
    ``tokens_per_s`` and ``decode_tokens_per_s`` (medians), ``pair_ratios`` (over plain of
    the same round, per round) and ``ratio`` (their median), ``decode_ratio`` (likewise),
    ``identical`` (its texts equal plain's in every round); ``identical`` (every mode, every
    round). The first drafter (``drafter``) also fills the keys of the one-drafter summary:
    ``spec``, ``pair_ratios``, ``ratio``, ``decode_spec``, ``decode_ratio``."""
    import statistics

    med = statistics.median
    modes = drafter_modes(rows)
    out = []
    for c in sorted({r["clients"] for r in rows}):
        rs = [r for r in rows if r["clients"] == c]
        plain = {r.get("repeat", 0): r for r in rs if r["mode"] == "plain"}
        per = {}
        for m in modes:
            mine = {r.get("repeat", 0): r for r in rs if r["mode"] == m}
            pairs = [mine[k]["tokens_per_s"] / plain[k]["tokens_per_s"] for k in sorted(mine) if k in plain]
            dec_pairs = [mine[k]["decode_tokens_per_s"] / plain[k]["decode_tokens_per_s"] for k in sorted(mine)
                         if k in plain and plain[k]["decode_tokens_per_s"] > 0]  # fmt: skip
            per[m] = {
                "tokens_per_s": med(r["tokens_per_s"] for r in mine.values()),
                "decode_tokens_per_s": med(r["decode_tokens_per_s"] for r in mine.values()),
                "pair_ratios": pairs, "ratio": med(pairs),
                "decode_ratio": med(dec_pairs) if dec_pairs else float("nan"),
                "identical": all(r["identical"] for r in mine.values()),
            }  # fmt: skip
        first = per[modes[0]]
        out.append({
            "clients": c, "requests": rs[0]["requests"], "repeats": len(first["pair_ratios"]),
            "plain": med(r["tokens_per_s"] for r in plain.values()),
            "decode_plain": med(r["decode_tokens_per_s"] for r in plain.values()),
            "drafters": per, "identical": all(r["identical"] for r in rs),
            "drafter": modes[0], "spec": first["tokens_per_s"], "pair_ratios": first["pair_ratios"],
            "ratio": first["ratio"], "decode_spec": first["decode_tokens_per_s"], "decode_ratio": first["decode_ratio"],
        })  # fmt: skip
    return out


def plot(rows: list[dict], path: str) -> None:
    """Aggregate tokens/s against the concurrency (log 2), one line per mode (plain dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = summarize(rows)
    xs = [r["clients"] for r in summary]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [r["plain"] for r in summary], "o--", label="plain batched")
    for m in drafter_modes(rows):
        label = "speculative (n-gram)" if m == "spec" else f"speculative ({m})"  # "spec": an older file's n-gram rows
        ax.plot(xs, [r["drafters"][m]["tokens_per_s"] for r in summary], "o-", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("aggregate tokens/s")
    n = min(r["repeats"] for r in summary)
    ax.set_title("localspec serve throughput" + (f" (medians of {n} rounds)" if n > 1 else ""))
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
