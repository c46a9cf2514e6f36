"""``localspec train-medusa``: the whole Medusa recipe in one command -- plan text chunks,
record the target's final hidden states over them, train K heads, export the GGUF
(docs/drafters.md#medusa-heads). Bounded by ``--budget-min``; rerunning resumes."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser(
        "train-medusa",
        help="train Medusa heads for a GGUF target from your text files (needs the [train] extra)",
        description="Cuts --data (text/code files or folders; 'stdlib' = the Python standard library) into "
        "chunks, records the target's final hidden states over them (teacher-forced prefills, the lm_head "
        "skipped), trains --heads Medusa heads to predict the target's own next-token distributions 2, 3, ... "
        "places ahead over a reduced draft vocabulary, reports held-out accuracy per head and writes --out "
        "(F16). Recording gets --record-share of --budget-min, training the rest. Work files go to --work; "
        "rerunning continues where it stopped.",
    )
    p.add_argument("--target", default="default", help="target GGUF ('default' = the embedded model)")
    p.add_argument("--data", nargs="+", default=["stdlib"], metavar="PATH",
                   help="text/code files or folders; 'stdlib' = the Python standard library's sources")  # fmt: skip
    p.add_argument("--plan", default=None, metavar="PLAN.npz",
                   help="reuse the text chunks of another recipe's plan (e.g. train-eagle3's text/plan.npz)")  # fmt: skip
    p.add_argument("--out", required=True, help="heads GGUF to write")
    p.add_argument("--work", default=None, help="plan, shards and log (default: OUT.work/)")
    p.add_argument("--tokens", type=int, default=2_000_000, help="text tokens planned (recording stops at the budget)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per recorded chunk")
    p.add_argument("--shard-tokens", type=int, default=2048,
                   help="approximate tokens per shard (recording stops between shards)")  # fmt: skip
    p.add_argument("--budget-min", type=float, default=120.0, help="wall-clock budget of the whole recipe (minutes)")
    p.add_argument("--record-share", type=float, default=0.7, help="share of the budget for recording")
    p.add_argument("--jobs", type=int, default=1, help="recording processes side by side (threads split between them)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads in all (default: all)")
    p.add_argument("--heads", type=int, default=4, help="K, the number of heads")
    p.add_argument("--vocab-size", type=int, default=2048, help="draft vocabulary size (docs: its cost)")
    p.add_argument("--steps", type=int, default=1500, help="optimiser steps (fewer when the budget ends)")
    p.add_argument("--batch", type=int, default=256, help="positions per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", choices=["record", "train"], default=None, help="run one stage")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run_train_medusa)


def _record_part(target: str, work: str, j: int, n: int, threads: int | None, deadline: float) -> None:
    from ..models.training.eagle3_data import DataPlan
    from ..models.training.medusa_data import record_plan

    plan = DataPlan.load(Path(work) / "plan.npz")
    record_plan(target, work, plan, n_threads=threads, deadline=deadline, part=(j, n), progress=j == 0)


def run_train_medusa(a: argparse.Namespace) -> int:
    try:
        import torch  # noqa: F401
    except ImportError:
        raise SystemExit("localspec: error: train-medusa needs torch: pip install 'localspec[train]'") from None
    import multiprocessing
    import os

    from ..models import resolve_model
    from ..models.medusa_gguf import stamp_for_target, write_medusa_gguf
    from ..models.training.eagle3_data import DataPlan, iter_text_files, make_plan
    from ..models.training.medusa_data import load_data, shard_paths
    from ..models.training.medusa_train import MedusaConfig, train_medusa
    from .train import _sources

    t_start = time.time()
    deadline = t_start + 60.0 * a.budget_min
    target = str(resolve_model(a.target))
    out = Path(a.out)
    work = Path(a.work) if a.work else out.with_name(out.name + ".work")
    work.mkdir(parents=True, exist_ok=True)
    plan_path = work / "plan.npz"
    if not plan_path.exists():
        if a.plan:
            src = DataPlan.load(Path(a.plan))
            chunks = [t for jobs in src.shards for k, t in jobs if k == "text"]
            plan = DataPlan([], 0, dict(src.meta, reused_from=str(a.plan)))
            size = 0
            for t in chunks:  # re-shard to --shard-tokens (a stop between shards loses less)
                if not plan.shards or size + len(t) > a.shard_tokens:
                    plan.shards.append([])
                    size = 0
                plan.shards[-1].append(("text", t))
                size += len(t)
        else:
            from ..backend import Model

            m = Model(target, vocab_only=True)
            try:
                plan = make_plan(m, iter_text_files(_sources(a.data)), max_tokens=a.tokens, seq_len=a.seq_len,
                                 shard_tokens=a.shard_tokens, seed=a.seed)  # fmt: skip
            finally:
                m.close()
        plan.save(plan_path)
    if a.only != "train":
        rec_deadline = t_start + 60.0 * a.budget_min * (1.0 if a.only == "record" else a.record_share)
        n = max(1, a.jobs)
        threads = a.threads or os.cpu_count() or 1
        per = max(1, threads // n)
        if n == 1:
            _record_part(target, str(work), 0, 1, per, rec_deadline)
        else:
            ctx = multiprocessing.get_context("spawn")
            procs = [ctx.Process(target=_record_part, args=(target, str(work), j, n, per, rec_deadline)) for j in range(n)]
            for p in procs:
                p.start()
            for p in procs:
                p.join()
    if a.only == "record":
        print(f"localspec: recorded {len(shard_paths(work))} shards in {work}")
        return 0
    data = load_data(work)
    cfg = MedusaConfig(n_heads=a.heads, vocab_size=a.vocab_size, steps=a.steps, batch=a.batch, lr=a.lr, seed=a.seed,
                       threads=a.threads, deadline=deadline - 60.0)  # fmt: skip
    log_path = work / "train_log.jsonl"
    wts, res = train_medusa(data, target, cfg, log_path=log_path)
    wts.training["n_recorded_tokens"] = data.n_tokens
    wts.training["n_sequences"] = data.n_seq
    wts.training["recipe_seconds"] = round(time.time() - t_start, 1)
    stamp_for_target(wts, target)
    write_medusa_gguf(out, wts)
    summary = dict(out=str(out), recorded_tokens=data.n_tokens, sequences=data.n_seq, steps=res.steps,
                   train_seconds=round(res.seconds, 1), recipe_seconds=round(time.time() - t_start, 1),
                   val_acc_full_top1=res.val_acc_full, val_acc_draft_top1=res.val_acc_draft,
                   val_top1_in_vocab=res.val_coverage, val_top1_in_vocab_by_size=res.coverage_by_size,
                   vocab_size=int(wts.d2t.size))  # fmt: skip
    (work / "result.json").write_text(json.dumps(summary, indent=1))
    if a.json:
        print(json.dumps(summary))
    else:
        print(f"localspec: wrote {out} ({data.n_tokens} tokens recorded, {res.steps} steps, held-out top-1 per head "
              f"{', '.join(f'{x:.3f}' for x in res.val_acc_full)})")  # fmt: skip
    return 0
