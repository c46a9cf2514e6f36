"""``localspec generate``: one completion, streamed, with statistics."""

from __future__ import annotations

import argparse
import json
import sys

from ..stats import MIN_STEPS_SAVED, no_speedup_reason
from .common import (add_drafter_args, add_memory_args, add_model_args, add_sampling_args, count, make_engine,
                     read_text_file, sampling_from_args)


def register(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate a completion (speculative by default)",
        description="Generate a completion of PROMPT with lossless speculative decoding. "
        "The prompt comes from the argument, --file, or standard input.",
    )
    p.add_argument("prompt", nargs="?", default=None, help="prompt text ('-' = standard input)")
    p.add_argument("-f", "--file", default=None, help="read the prompt from a file")
    p.add_argument("-n", "--max-tokens", type=count, default=256, help="most tokens to generate (default 256)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--special", action="store_true", help="parse special-token text in the prompt")
    p.add_argument("--logprobs", type=int, default=None, metavar="N", help="report log-probs with top-N alternatives")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, finish_reason, stats)")
    p.add_argument(
        "--compare",
        action="store_true",
        help="also decode without speculation (same sampling; runs in the order speculative, plain, plain, "
        "speculative) and report the ratio of the median speeds with the spread of the two pairs' ratios, "
        f"or that there is no speedup to measure when the drafts saved under {MIN_STEPS_SAVED:.0%}% of the decode steps, and "
        "whether the outputs are identical",
    )
    add_drafter_args(p)
    add_sampling_args(p)
    add_model_args(p)
    add_memory_args(p)
    p.set_defaults(func=run)


def read_prompt(a: argparse.Namespace) -> str:
    if a.file:
        if a.prompt is not None:
            raise SystemExit(f"localspec: error: give the prompt as an argument or with --file, not both (got {a.prompt!r:.40} and --file {a.file})")
        text = read_text_file(a.file, "the prompt file")
    elif a.prompt is None or a.prompt == "-":
        if sys.stdin.isatty() and a.prompt is None:
            raise SystemExit("localspec: error: give a prompt, --file FILE, or pipe text to standard input")
        data = sys.stdin.buffer.read()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise SystemExit(f"localspec: error: standard input is not UTF-8 text (byte {e.start})") from None
    else:
        text = a.prompt
    if not text:
        raise SystemExit("localspec: error: the prompt is empty")
    return text


def _summary(stats) -> str:
    s = stats
    lines = [
        f"drafter {s.drafter}: {s.n_generated_tokens} tokens in {s.n_steps} steps, "
        f"{s.tokens_per_s:.1f} tokens/s decode, {s.end_to_end_tokens_per_s:.1f} tokens/s end to end",
        (f"mean acceptance length {s.mean_acceptance_length:.2f} (bonus included), " if s.n_steps else
         "mean acceptance length: no step ran, "  # (0 tokens asked): the stat is >= 1 whenever one did
         ) + f"accepted {s.num_accepted_tokens}/{s.num_draft_tokens} drafted",
        f"prompt {s.n_prompt_tokens} tokens ({s.n_cached_tokens} cached), prefill {s.t_prefill_us / 1e3:.0f} ms; "
        f"draft {s.t_draft_us / 1e3:.0f} ms, decode {s.t_decode_us / 1e3:.0f} ms, verify {s.t_verify_us / 1e3:.0f} ms, "
        f"other {s.t_other_us / 1e3:.0f} ms; seed {s.seed}",
    ]
    if s.lossy:
        lines.append(f"{s.lossy_label}: the output is not exactly the target's distribution")
    return "\n".join(lines)


def _logprob_lines(model, logprobs) -> str:
    """``--logprobs N`` without ``--json``: one line per generated token (its text, log-prob
    under the raw model distribution, and the top-N alternatives)."""

    def piece(t: int) -> str:
        return repr(model.token_bytes(int(t)).decode("utf-8", errors="replace"))

    lines = ["log-probabilities (token: log-prob | top alternatives):"]
    for i, lp in enumerate(logprobs or ()):
        top = ", ".join(f"{piece(t)} {v:.3f}" for t, v in lp.top)
        lines.append(f"{i:4d} {piece(lp.token)}: {lp.logprob:.3f}" + (f" | {top}" if top else ""))
    return "\n".join(lines)


COMPARE_ORDER = ("speculative", "plain", "plain", "speculative")


