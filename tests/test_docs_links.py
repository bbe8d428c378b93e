"""The README and ``docs/`` link nothing outside the repository, and every link they make resolves.

Rules, for every Markdown link and image outside code (``[text](target)``, ``![alt](target)``,
``[name]: target``, ``<scheme://...>``):
- a relative target names a file or folder that exists inside the repository (never ``../`` out of it), and
  no code span names a ``../`` path outside it either (``../shared/DESIGN.md`` was such a pointer);
- a ``#anchor`` names a heading of the page it points to (GitHub's slugs);
- no absolute URL at all: the docs are self-contained, and a page a reader needs is added to ``docs/``.
  ``ALLOWED_URLS`` is where a reviewed exception would go; it is empty.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
ALLOWED_URLS: frozenset[str] = frozenset()

FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
AUTOLINK = re.compile(r"<([a-zA-Z][a-zA-Z0-9+.-]*:[^>\s]+)>")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def prose(text: str) -> str:
    """``text`` without fenced code blocks and code spans (links there are examples, not links)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def links(text: str) -> list[str]:
    body = prose(text)
    return [*INLINE.findall(body), *REFERENCE.findall(body), *AUTOLINK.findall(body)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|<[^>]+>", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    for line in FENCE.sub("", page.read_text(encoding="utf-8")).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base, n = slug(match.group(1)), 1
            name = base
            while name in found:  # a repeated heading gets -1, -2, ...
                name, n = f"{base}-{n}", n + 1
            found.add(name)
    return found


def outside_paths(page: Path, text: str) -> list[str]:
    """``../`` paths named in code spans that resolve outside the repository."""
    spans = (m.group(0).strip("`").strip() for m in CODE_SPAN.finditer(FENCE.sub("", text)))
    return [s for s in spans if re.fullmatch(r"(\.\./)+[\w./-]+", s)
            and ROOT not in (page.parent / s).resolve().parents]


def problems(page: Path) -> list[str]:
    text = page.read_text(encoding="utf-8")
    out = [f"{path}: names a file outside the repository" for path in outside_paths(page, text)]
    for target in links(text):
        if SCHEME.match(target):
            if target not in ALLOWED_URLS:
                out.append(f"{target}: an absolute URL (the docs link nothing outside the repository)")
            continue
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        if resolved != ROOT and ROOT not in resolved.parents:
            out.append(f"{target}: leaves the repository")
        elif not resolved.exists():
            out.append(f"{target}: no such file or folder")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            out.append(f"{target}: no heading #{anchor} in {resolved.relative_to(ROOT)}")
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_stays_inside_the_repository_and_resolves(page):
    assert page.is_file()
    assert problems(page) == []


def test_the_checker_finds_what_it_must(tmp_path, monkeypatch):
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("# Some title: `code`, here\n")
    page = tmp_path / "docs" / "a.md"
    page.write_text("[ok](b.md#some-title-code-here) [gone](c.md) [out](../../x.md) [web](https://example.com)\n"
                    "![img](b.md) [bad anchor](b.md#nope) <https://example.org>\n"
                    "`[in code](missing.md)`\n```\n[in a block](missing.md)\n```\n[ref]: b.md\n"
                    "See `../../shared/DESIGN.md` and `../docs/b.md`.\n")
    assert problems(page) == [
        "../../shared/DESIGN.md: names a file outside the repository",
        "c.md: no such file or folder",
        "../../x.md: leaves the repository",
        "https://example.com: an absolute URL (the docs link nothing outside the repository)",
        "b.md#nope: no heading #nope in docs/b.md",
        "https://example.org: an absolute URL (the docs link nothing outside the repository)",
    ]
