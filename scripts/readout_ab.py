"""The lm_head readout (backend/readout.py) against llama.cpp's lm_head, side by side in one run:
for each prompt, plain and speculative decoding on two engines (readout on / off), in an order
that alternates prompt by prompt. Prints tokens per second of the generation loop (prefill
excluded) per category and engine, the readout's speed-up, and whether every output matched.

    python scripts/readout_ab.py [--dataset question.jsonl] [--per-category 5] [-n 128] [--drafter ngram]
    python scripts/readout_ab.py --kernels 1,2 ...   # kernel 2 against kernel 1, both readouts
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict

from localspec import Engine, SamplingParams
from localspec.backend import Model
from localspec.bench.dataset import load_questions, resolve_dataset, select_prompts
from localspec.models import default_model_path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", default="code")
    ap.add_argument("--per-category", type=int, default=5)
    ap.add_argument("-n", "--max-tokens", type=int, default=128)
    ap.add_argument("--drafter", default="ngram")
    ap.add_argument("--json", default=None, help="also write the per-prompt numbers here")
    ap.add_argument("--kernels", default=None, metavar="A,B",
                    help="instead of readout against llama.cpp's lm_head: readout kernel B (columns 'readout') "
                         "against kernel A (columns 'llama.cpp lm_head'), e.g. 1,2 (LOCALSPEC_READOUT_KERNEL)")
    a = ap.parse_args()
    model = Model(default_model_path())
    engines = {}
    saved = {k: os.environ.get(k) for k in ("LOCALSPEC_READOUT", "LOCALSPEC_READOUT_KERNEL")}
    base, other = a.kernels.split(",") if a.kernels else (None, None)
    for mode in ("own", "llama"):  # the engines' target contexts read the variables when made
        os.environ["LOCALSPEC_READOUT"] = mode if a.kernels is None else "own"
        kern = {"own": other, "llama": base}[mode]
        if kern is None:
            os.environ.pop("LOCALSPEC_READOUT_KERNEL", None)
        else:
            os.environ["LOCALSPEC_READOUT_KERNEL"] = kern
        if a.kernels is not None:
            model._readout_verdict = None  # each engine's own check (one asked for kernel 0 also proves it)
        e = Engine(model, drafter=a.drafter, n_ctx=4096)
        engines[mode] = e
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    assert engines["own"].ctx.readout is not None, engines["own"].ctx.readout_off_reason
    if a.kernels is None:
        assert engines["llama"].ctx.readout is None
    else:
        got = (engines["llama"].ctx.readout.kernel, engines["own"].ctx.readout.kernel)
        assert got == (int(base), int(other)), f"kernels {got}: not both proved on this CPU"
        print(f"kernel {base} (columns 'llama.cpp lm_head') against kernel {other} (columns 'readout')")
    prompts = select_prompts(load_questions(resolve_dataset(a.dataset)), None, a.per_category)
    greedy = SamplingParams.greedy()
    rows = []
    sums = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))  # cat -> key -> [tokens, seconds]
    t0 = time.time()
    for i, p in enumerate(prompts):
        order = ("own", "llama") if i % 2 == 0 else ("llama", "own")
        out = {}
        for mode in order:
            for spec in (False, True):
                r = engines[mode].generate(p.text, max_tokens=a.max_tokens, sampling=greedy, speculative=spec)
                s = r.stats
                loop_s = (s.t_draft_us + s.t_decode_us + s.t_verify_us + s.t_other_us) / 1e6
                key = f"{mode}/{'spec' if spec else 'plain'}"
                out[key] = (list(r.token_ids), len(r.token_ids), loop_s)
                for cat in (p.category, "all"):
                    sums[cat][key][0] += len(r.token_ids)
                    sums[cat][key][1] += loop_s
        same = len({tuple(v[0]) for v in out.values()}) == 1
        rows.append({"category": p.category, "id": p.question_id, "identical": same,
                     **{k: {"tokens": v[1], "seconds": v[2]} for k, v in out.items()}})  # fmt: skip
        print(f"{i + 1}/{len(prompts)} {p.category} identical={same}", flush=True)
    print(f"\n{len(prompts)} prompts in {time.time() - t0:.0f} s; load average {os.getloadavg()[0]:.2f}\n")
    la, lb = ("llama.cpp lm_head", "readout") if a.kernels is None else (f"kernel {base}", f"kernel {other}")
    print(f"| category | plain, {la} | plain, {lb} | spec, {la} | spec, {lb} | {lb} speed-up plain / spec | identical |")
    print("|---|---|---|---|---|---|---|")
    for cat in [c for c in sums if c != "all"] + ["all"]:
        v = sums[cat]
        tps = {k: v[k][0] / v[k][1] for k in v}
        ident = sum(r["identical"] for r in rows if cat in ("all", r["category"]))
        n = sum(1 for r in rows if cat in ("all", r["category"]))
        print(f"| {cat} | {tps['llama/plain']:.1f} | {tps['own/plain']:.1f} | {tps['llama/spec']:.1f} | {tps['own/spec']:.1f} | "
              f"{tps['own/plain'] / tps['llama/plain']:.2f}x / {tps['own/spec'] / tps['llama/spec']:.2f}x | {ident}/{n} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    for e in engines.values():
        e.close()


if __name__ == "__main__":
    main()
