"""Every relative link in README.md and docs/ points at something that exists.

``mkdocs build --strict`` (in ``.ci/run``) checks the pages' links and anchors, but not the
README, which GitHub and PyPI show and the site does not include, and it needs the docs
extra. This test needs nothing: for every Markdown link (outside code) in the README and
the pages that is not a URL, the file must exist, and an ``#anchor`` must be the slug of a
heading of that page, made as the site makes it (Python-Markdown's ``toc``).
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"

_FENCE = re.compile(r"^(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_LINK = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks, code spans blanked."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(_CODE_SPAN.sub("", line))
    return lines


def slugify(heading: str) -> str:
    """The anchor Python-Markdown's toc extension gives a heading (its default slugify)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = text.replace("`", "").replace("**", "").replace("*", "")
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    """Every heading anchor of ``page`` (a repeated slug gets ``_1``, ``_2``, ... as in toc)."""
    seen: set[str] = set()
    fenced = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        m = None if fenced else _HEADING.match(line)
        if m is None:
            continue
        slug = base = slugify(m.group(2))
        n = 0
        while slug in seen:
            n += 1
            slug = f"{base}_{n}"
        seen.add(slug)
    return seen


def links(page: Path) -> list[str]:
    """The relative link targets of ``page`` (URLs and mail addresses left out)."""
    found = []
    for line in _prose_lines(page.read_text(encoding="utf-8")):
        for target in _LINK.findall(line):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):
                found.append(target)
    return found


def broken(page: Path, root: Path = REPO) -> list[str]:
    """What is wrong with each relative link of ``page``, one line each (paths relative to ``root``)."""
    problems = []
    for target in links(page):
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            problems.append(f"{page.relative_to(root)}: {target}: no such file")
            continue
        if anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            problems.append(f"{page.relative_to(root)}: {target}: no heading with that anchor")
    return problems


PAGES = [REPO / "README.md", *sorted(p for p in DOCS.rglob("*.md") if "_ext" not in p.parts)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_points_at_a_file_and_heading(page: Path) -> None:
    assert broken(page) == []


def test_the_readme_links_into_the_docs() -> None:
    targets = links(REPO / "README.md")
    assert any(t.startswith("docs/") for t in targets)
    assert len(PAGES) > 10


def test_the_checker_finds_a_broken_file_and_a_broken_anchor(tmp_path: Path) -> None:
    # its teeth: the check above passes only because the links are right, not vacuously
    (tmp_path / "a.md").write_text("# Title\n\n## The `x` command: (s3)\n", encoding="utf-8")
    page = tmp_path / "b.md"
    page.write_text(
        "[ok](a.md#the-x-command-s3) [gone](nope.md) [bad](a.md#nothing) `[code](skipped.md)`\n"
        "```\n[fenced](skipped.md)\n```\n[web](https://example.org/x)\n",
        encoding="utf-8",
    )
    assert broken(page, tmp_path) == ["b.md: nope.md: no such file", "b.md: a.md#nothing: no heading with that anchor"]
