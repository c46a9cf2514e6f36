"""``localspec train-eagle3``: record target features from text (and self-distillation), train
an EAGLE-3 head in torch, export it as a GGUF the eagle3 drafter loads (docs/eagle3-training.md)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser(
        "train-eagle3",
        help="train an EAGLE-3 head for a GGUF target from your text files (needs the [train] extra)",
        description="Records the target's features and next-token targets on --data (text/code files or "
        "folders) and on greedy continuations the target writes from prompts cut from them "
        "(--self-distill N), then trains an EAGLE-3 head (training-time test, reduced draft vocabulary) and "
        "writes it to --out. Data shards and checkpoints go to --data-dir; rerunning resumes.",
    )
    p.add_argument("--target", default="default", help="target GGUF ('default' = the embedded model)")
    p.add_argument("--data", nargs="+", default=[], metavar="PATH",
                   help="text/code files or folders; 'stdlib' = the Python standard library's sources")  # fmt: skip
    p.add_argument("--self-prompts", type=int, default=0, metavar="N",
                   help="N chat- and code-like prompts the target writes itself (continuing numbered lists "
                   "of questions and tasks, seeded by --seed), answered by the target in the chat format")  # fmt: skip
    p.add_argument("--self-prompt-tokens", type=int, default=160, help="tokens per list continuation of --self-prompts")
    p.add_argument("--out", required=True, help="head GGUF to write")
    p.add_argument("--data-dir", default=None, help="shards, checkpoint and log (default: OUT.work/); reruns resume")
    p.add_argument("--text-tokens", type=int, default=100_000, help="corpus tokens recorded as they are")
    p.add_argument("--self-distill", type=int, default=200, metavar="N", help="prompts the target continues")
    p.add_argument("--prompt-tokens", type=int, default=64, help="tokens per self-distillation prompt")
    p.add_argument("--gen-tokens", type=int, default=256, help="tokens the target writes per prompt")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per recorded text chunk")
    p.add_argument("--shard-tokens", type=int, default=32768, help="approximate tokens per data shard")
    p.add_argument("--topk", type=int, default=8, help="target next-token candidates stored per position")
    p.add_argument("--layers", default=None, help="target layer ids, e.g. 2,9,15 (default: low/middle/high)")
    p.add_argument("--steps", type=int, default=2000, help="optimiser steps")
    p.add_argument("--batch", type=int, default=8, help="windows per step")
    p.add_argument("--window", type=int, default=256, help="tokens per training window")
    p.add_argument("--unroll", type=int, default=4, help="training-time-test depth")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--loss-frac", type=float, default=0.25, help="fraction of positions scored per step (speed)")
    p.add_argument("--vocab-size", type=int, default=8192, help="draft vocabulary size")
    p.add_argument("--n-ff", type=int, default=1024, help="feed-forward size of the head")
    p.add_argument("--matrix-type", default="q8_0", choices=["q8_0", "f16", "f32"], help="storage of the head's matrices")
    p.add_argument("--device", default="auto", help="cpu, cuda, mps or auto")
    p.add_argument("--no-bf16", action="store_true", help="train in float32 (default: bfloat16 autocast)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-only", action="store_true", help="record the data and stop")
    p.add_argument("--max-shards", type=int, default=None, help="record and train on only the first N shards of the plan")
    p.add_argument("--n-seq", type=int, default=32, help="self-distillation sequences generated together")
    p.add_argument("--more-data", nargs="*", default=[], metavar="DIR",
                   help="also train on the shards of these folders (other --data-dir runs' data/ folders)")  # fmt: skip
    p.add_argument("--from-usage", default=None, metavar="DIR",
                   help="continue training a head (--head, default: the shipped one) on what chat/serve "
                   "--record-usage DIR recorded: the target's features and draft-vocabulary targets are "
                   "recorded over those tokens first (teacher-forced); --data and --self-prompts are not used")  # fmt: skip
    p.add_argument("--head", default=None, metavar="GGUF",
                   help="with --from-usage: the head to continue (default: the head shipped for the target)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run_train)


def _sources(paths: list[str]) -> list:
    from ..models.training.eagle3_data import stdlib_sources

    out = []
    for p in paths:
        out.extend(stdlib_sources() if p == "stdlib" else [Path(p)])
    return out


def run_train(a: argparse.Namespace) -> int:
    try:
        import torch  # noqa: F401
    except ImportError:
        raise SystemExit("localspec: error: train-eagle3 needs torch: pip install 'localspec[train]'") from None
    from ..backend import check_gguf_file
    from ..models import resolve_model
    from ..models.training.eagle3_data import prepare_data, shard_paths
    from ..models.eagle3_gguf import default_target_layers
    from ..models.training.eagle3_train import train_eagle3

    if a.self_prompts < 0:
        raise SystemExit(f"localspec: error: --self-prompts must be >= 0, got {a.self_prompts}")
    if not a.data and a.self_prompts <= 0 and not a.from_usage:
        raise SystemExit("localspec: error: train-eagle3 needs --data PATH..., --self-prompts N or --from-usage DIR")
    if a.head and not a.from_usage:
        raise SystemExit("localspec: error: --head continues a head on --from-usage DIR; give both")
    ignored = [f for f, v in (("--data", a.data), ("--self-prompts", a.self_prompts > 0), ("--more-data", a.more_data)) if v]
    if a.from_usage and ignored:
        raise SystemExit(f"localspec: error: --from-usage trains on the recorded usage only, not on {', '.join(ignored)}: "
                         "leave them out, or train on them in a run without --from-usage")  # fmt: skip
    target = check_gguf_file(resolve_model(a.target))
    if a.from_usage:
        return _train_from_usage(a, target)
    work = Path(a.data_dir or f"{a.out}.work")
    if a.layers:
        layers = tuple(int(x) for x in a.layers.split(","))
    else:
        from ..models.gguf_index import GGUFIndex

        v = GGUFIndex(target).values
        layers = default_target_layers(int(v[f"{v['general.architecture']}.block_count"]))
    try:
        shards = prepare_data(
            target, work / "data", _sources(a.data), layers,
            max_tokens=a.text_tokens, self_distill=a.self_distill, prompt_tokens=a.prompt_tokens,
            gen_tokens=a.gen_tokens, seq_len=a.seq_len, shard_tokens=a.shard_tokens, seed=a.seed, topk=a.topk, n_seq=a.n_seq,
            max_shards=a.max_shards, self_prompts=a.self_prompts, self_prompt_tokens=a.self_prompt_tokens,
        )  # fmt: skip
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"localspec: error: {e}") from None
    if a.data_only:
        print(f"{len(shards)} shards in {work / 'data'}")
        return 0
    cfg = _config(a)
    for d in a.more_data:
        more = shard_paths(d)
        if not more:
            raise SystemExit(f"localspec: error: no shards in {d}")
        shards = shards + more
    res = train_eagle3(target, shards, work, a.out, cfg, target_layers=layers, matrix_dtype=a.matrix_type)
    return _report(a, res)


def _config(a: argparse.Namespace):
    from ..models.training.eagle3_train import TrainConfig

    return TrainConfig(
        steps=a.steps, batch=a.batch, seq_len=a.window, unroll=a.unroll, lr=a.lr, vocab_size=a.vocab_size,
        device=a.device, bf16=not a.no_bf16, seed=a.seed, loss_frac=a.loss_frac,
        head=dict(n_head=4, n_head_kv=1, head_dim=128, n_ff=a.n_ff),
    )  # fmt: skip


def _train_from_usage(a: argparse.Namespace, target) -> int:
    """``--from-usage DIR``: teacher-forced recording over the usage tokens, then training
    continued from the head (its layers and draft vocabulary)."""
    from ..models.eagle3_gguf import read_eagle3_gguf
    from ..models.eagle3_heads import shipped_head
    from ..models.training.eagle3_data import record_usage
    from ..models.training.eagle3_train import train_eagle3

    head = a.head or shipped_head(target)
    if head is None:
        raise SystemExit(f"localspec: error: no head ships for {target}; give the head to continue with --head GGUF")
    work = Path(a.data_dir or f"{a.out}.work")
    try:
        head_cfg, w = read_eagle3_gguf(head)
        before = _usage_digest(work / "usage-data")
        shards = record_usage(target, a.from_usage, work / "usage-data", head_cfg.target_layers, w.d2t,
                              seq_len=a.seq_len, topk=a.topk)  # fmt: skip
        ckpt = work / "checkpoint.pt"
        if before is not None and before != _usage_digest(work / "usage-data") and ckpt.exists():
            # the checkpoint trained on the usage as it was: resuming it would train on nothing new
            print(f"localspec: the usage in {a.from_usage} changed since the last training in {work}: "
                  f"training starts again from {head}", file=sys.stderr)  # fmt: skip
            ckpt.unlink()
        if a.data_only:
            print(f"{len(shards)} shards in {work / 'usage-data'}")
            return 0
        res = train_eagle3(target, shards, work, a.out, _config(a), target_layers=head_cfg.target_layers,
                           matrix_dtype=a.matrix_type, init_head=head)  # fmt: skip
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"localspec: error: {e}") from None
    return _report(a, res)


def _usage_digest(data_dir: Path) -> str | None:
    """The digest of the usage recorded in ``data_dir`` (its plan), or None before any."""
    from ..models.training.eagle3_data import DataPlan

    try:
        return DataPlan.read_meta(data_dir / "plan.npz").get("digest")
    except Exception:  # missing or unreadable (zipfile.BadZipFile, ...): as if never recorded
        return None


def _report(a: argparse.Namespace, res) -> int:
    """Print the result: sizes and times, then accuracy per unroll step, training (the last
    logged steps) beside held-out (sequences never trained on)."""
    info = dict(
        out=str(res.gguf), size_mib=round(res.gguf.stat().st_size / 2**20, 2), steps=res.steps,
        train_tokens=res.n_train_tokens, vocab_coverage=round(res.vocab_coverage, 4),
        val_accuracy=[round(x, 4) for x in res.val_accuracy], train_accuracy=[round(x, 4) for x in res.train_accuracy],
        wall_s=round(res.wall_s, 1),
    )  # fmt: skip
    if res.val_by_source:
        info["val_by_source"] = res.val_by_source
    if a.json:
        print(json.dumps(info))
        return 0
    for k, v in info.items():
        if k not in ("val_accuracy", "train_accuracy", "val_by_source"):
            print(f"{k:16s} {v}")
    print(per_step_table(res.train_accuracy, res.val_accuracy, res.val_by_source))
    return 0


def per_step_table(train: list[float], val: list[float], by_source: dict | None = None) -> str:
    """Accuracy per unroll step (0 .. n-1) as text: one row for training, one for held-out
    data, one per held-out source; ``-`` where a row has no value for a step (no held-out
    sequences: fewer than 21 recorded)."""
    rows = [("train", train), ("held-out", val)] + [(f"held-out {k}", d["acc"]) for k, d in (by_source or {}).items()]
    n = max((len(r) for _, r in rows), default=0)
    head = f"{'unroll step':16s}" + "".join(f"{k:>8d}" for k in range(n))
    lines = [head]
    for name, r in rows:
        lines.append(f"{name:16s}" + "".join(f"{r[k]:8.4f}" if k < len(r) else f"{'-':>8s}" for k in range(n)))
    return "\n".join(lines)
