"""The recipe of the EAGLE-3 head shipped for the default model (models/heads/), as one command.

    python scripts/head_corpus.py corpus                  # man pages + /usr/share/doc, as text
    python scripts/train_default_head.py --corpus corpus --work head-work --out head.gguf

Records three data sets with the target (features of layers 2, 9, 15 and its top-8 next
tokens; mostly self-distillation: greedy continuations the target writes from prompts cut
at random places of the corpus), then trains one head on all of them and writes the GGUF.
Everything is resumable: rerun the same command after an interruption. ``--train-only``
trains on the shards already recorded (the shipped head was trained on a part of set 3:
see docs/eagle3-training.md for the exact token counts, wall times and accuracies).
Needs the [train] extra; nothing here reads the Spec-Bench questions.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

LAYERS = (2, 9, 15)

# (folder, stdlib first?, plan arguments): text chunks of the corpus + self-distilled
# continuations (the order of the sources matters: documents are drawn in a seeded order)
DATA_SETS = [
    ("set1", True, dict(max_tokens=12288, self_distill=96, prompt_tokens=48, gen_tokens=192, shard_tokens=12000, seed=0)),
    ("set2", False, dict(max_tokens=8192, self_distill=256, prompt_tokens=64, gen_tokens=160, shard_tokens=12000, seed=1)),
    ("set3", False, dict(max_tokens=4096, self_distill=1024, prompt_tokens=64, gen_tokens=160, shard_tokens=12000, seed=2)),
]


def main() -> None:
    from localspec.models import default_model_path
    from localspec.models.eagle3_data import prepare_data, shard_paths, stdlib_sources
    from localspec.models.eagle3_train import TrainConfig, train_eagle3

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", required=True, help="folder written by scripts/head_corpus.py")
    ap.add_argument("--work", required=True, help="data shards and checkpoints (resumable)")
    ap.add_argument("--out", required=True, help="head GGUF to write")
    ap.add_argument("--steps", type=int, default=2400)
    ap.add_argument("--train-only", action="store_true", help="train on the shards recorded so far")
    a = ap.parse_args()

    target = default_model_path()
    work = Path(a.work)
    corpus = [Path(a.corpus) / "doc", Path(a.corpus) / "man"]
    shards = []
    t0 = time.perf_counter()
    for name, stdlib_first, plan in DATA_SETS:
        sources = [*stdlib_sources(), *corpus] if stdlib_first else [*corpus, *stdlib_sources()]
        d = work / name
        if a.train_only:
            shards += shard_paths(d)
        else:
            shards += prepare_data(target, d, sources, LAYERS, topk=8, n_seq=32, **plan)
    t_data = time.perf_counter() - t0
    cfg = TrainConfig(
        steps=a.steps, batch=8, seq_len=128, unroll=4, lr=5e-4, warmup=50, vocab_size=8192,
        log_every=50, ckpt_every=200, loss_frac=0.25,
    )  # fmt: skip
    r = train_eagle3(target, shards, work / "train", a.out, cfg, target_layers=LAYERS)
    print(json.dumps(dict(
        out=str(r.gguf), size_mib=round(r.gguf.stat().st_size / 2**20, 2), shards=len(shards),
        train_tokens=r.n_train_tokens, val_accuracy=r.val_accuracy, train_accuracy=r.train_accuracy,
        vocab_coverage=r.vocab_coverage, t_data_s=round(t_data), t_train_s=round(r.wall_s),
    )))  # fmt: skip


if __name__ == "__main__":
    main()
