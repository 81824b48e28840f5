"""The documentation's links: every relative link in README.md, ARCHITECTURE.md and docs/
names a file of the repository, and every #anchor a heading of the page it points to."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set:
    """GitHub's anchors of a page's headings: lower case, punctuation but - and _ dropped,
    spaces as -."""
    text, found, code = page.read_text(), set(), False
    for line in text.splitlines():
        code ^= line.startswith("```")
        if not code and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


def links(page: Path) -> list:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # not in code blocks
    return [target for target in LINK.findall(text) if "://" not in target]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(page):
    assert links(page) or page.name == "ARCHITECTURE.md"  # each page links somewhere
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.name}: {target} names no file"
        if anchor:
            assert anchor in anchors(dest), f"{page.name}: {target}: no such heading"


def test_the_readme_is_short_and_reaches_every_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for page in (ROOT / "docs").glob("*.md"):
        assert f"docs/{page.name}" in readme, f"the README does not link {page.name}"
