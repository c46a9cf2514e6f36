"""The documentation's links: every relative link in README.md and docs/*.md names a file that
exists, and every ``#anchor`` a heading of its page (GitHub's heading ids: lower case, spaces
to hyphens, punctuation dropped, ``-1``, ``-2`` ... for repeats)."""

from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

markdown_it = pytest.importorskip("markdown_it")
anchors = pytest.importorskip("mdit_py_plugins.anchors")

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def parse(path: Path):
    md = markdown_it.MarkdownIt("commonmark").enable("table").use(anchors.anchors_plugin, max_level=6)
    return md.parse(path.read_text(encoding="utf-8"))


def walk(tokens):
    for t in tokens:
        yield t
        yield from walk(t.children or [])


def heading_ids(path: Path) -> set[str]:
    return {t.attrs["id"] for t in walk(parse(path)) if t.type == "heading_open" and "id" in t.attrs}


def links(path: Path) -> list[str]:
    return [t.attrs["href"] for t in walk(parse(path)) if t.type == "link_open"] + [
        t.attrs["src"] for t in walk(parse(path)) if t.type == "image"
    ]


def broken_links(path: Path) -> list[str]:
    out = []
    for href in links(path):
        url = urlsplit(href)
        if url.scheme or url.netloc:  # external: not checked here
            continue
        target = (path.parent / unquote(url.path)).resolve() if url.path else path
        if not target.exists():
            out.append(f"{href}: no such file")
        elif url.fragment and target.suffix == ".md" and url.fragment not in heading_ids(target):
            out.append(f"{href}: no such heading in {target.name}")
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_resolve(page):
    assert broken_links(page) == []


def test_the_checker_sees_a_broken_file_and_a_broken_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# Title here\n\n## Run 2 (quiet, 2026-12-03)\n")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#title-here) [ok](a.md#run-2-quiet-2026-12-03) [gone](c.md) [bad](a.md#nope) "
                    "[self](#x) `[code](d.md)` ![img](e.svg) [web](https://example.com/x.md)\n")  # fmt: skip
    assert broken_links(page) == ["c.md: no such file", "a.md#nope: no such heading in a.md",
                                  "#x: no such heading in b.md", "e.svg: no such file"]  # fmt: skip
