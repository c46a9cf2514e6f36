"""Build a local text corpus for `localspec train-eagle3` from documentation packages:
manual pages rendered to plain text with man(1), README-like files from /usr/share/doc, and
the sources of whole manuals that Debian packages ship as text.

    python scripts/head_corpus.py OUT_DIR [--man 400] [--doc 400] [--seed 0] [--install]
                                          [--languages de,fr,es,it --per-language 300]

Writes OUT_DIR/man/NAME.SECTION.txt and OUT_DIR/doc/PACKAGE__FILE.txt (seeded random samples,
sorted by path before sampling) and OUT_DIR/manuals/NAME/... (every file of the manuals in
``MANUALS`` that is installed: Python's documentation as reStructuredText from python3.11-doc,
git's manual pages and guides as AsciiDoc from git-doc, Perl's POD documentation from
perl-doc). ``--install`` first installs ``APT_PACKAGES`` with apt-get (needs root and the
Debian registry; nothing else is downloaded). The shipped head for the default model was
trained on this corpus plus the Python standard library (docs/eagle3-training.md); nothing
here comes from the Spec-Bench questions or HumanEval.

``--languages`` adds OUT_DIR/man-LANG/NAME.SECTION.txt: manual pages translated by Debian's
manpages-l10n project (``manpages-LANG``, installed with ``--install``), rendered in UTF-8,
for a head that drafts in those languages too (``train_default_head.py --languages``).
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
APT_PACKAGES = ("python3.11-doc", "git-doc", "perl-doc", "manpages", "manpages-dev", "bash-doc")
# name -> (folder, file name suffixes): manuals copied whole, as text
MANUALS = {
    "python": (Path("/usr/share/doc/python3.11/html/_sources"), (".rst.txt",)),
    "git": (Path("/usr/share/doc/git-doc"), (".txt",)),
    "perl": (Path("/usr/share/perl"), (".pod",)),
}


def install_packages(packages=APT_PACKAGES) -> None:
    """``apt-get update`` and ``apt-get install`` the documentation packages (root only)."""
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update"], check=True, env=env, stdout=subprocess.DEVNULL)
    subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", *packages], check=True, env=env,
                   stdout=subprocess.DEVNULL)  # fmt: skip


def copy_manuals(out: Path) -> int:
    """Copy every installed file of ``MANUALS`` into ``out/NAME/`` (flattened names); returns
    the number of files."""
    n = 0
    for name, (root, suffixes) in MANUALS.items():
        if not root.exists():
            continue
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        for p in sorted(root.rglob("*")):
            if p.is_file() and p.name.endswith(suffixes):
                text = read_doc(p)
                if text.strip():
                    flat = "__".join(p.relative_to(root).parts)
                    (folder / (flat if flat.endswith(".txt") else flat + ".txt")).write_text(text)
                    n += 1
    return n
MAX_BYTES = 200_000


def man_pages(root: Path = Path("/usr/share/man")) -> list[Path]:
    """English manual pages of sections 1, 5 and 7 (the ones written as prose)."""
    return sorted(
        p for s in ("man1", "man5", "man7") for p in (root / s).glob("*")
        if p.is_file() and not p.name.startswith("gcloud")  # thousands of near-identical pages
    )  # fmt: skip


def localized_man_pages(lang: str, root: Path = Path("/usr/share/man")) -> list[Path]:
    """Manual pages of sections 1, 5, 7 and 8 translated into ``lang`` (``/usr/share/man/LANG``,
    Debian's ``manpages-LANG``)."""
    return sorted(p for s in ("man1", "man5", "man7", "man8") for p in (root / lang / s).glob("*") if p.is_file())


def build_languages(out: Path, languages: list[str], *, per_language: int = 300, seed: int = 0,
                    install: bool = False, exclude: Path | None = None) -> dict[str, int]:
    """Render ``per_language`` seeded translated manual pages per language into
    ``out/man-LANG/``; returns the pages written per language. ``exclude``: another such
    folder whose pages are left out (a gate set apart from the training pages).

    Raises:
        FileNotFoundError: a language with no translated pages installed (install
            ``manpages-LANG``, or pass ``install=True``)."""
    if install:
        install_packages(tuple(f"manpages-{lang.lower().replace('_', '-')}" for lang in languages))
    written = {}
    for lang in languages:
        pages = localized_man_pages(lang)
        if not pages:
            raise FileNotFoundError(f"no manual pages in /usr/share/man/{lang}: apt-get install manpages-{lang}")
        if exclude is not None and (exclude / f"man-{lang}").is_dir():
            taken = {p.name for p in (exclude / f"man-{lang}").iterdir()}
            pages = [p for p in pages if f"{_plain_name(p)}.txt" not in taken]
        folder = out / f"man-{lang}"
        _sample_into(folder, pages, per_language, random.Random(f"{seed}-{lang}"),
                     lambda p: render_man(p, utf8=True), lambda p: f"{_plain_name(p)}.txt")  # fmt: skip
        written[lang] = len(list(folder.iterdir()))
    return written


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


def render_man(page: Path, utf8: bool = False) -> str:
    """``page`` as plain text, 80 columns; ``utf8``: in UTF-8 (a translated page keeps its
    letters; the English pages are rendered in the caller's locale, as for the shipped head)."""
    env = dict(os.environ, MANWIDTH="80", MAN_KEEP_FORMATTING="0")
    if utf8:
        env.update(LANG="C.UTF-8", LC_ALL="C.UTF-8")
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
    ap.add_argument("--install", action="store_true", help=f"apt-get install {' '.join(APT_PACKAGES)} first")
    ap.add_argument("--languages", default="", help="comma-separated manpages-l10n languages (e.g. de,fr,es,it)")
    ap.add_argument("--per-language", type=int, default=300)
    a = ap.parse_args()
    build_corpus(Path(a.out), man=a.man, doc=a.doc, seed=a.seed, install=a.install)
    if a.languages:
        print(build_languages(Path(a.out), a.languages.split(","), per_language=a.per_language, seed=a.seed,
                              install=a.install))  # fmt: skip


def build_corpus(out: Path, *, man: int = 400, doc: int = 400, seed: int = 0, install: bool = False) -> None:
    """Write the corpus into ``out`` (see the module doc)."""
    if install:
        install_packages()
    rng = random.Random(seed)
    _sample_into(out / "man", man_pages(), man, rng, render_man, lambda p: f"{_plain_name(p)}.txt")
    _sample_into(
        out / "doc", doc_files(), doc, rng, read_doc,
        lambda p: f"{p.relative_to('/usr/share/doc').parts[0]}__{_plain_name(p)}.txt",
    )  # fmt: skip
    n_manual = copy_manuals(out / "manuals")
    print(f"{len(list((out / 'man').iterdir()))} man pages, {len(list((out / 'doc').iterdir()))} doc files, "
          f"{n_manual} manual files in {out}")  # fmt: skip


if __name__ == "__main__":
    main()
