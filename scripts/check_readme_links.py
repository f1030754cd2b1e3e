"""Check the relative links of README.md: each must name a file of the repository, and
a `#anchor` must name a heading of that Markdown file (GitHub's heading ids).

mkdocs checks the links inside docs/ (`mkdocs build --strict`); the README is not part
of that site, so this script covers it. Links to http(s) and mailto are not followed.
Exits 1 and lists every broken link.

Usage: python scripts/check_readme_links.py [FILE.md ...]   (default: README.md)
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(path: Path) -> list[str]:
    """The file's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def slug(title: str) -> str:
    """GitHub's id for a heading: lower case, punctuation dropped, spaces to hyphens."""
    title = re.sub(r"`([^`]*)`", r"\1", title).strip().lower()
    title = re.sub(r"[^\w\- ]", "", title)
    return title.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    for line in prose_lines(path):
        m = HEADING.match(line)
        if m:
            base = slug(m.group(2))
            name, n = base, 1
            while name in found:  # GitHub numbers repeated headings: x, x-1, x-2
                name, n = f"{base}-{n}", n + 1
            found.add(name)
    return found


def broken_links(md: Path) -> list[str]:
    problems = []
    for line in prose_lines(md):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path_part, _, anchor = target.partition("#")
            dest = (md.parent / path_part).resolve() if path_part else md
            if not dest.exists():
                problems.append(f"{md.name}: {target}: no such file {dest.relative_to(REPO)}")
            elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
                problems.append(f"{md.name}: {target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    return problems


def main(argv: list[str]) -> int:
    files = [Path(a).resolve() for a in argv] or [REPO / "README.md"]
    problems = [p for md in files for p in broken_links(md)]
    for p in problems:
        print(p, file=sys.stderr)
    checked = ", ".join(str(f.relative_to(REPO)) for f in files)
    print(f"{checked}: {len(problems)} broken link(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
