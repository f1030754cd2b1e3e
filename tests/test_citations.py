"""Where the code cites a page of the docs, the page and its section exist; and the code
cites no design document the repository does not hold (DESIGN.md lives beside it, in
the team's shared folder, not in a clone)."""
from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = [p for folder in ("poolloader", "tests", "bench", "scripts", "examples", "fixtures")
           for p in sorted((ROOT / folder).rglob("*.py")) + sorted((ROOT / folder).rglob("*.pyx"))]
# docs/<page>.md, optionally followed by a quoted section title: docs/guide.md, "In a container"
CITATION = re.compile(r'docs/([\w-]+\.md)(?:,\s*"([^"]+)")?')


def _headings(page: pathlib.Path) -> set[str]:
    return {line.lstrip("#").strip() for line in page.read_text().splitlines() if line.startswith("#")}


def citations(text: str) -> list[tuple[str, str | None]]:
    return [(m.group(1), m.group(2) and " ".join(m.group(2).split())) for m in CITATION.finditer(text)]


def test_every_cited_docs_page_and_section_exists():
    assert len(SOURCES) > 50
    broken = []
    found = 0
    for path in SOURCES:
        if path.name == "test_citations.py":
            continue
        for page, section in citations(path.read_text()):
            found += 1
            doc = ROOT / "docs" / page
            if not doc.exists():
                broken.append(f"{path.relative_to(ROOT)}: docs/{page} does not exist")
            elif section and section not in _headings(doc):
                broken.append(f"{path.relative_to(ROOT)}: docs/{page} has no section {section!r}")
    assert found >= 4  # the walk sees the citations
    assert broken == []


def test_no_citation_of_a_document_outside_the_repository():
    cited = [str(p.relative_to(ROOT)) for p in SOURCES
             if p.name != "test_citations.py" and "DESIGN.md" in p.read_text()]
    assert cited == []


def test_the_checker_reads_a_section_across_a_line_break():
    assert citations('see (docs/benchmarks.md, "Hand-off:\n    the headline run")') == [
        ("benchmarks.md", "Hand-off: the headline run")]
