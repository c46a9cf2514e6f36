"""``localspec generate``: one completion, streamed, with statistics."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .common import add_drafter_args, add_model_args, add_sampling_args, make_engine, sampling_from_args


def register(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate a completion (speculative by default)",
        description="Generate a completion of PROMPT with lossless speculative decoding. "
        "The prompt comes from the argument, --file, or standard input.",
    )
    p.add_argument("prompt", nargs="?", default=None, help="prompt text ('-' = standard input)")
    p.add_argument("-f", "--file", default=None, help="read the prompt from a file")
    p.add_argument("-n", "--max-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--special", action="store_true", help="parse special-token text in the prompt")
    p.add_argument("--logprobs", type=int, default=None, metavar="N", help="report log-probs with top-N alternatives")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, finish_reason, stats)")
    p.add_argument(
        "--compare",
        action="store_true",
        help="also decode without speculation (same sampling) and report the speed ratio and whether "
        "the outputs are identical",
    )
    add_drafter_args(p)
    add_sampling_args(p)
    add_model_args(p)
    p.set_defaults(func=run)


def read_prompt(a: argparse.Namespace) -> str:
    if a.file:
        try:
            text = Path(a.file).read_text()
        except OSError as e:
            raise SystemExit(f"localspec: error: cannot read the prompt file: {e}") from None
    elif a.prompt is None or a.prompt == "-":
        if sys.stdin.isatty() and a.prompt is None:
            raise SystemExit("localspec: error: give a prompt, --file FILE, or pipe text to standard input")
        text = sys.stdin.read()
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
        f"mean acceptance length {s.mean_acceptance_length:.2f} (bonus included), "
        f"accepted {s.num_accepted_tokens}/{s.num_draft_tokens} drafted",
        f"prompt {s.n_prompt_tokens} tokens ({s.n_cached_tokens} cached), prefill {s.t_prefill_us / 1e3:.0f} ms; "
        f"draft {s.t_draft_us / 1e3:.0f} ms, decode {s.t_decode_us / 1e3:.0f} ms, verify {s.t_verify_us / 1e3:.0f} ms, "
        f"other {s.t_other_us / 1e3:.0f} ms; seed {s.seed}",
    ]
    return "\n".join(lines)


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
        plain = None
        if a.compare:
            engine.reset()
            # same seed: the plain run must give the same text (up to numerical near-ties)
            plain = engine.generate(prompt, **{**kw, "sampling": sampling.with_seed(result.stats.seed)}, speculative=False)
            ratio = result.stats.tokens_per_s / plain.stats.tokens_per_s if plain.stats.tokens_per_s else 0.0
            if not a.json:
                print(
                    f"plain decoding: {plain.stats.tokens_per_s:.1f} tokens/s; speed ratio {ratio:.2f}x; "
                    f"identical output: {plain.token_ids == result.token_ids}",
                    file=sys.stderr,
                )
        if a.json:
            d = result.to_dict()
            d["model"] = str(engine.model.path)
            if plain is not None:
                d["plain"] = {"token_ids": plain.token_ids, "stats": plain.stats.to_dict()}
                d["identical_to_plain"] = plain.token_ids == result.token_ids
                d["speed_ratio"] = (
                    result.stats.tokens_per_s / plain.stats.tokens_per_s if plain.stats.tokens_per_s else None
                )
            json.dump(d, sys.stdout, ensure_ascii=False)
            sys.stdout.write("\n")
    finally:
        engine.close()
    return 0