def _compare(engine, prompt: str, kw: dict, sampling, first) -> dict:
    """``--compare``: decode the prompt again in the order ``COMPARE_ORDER`` (the first
    speculative run is ``first``, the one shown), the KV cache dropped before each run, and
    compare the medians of the decode speeds. The ABBA order puts a steady drift of the
    machine's load equally on both sides; a single plain run after the speculative one (what
    this did before) charged all of it to plain decoding. The repeats keep out of the drafting
    memory (``SamplingParams.draft_memory`` False), which holds the first run's output.

    Returns ``spec`` / ``plain`` (the results), ``ratio`` (median speculative / median plain
    decode tokens/s, None when plain measured 0), ``pair_ratios`` (speculative / plain decode
    tokens/s of each ABBA pair: runs 1 and 2, runs 4 and 3; their spread is what one ratio is
    worth on this machine now), ``no_speedup`` (``stats.no_speedup_reason`` of the speculative
    runs: the drafts saved too few decode steps for any ratio to mean a speed-up, else None),
    ``identical`` (all outputs equal to the first), ``order`` and a one-paragraph ``summary``
    that gives the ratio only when ``no_speedup`` is None.
    """
    import statistics

    # the repeats neither draft from nor write to the drafting memory: the first run's output
    # is in it, and drafting a repeat from it would measure the memory, not the prompt
    from dataclasses import replace

    same_seed = {**kw, "sampling": replace(sampling.with_seed(first.stats.seed), draft_memory=False)}
    runs = {"speculative": [first], "plain": []}
    for what in COMPARE_ORDER[1:]:
        engine.reset()
        runs[what].append(engine.generate(prompt, **same_seed, speculative=what == "speculative"))
    spec_rate = statistics.median(r.stats.tokens_per_s for r in runs["speculative"])
    plain_rate = statistics.median(r.stats.tokens_per_s for r in runs["plain"])
    ratio = spec_rate / plain_rate if plain_rate else None
    pairs = [s.stats.tokens_per_s / p.stats.tokens_per_s for s, p in zip(runs["speculative"], runs["plain"], strict=True)
             if p.stats.tokens_per_s]  # fmt: skip
    no_speedup = no_speedup_reason(*(r.stats for r in runs["speculative"]))
    identical = all(r.token_ids == first.token_ids for rs in runs.values() for r in rs)
    fmt = ", ".join
    spread = f"{min(pairs):.2f}-{max(pairs):.2f}x" if pairs else ""

    if no_speedup is not None:
        saved = sum(r.stats.n_step_tokens - r.stats.n_steps for r in runs["speculative"])
        steps = sum(r.stats.n_step_tokens for r in runs["speculative"])
        verdict = (f"no speedup to measure: {no_speedup} in the speculative runs (they saved {saved} of {steps} "
                   "decode steps)" + (f"; the pairs' ratios {spread} are the machine's noise and the drafting's cost"
                                      if pairs else ""))  # fmt: skip
    elif ratio is not None:
        verdict = f"speed ratio of the medians {ratio:.2f}x" + (f" (pairs {spread})" if pairs else "")
    else:
        verdict = "no speed ratio: plain decoding measured no time"
    summary = (
        f"compared {len(COMPARE_ORDER)} runs in the order {fmt(COMPARE_ORDER)} (same seed, KV cache dropped "
        f"before each): speculative {fmt(f'{r.stats.tokens_per_s:.1f}' for r in runs['speculative'])} tokens/s, "
        f"plain {fmt(f'{r.stats.tokens_per_s:.1f}' for r in runs['plain'])} tokens/s; "
        f"{verdict}; identical output: {identical}"
    )
    return {"spec": runs["speculative"], "plain": runs["plain"], "ratio": ratio, "pair_ratios": pairs,
            "no_speedup": no_speedup, "identical": identical, "order": list(COMPARE_ORDER), "summary": summary}  # fmt: skip


def run(a: argparse.Namespace) -> int:
    prompt = read_prompt(a)
    sampling = sampling_from_args(a, logprobs=a.logprobs)
    engine = make_engine(a, a.drafter, progress=not a.json)
    try:
        kw = dict(max_tokens=a.max_tokens, sampling=sampling, stop=a.stop, parse_special=a.special)
        if a.json:
            result = engine.generate(prompt, **kw)
        else:
            stream = engine.stream(prompt, **kw)
            out = sys.stdout
            for chunk in stream:
                if chunk.text:
                    out.write(chunk.text)
                    out.flush()
            out.write("\n")
            result = stream.result
            print("\n" + _summary(result.stats), file=sys.stderr)
            if result.finish_reason == "length" and len(result.token_ids) < a.max_tokens:
                print(f"localspec: stopped after {len(result.token_ids)} of {a.max_tokens} tokens: the context of "
                      f"{engine.n_ctx} tokens is full (give a larger --n-ctx)", file=sys.stderr)  # fmt: skip
            if a.logprobs is not None:
                print(_logprob_lines(engine.model, result.logprobs), file=sys.stderr)
        cmp = _compare(engine, prompt, kw, sampling, result) if a.compare else None
        if cmp is not None and not a.json:
            print(cmp["summary"], file=sys.stderr)
        if a.json:
            d = result.to_dict()
            d["model"] = str(engine.model.path)
            d["lossy"] = result.stats.lossy
            if cmp is not None:
                plain = cmp["plain"][0]
                d["plain"] = {"token_ids": plain.token_ids, "stats": plain.stats.to_dict()}
                d["identical_to_plain"] = cmp["identical"]
                d["speed_ratio"] = cmp["ratio"]
                d["compare"] = {
                    "order": cmp["order"],
                    "speculative_tokens_per_s": [r.stats.tokens_per_s for r in cmp["spec"]],
                    "plain_tokens_per_s": [r.stats.tokens_per_s for r in cmp["plain"]],
                    "speculative_steps": [r.stats.n_steps for r in cmp["spec"]],
                    "pair_ratios": cmp["pair_ratios"],
                    "no_speedup": cmp["no_speedup"],
                }
            json.dump(d, sys.stdout, ensure_ascii=False)
            sys.stdout.write("\n")
    finally:
        engine.close()
    return 0
