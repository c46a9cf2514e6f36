"""Derive the n-gram drafter's prior acceptance rates from text that is NOT the evaluation set.

Prompts are built from the docstrings of Python standard-library modules (present on every
machine): "summarise this", "continue this", question/answer lists, code. Each prompt is
generated greedily with the n-gram drafter; every candidate node whose parent the target
reached is recorded with its bucket and outcome (the drafter's own ``observe``). The
per-bucket rates, shrunk towards the current priors for thin buckets, are printed as a
Python table to paste into ``localspec/drafters/ngram.py``.

    python scripts/calibrate_ngram_priors.py [--prompts 40] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import importlib
import inspect

import numpy as np

from localspec import Engine, SamplingParams
from localspec.drafters import ngram as ngram_mod

MODULES = [
    "json", "argparse", "collections", "functools", "itertools", "pathlib", "subprocess", "logging",
    "csv", "datetime", "decimal", "fractions", "heapq", "bisect", "textwrap", "string", "re",
    "shutil", "tempfile", "zipfile", "tarfile", "sqlite3", "threading", "queue", "asyncio",
    "unittest", "doctest", "pickle", "copy", "enum", "dataclasses", "typing", "statistics",
    "random", "math", "hashlib", "hmac", "secrets", "base64", "gzip",
]  # fmt: skip


def prompts(n: int) -> list[str]:
    out = []
    for i, name in enumerate(MODULES):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        doc = (inspect.getdoc(mod) or "").strip()
        if len(doc) < 200:
            continue
        doc = doc[:2500]
        kind = i % 4
        if kind == 0:
            out.append(f"{doc}\n\nSummarize the text above in a few sentences.\n\nSummary:")
        elif kind == 1:
            out.append(doc[:800])
        elif kind == 2:
            out.append(f"Question: What does the Python module {name} do?\nAnswer:")
        else:
            src = inspect.getsource(mod)[:1200]
            out.append(src)
        if len(out) >= n:
            break
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=128)
    a = ap.parse_args()
    engine = Engine(drafter="ngram")
    tracker = engine.drafter.tracker
    recs: list[tuple[int, bool]] = []
    orig = tracker.record

    def record(bucket, accepted):
        recs.append((bucket, accepted))
        orig(bucket, accepted)

    tracker.record = record
    for p in prompts(a.prompts):
        engine.reset()
        engine.generate(p, max_tokens=a.max_tokens, sampling=SamplingParams.greedy())
    r = np.array(recs, dtype=np.int64)
    prior = ngram_mod._PRIOR.copy()
    n_buckets = prior.size
    n = np.bincount(r[:, 0], minlength=n_buckets)
    acc = np.bincount(r[:, 0], weights=r[:, 1], minlength=n_buckets)
    k = 10.0  # shrink thin buckets towards the old prior
    new = (acc + k * prior) / (n + k)
    print(f"# {len(recs)} observations from {a.prompts} prompts")
    print("_PRIOR = np.array(\n    [")
    for lb in range(ngram_mod._N_LEN):
        row = new[lb * ngram_mod._N_RANK : (lb + 1) * ngram_mod._N_RANK]
        cnt = n[lb * ngram_mod._N_RANK : (lb + 1) * ngram_mod._N_RANK]
        print("        [" + ", ".join(f"{v:.2f}" for v in row) + f"],  # match >= {ngram_mod._LEN_EDGES[lb]}, n={cnt.tolist()}")
    print("    ]\n).ravel()")


if __name__ == "__main__":
    main()
