"""Build a local text corpus for `localspec train-eagle3` from what a Linux machine already has:
manual pages rendered to plain text with man(1) and README-like files from /usr/share/doc.

    python scripts/head_corpus.py OUT_DIR [--man 400] [--doc 400] [--seed 0]

Writes OUT_DIR/man/NAME.SECTION.txt and OUT_DIR/doc/PACKAGE__FILE.txt (seeded random samples,
sorted by path before sampling). The shipped head for the default model was trained on a
sample of this kind plus the Python standard library (docs/eagle3-training.md); nothing here
comes from the Spec-Bench questions.
"""

from __future__ import annotations

import argparse
import gzip
import os
import random
import re
import subprocess
from pathlib import Path

DOC_SUFFIXES = (".md", ".txt", ".rst", "")
MAX_BYTES = 200_000


def man_pages(root: Path = Path("/usr/share/man")) -> list[Path]:
    """English manual pages of sections 1, 5 and 7 (the ones written as prose)."""
    return sorted(
        p for s in ("man1", "man5", "man7") for p in (root / s).glob("*")
        if p.is_file() and not p.name.startswith("gcloud")  # thousands of near-identical pages
    )  # fmt: skip


def doc_files(root: Path = Path("/usr/share/doc")) -> list[Path]:
    """README / changelog-free text files of the installed packages."""
    out = []
    for p in sorted(root.rglob("*")):
        if not p.is_file() or "changelog" in p.name.lower() or p.name.lower() == "copyright":
            continue
        if Path(_plain_name(p)).suffix.lower() in DOC_SUFFIXES:
            out.append(p)
    return out


def _plain_name(path: Path) -> str:
    """The file name without a ``.gz`` suffix."""
    return path.name[:-3] if path.name.endswith(".gz") else path.name


def _sample_into(folder: Path, paths: list[Path], n: int, rng: random.Random, read, name_of) -> None:
    """Write ``read(p)`` to ``folder / name_of(p)`` for a seeded sample of ``n`` of ``paths``
    (empty texts skipped)."""
    folder.mkdir(parents=True, exist_ok=True)
    for p in rng.sample(paths, min(n, len(paths))):
        text = read(p)
        if text.strip():
            (folder / name_of(p)).write_text(text)


def render_man(page: Path) -> str:
    env = dict(os.environ, MANWIDTH="80", MAN_KEEP_FORMATTING="0")
    r = subprocess.run(["man", "-P", "cat", "-l", str(page)], capture_output=True, text=True, env=env, timeout=60)
    return re.sub(r".\x08", "", r.stdout) if r.returncode == 0 else ""  # drop overstrike (bold, underline)


def read_doc(path: Path) -> str:
    data = gzip.open(path).read() if path.suffix == ".gz" else path.read_bytes()
    if b"\0" in data[:4096]:
        return ""
    return data[:MAX_BYTES].decode("utf-8", "replace")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--man", type=int, default=400)
    ap.add_argument("--doc", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    out = Path(a.out)
    _sample_into(out / "man", man_pages(), a.man, rng, render_man, lambda p: f"{_plain_name(p)}.txt")
    _sample_into(
        out / "doc", doc_files(), a.doc, rng, read_doc,
        lambda p: f"{p.relative_to('/usr/share/doc').parts[0]}__{_plain_name(p)}.txt",
    )  # fmt: skip
    print(f"{len(list((out / 'man').iterdir()))} man pages, {len(list((out / 'doc').iterdir()))} doc files in {out}")


if __name__ == "__main__":
    main()
