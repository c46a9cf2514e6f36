"""Bench outputs: ``bench.json``, a Markdown table and a plot."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path


def write_json(path: Path, config: dict, categories: dict, records, extra: dict | None = None) -> None:
    """``bench.json``: ``config``, ``categories``, ``prompts``, and ``extra``'s keys (the LOSSY
    threshold reports: ``lossy``, ``lossy_categories``, ``synthetic_tvd``)."""
    data = {
        "config": config,
        "categories": categories,
        "prompts": [
            {
                "category": r.category,
                "label": r.label,
                "question_id": r.question_id,
                "n_prompt_tokens": r.n_prompt_tokens,
                "identical": r.identical,
                "divergence_index": r.divergence_index,
                "divergence_gap": r.divergence_gap,
                "plain": asdict(r.plain),
                "spec": asdict(r.spec),
                "peers": r.peers,
                "pair_ratios": list(r.pair_ratios),
                **({"spec_lossy": asdict(r.spec_lossy), "lossy_identical": r.lossy_identical}
                   if getattr(r, "spec_lossy", None) is not None else {}),
            }
            for r in records
        ],
        **(extra or {}),
    }
    path.write_text(json.dumps(data, indent=1))


def markdown_table(config: dict, categories: dict) -> str:
    has_peer = any("peers" in c for c in categories.values())
    head = [
        "category",
        "prompts",
        "plain tok/s",
        "spec tok/s",
        "decode ratio",
        "min prompt ratio",
        "end-to-end ratio",
        "mean accept len",
        "identical",
        "host µs/step",
        "decode µs/step",
    ]
    if has_peer:
        head += ["llama.cpp best n-gram ratio (mode)", "its min prompt ratio"]
    lines = [
        f"localspec bench: drafter `{config.get('drafter')}`, {config.get('max_tokens')} new tokens, "
        f"temperature {config.get('temperature')}, model `{Path(str(config.get('model', ''))).name}`, "
        f"{config.get('n_threads')} threads"
        + (" — with a **LOSSY** run (acceptance thresholds, see below)" if config.get("lossy") else ""),
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for cat, c in categories.items():
        row = [
            cat,
            str(c["n_prompts"]),
            f"{c['plain_tokens_per_s']:.1f}",
            f"{c['spec_tokens_per_s']:.1f}",
            f"{c['speedup']:.2f}x",
            f"{c['min_prompt_speedup']:.2f}x ({c['min_prompt_id']})" if "min_prompt_speedup" in c else "-",
            f"{c['speedup_end_to_end']:.2f}x",
            f"{c['mean_acceptance_length']:.2f}",
            f"{100 * c['identical_fraction']:.0f}%",
            f"{c['t_host_us_per_step']:.0f}",
            f"{c['t_decode_us_per_step']:.0f}",
        ]
        if has_peer:
            if "best_peer_mode" in c:
                row.append(f"{c['best_peer_speedup']:.2f}x ({c['best_peer_mode']})")
                row.append(f"{c['best_peer_min_prompt_speedup']:.2f}x" if "best_peer_min_prompt_speedup" in c else "-")
            else:
                row += ["-", "-"]
        lines.append("| " + " | ".join(row) + " |")
    lines += [
        "",
        "min prompt ratio: the lowest per-prompt decode ratio (speculative over plain tokens/s of the "
        "same prompt) in the category, with its question id.",
    ]
    gaps = [g for c in categories.values() for g in c.get("divergence_gaps", [])]
    if gaps:
        lines += ["", f"Divergences from plain decoding: {len(gaps)}; top-2 logit gaps there: " + ", ".join(f"{g:.3f}" for g in gaps)]
    return "\n".join(lines) + "\n"


def plot(path: Path, categories: dict) -> bool:
    """Bar chart of decode ratios (ours and, if measured, llama.cpp's best mode). False when
    matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    cats = list(categories)
    ours = [categories[c]["speedup"] for c in cats]
    peer = [categories[c].get("best_peer_speedup") for c in cats]
    fig, ax = plt.subplots(figsize=(8, 4))
    x = range(len(cats))
    w = 0.38 if any(p is not None for p in peer) else 0.6
    ax.bar([i - (w / 2 if w < 0.5 else 0) for i in x], ours, width=w, label="localspec")
    if any(p is not None for p in peer):
        ax.bar([i + w / 2 for i in x], [p or 0 for p in peer], width=w, label="llama.cpp best n-gram mode")
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xticks(list(x))
    ax.set_xticklabels(cats, rotation=20)
    ax.set_ylabel("decode speed vs plain decoding")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
