"""``localspec bench serve``: aggregate throughput of the OpenAI server with 1/2/4/8 clients,
plain batched decoding and each drafter of ``--drafters`` (``localspec.bench.serve``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .common import add_drafter_option_args, add_model_args, count, drafter_options, drafters_to_compare, make_engine, need_extra


def register(bsub) -> None:
    p = bsub.add_parser(
        "serve",
        help="OpenAI server throughput: 1/2/4/8 concurrent clients, each drafter vs plain batched",
        description="Starts `localspec serve` in process on a free loopback port (one server per drafter) and "
        "sends Spec-Bench first-turn prompts from N client threads (openai client, /v1/completions, T=0), "
        "plain batched decoding and each drafter at each concurrency, in one run. Writes OUT/serve.json and "
        "OUT/serve.png.",
    )
    p.add_argument("--drafters", default="ngram", metavar="NAME[,NAME...]",
                   help="drafters to compare with plain decoding (default ngram; e.g. ngram,auto); the drafter "
                   "option flags below go to the drafters that take them")  # fmt: skip
    p.add_argument("--dataset", required=True, help="Spec-Bench question.jsonl")
    p.add_argument("--clients", default="1,2,4,8", help="concurrencies (default 1,2,4,8)")
    p.add_argument("--per-client", type=int, default=2, help="requests per client (default 2)")
    p.add_argument("--prompts", type=int, default=None, metavar="N",
                   help="send the same N prompts at every concurrency, spread over its clients (default: "
                   "clients x --per-client prompts, so one client sees only --per-client of them)")
    p.add_argument("-n", "--max-tokens", type=count, default=64, help="tokens per request (default 64)")
    p.add_argument("--repeats", type=int, default=1, metavar="R",
                   help="rounds over every concurrency, the modes in alternating, rotating order (ABBA with one "
                   "drafter); rates are medians and a ratio is the median of the rounds' ratios (default 1)")
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="the server's --prefill-chunk (default 64)")
    p.add_argument("--chat-turns", type=int, default=8, metavar="N",
                   help="also run N two-turn chats (the dataset's questions with two turns) and compare the "
                   "second turn's prompt time with and without the prompt cache (default 8; 0 = skip)")
    p.add_argument("--out", default="bench-out", help="output directory (default ./bench-out)")
    add_drafter_option_args(p)
    add_model_args(p)
    p.set_defaults(func=run)


def two_turn_conversations(questions: list[dict], n: int) -> list[tuple[str, str]]:
    """The first two turns of up to ``n`` questions that have two, round-robin over their
    categories (MT-Bench's eight labels in Spec-Bench)."""
    by_cat: dict[str, list[tuple[str, str]]] = {}
    for q in questions:
        if len(q["turns"]) >= 2:
            by_cat.setdefault(q["category"], []).append((q["turns"][0], q["turns"][1]))
    out: list[tuple[str, str]] = []
    i = 0
    while len(out) < n and any(i < len(v) for v in by_cat.values()):
        out.extend(v[i] for v in by_cat.values() if i < len(v))
        i += 1
    return out[:n]


def run(a: argparse.Namespace) -> int:
    import os

    need_extra("openai", "bench", "bench serve")

    from ..bench.dataset import interleave, load_questions, select_prompts
    from ..bench.serve import bench_serve, plot, summarize

    clients = tuple(int(x) for x in a.clients.split(","))
    if a.repeats < 1:
        raise SystemExit(f"localspec: error: --repeats must be at least 1, got {a.repeats}")
    if a.prompts is not None and a.prompts < 1:
        raise SystemExit(f"localspec: error: --prompts must be at least 1, got {a.prompts}")
    names = drafters_to_compare("--drafters", [x.strip() for x in a.drafters.split(",")])
    if len(set(names)) != len(names):
        raise SystemExit(f"localspec: error: --drafters names a drafter twice: {a.drafters}")
    options = drafter_options(a, names)
    n_prompts = a.prompts or max(clients) * a.per_client
    qs = select_prompts(load_questions(a.dataset), None, n_prompts)
    prompts = [p.text for p in interleave(qs)]
    convs = two_turn_conversations(load_questions(a.dataset), a.chat_turns)
    if a.chat_turns and not convs:
        print("localspec: the dataset has no two-turn questions: no chat-turn measurement", file=sys.stderr)
    engine = make_engine(a, None, drafter_flags=False)
    try:
        load = os.getloadavg()
        rows, chat = bench_serve(engine, prompts, drafters=[(n, options[n]) for n in names], clients=clients,
                                 per_client=a.per_client, max_tokens=a.max_tokens, same_prompts=a.prompts,
                                 conversations=convs, repeats=a.repeats, prefill_chunk=a.prefill_chunk,
                                 log=lambda s: print(s, file=sys.stderr))  # fmt: skip
    finally:
        engine.close()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"loadavg_start": load, "loadavg_end": os.getloadavg(), "cpus": os.cpu_count(), "max_tokens": a.max_tokens,
            "per_client": a.per_client, "same_prompts": a.prompts, "repeats": a.repeats,
            "prefill_chunk": a.prefill_chunk, "drafters": names,
            "drafter_options": {n: {k: str(v) for k, v in o.items()} for n, o in options.items()}}  # fmt: skip
    summary = summarize(rows)
    (out / "serve.json").write_text(json.dumps({"meta": meta, "rows": rows, "summary": summary, "chat_turns": chat},
                                               indent=1))  # fmt: skip
    try:
        plot(rows, str(out / "serve.png"))
    except ImportError:
        print("localspec: matplotlib missing: no plot", file=sys.stderr)
    print("| clients | requests | drafter | plain tok/s | speculative tok/s | ratio | pair ratios | decode phase: plain "
          "| speculative | ratio | identical |\n|---|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    for r in summary:
        for name in names:
            d = r["drafters"][name]
            pairs = ", ".join(f"{x:.2f}" for x in d["pair_ratios"])
            print(f"| {r['clients']} | {r['requests']} | {name} | {r['plain']:.2f} | {d['tokens_per_s']:.2f} "
                  f"| {d['ratio']:.2f}x | {pairs} | {r['decode_plain']:.2f} | {d['decode_tokens_per_s']:.2f} "
                  f"| {d['decode_ratio']:.2f}x | {'yes' if d['identical'] else 'NO'} |")  # fmt: skip
    one = next((r for r in summary if r["clients"] == 1), None)
    top = summary[-1]
    if one is not None and top["clients"] > 1:
        rate = {(r["clients"], r["mode"], r["repeat"]): r["tokens_per_s"] for r in rows}
        print()
        for name in names:
            rounds = [rate[top["clients"], name, k] / rate[1, "plain", k] for k in range(a.repeats)]
            print(f"{top['clients']} clients {name} / one client plain: "
                  f"{top['drafters'][name]['tokens_per_s'] / one['plain']:.2f}x (medians); "
                  f"per round {', '.join(f'{x:.2f}' for x in rounds)}")  # fmt: skip
    if chat:
        import statistics

        med = statistics.median
        print(f"\nchat turn 2 ({len(chat)} conversations, T=0): median {med(r['prompt_tokens'] for r in chat):.0f} prompt "
              f"tokens, {med(r['cached_tokens'] for r in chat):.0f} cached; prompt time median "
              f"{med(r['prompt_ms_cached'] for r in chat):.0f} ms with the prompt cache, "
              f"{med(r['prompt_ms_uncached'] for r in chat):.0f} ms without; replies identical: "
              f"{sum(r['identical'] for r in chat)}/{len(chat)}")  # fmt: skip
    print(f"machine load (1-min loadavg) {meta['loadavg_start'][0]:.1f} -> {meta['loadavg_end'][0]:.1f} on {meta['cpus']} CPUs")
    return 0
