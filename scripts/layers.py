"""The layers of poolloader/ as built, read from the code: which package imports which.

One walk of the import graph serves two readers: tests/test_layout.py checks the plan
with it (no cycle, no private name crossing a module), and this script draws the
picture in docs/how-it-works.md from it. A "package" of the picture is a folder of
poolloader/ (`shm/`, `main/`, ...) or a top-level module (`loader`, `stats`, ...; those
are the public API); `poolloader` is the package's `__init__`. Every import counts,
also those inside functions and under `TYPE_CHECKING`; for the compiled modules
(`.pyx`), their Python-level `from poolloader... import` lines.

Usage:
  python scripts/layers.py            print the picture
  python scripts/layers.py --write    write it into docs/how-it-works.md, between its markers
  python scripts/layers.py --check    exit 1 if the picture there is not the code's
"""
from __future__ import annotations

import argparse
import ast
import difflib
import pathlib
import re
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = REPO / "poolloader"
DOC = REPO / "docs" / "how-it-works.md"
COMMAND = "python scripts/layers.py --write"
BEGIN = f"<!-- layers: generated from the code by `{COMMAND}`; tests/test_layout.py checks it -->"
END = "<!-- /layers -->"
WIDTH = 88


# ---------------------------------------------------------------------------
# the import graph, module by module

def module_name(path: pathlib.Path, package: pathlib.Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(package: pathlib.Path = PACKAGE) -> dict[str, pathlib.Path]:
    """{dotted module name: source file} for every .py and .pyx of the package."""
    found = {}
    for path in sorted(package.rglob("*.py")) + sorted(package.rglob("*.pyx")):
        found[module_name(path, package)] = path
    return found


def imports(path: pathlib.Path) -> list[tuple[str, str]]:
    """(imported module, imported name or "") for every import of a poolloader module."""
    found: list[tuple[str, str]] = []
    if path.suffix == ".pyx":  # Cython: the Python-level imports only
        for line in path.read_text().splitlines():
            m = re.match(r"\s*from (poolloader[\w.]*) import (.+)", line)
            if m:
                found += [(m.group(1), n.strip().split(" as ")[0]) for n in m.group(2).split(",")]
        return found
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, "") for a in node.names if a.name.startswith("poolloader")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("poolloader"):
            found += [(node.module, a.name) for a in node.names]
    return found


def graph(mods: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """{module: the poolloader modules it imports} (`from a import b` is an import of
    the module a.b when there is one, else of a)."""
    edges: dict[str, set[str]] = {name: set() for name in mods}
    for name, path in mods.items():
        for module, imported in imports(path):
            target = f"{module}.{imported}" if f"{module}.{imported}" in mods else module
            if target != name:
                edges[name].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan), each sorted."""
    return [c for c in components(edges) if len(c) > 1]


def components(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component (Tarjan), each sorted, dependencies first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


# ---------------------------------------------------------------------------
# the picture, package by package

def layer(module: str, mods: dict[str, pathlib.Path]) -> str:
    """The package of the picture that holds `module`: its folder ("shm/"), the top-level
    module itself ("loader"), or "poolloader" for the package's __init__."""
    parts = module.split(".")
    if len(parts) == 1:
        return parts[0]
    top = ".".join(parts[:2])
    is_folder = top not in mods or mods[top].name == "__init__.py"
    return parts[1] + "/" if is_folder else parts[1]


def layer_graph(package: pathlib.Path = PACKAGE) -> dict[str, set[str]]:
    """{package of the picture: the packages it imports}, imports inside one folder left out."""
    mods = modules(package)
    edges: dict[str, set[str]] = {}
    for module, targets in graph(mods).items():
        source = layer(module, mods)
        edges.setdefault(source, set())
        edges[source].update(t for t in (layer(m, mods) for m in targets) if t != source)
    return edges


def levels(edges: dict[str, set[str]]) -> dict[str, int]:
    """0 for a package that imports none; else one more than the highest it imports
    outside its own cycle (the packages of a cycle share a level)."""
    level: dict[str, int] = {}
    for component in components(edges):  # dependencies come first
        members = set(component)
        below = [level[t] for v in component for t in edges[v] if t not in members]
        for v in component:
            level[v] = 1 + max(below) if below else 0
    return level


def render(package: pathlib.Path = PACKAGE) -> str:
    """The picture: one line per package, highest level first, with what it imports."""
    edges = layer_graph(package)
    level = levels(edges)
    loops = cycles(edges)
    in_loop = {v: set(c) for c in loops for v in c}
    order = sorted(edges, key=lambda v: (-level[v], v))
    name_width = max(map(len, order + ["package"]))
    lines = [f"level  {'package':<{name_width}}  imports", ""]
    for v in order:
        targets = sorted(edges[v], key=lambda t: (-level[t], t))
        shown = [t + (" ⟲" if t in in_loop.get(v, ()) else "") for t in targets]
        head = f"{level[v]:>5}  {v:<{name_width}}  "
        lines += _wrap(head, "→ " + ", ".join(shown) if shown else "(none)")
    notes = ["", "Every import points to a lower line, except one marked ⟲: an import inside a",
             "cycle (the packages of a cycle share a level). Folders end in /; the other names",
             "are the public top-level modules; poolloader is the package's __init__. Imports",
             "inside one folder are not shown."]
    notes += ["  cycle: " + " ↔ ".join(c) for c in loops] or ["No cycle."]
    return "\n".join(lines + notes)


def _wrap(head: str, text: str) -> list[str]:
    out, line = [], head
    for word in text.split(" "):
        if len(line) + len(word) + 1 > WIDTH and line.strip() and line != head:
            out.append(line.rstrip())
            line = " " * len(head) + "  "
        line += word + " "
    out.append(line.rstrip())
    return out


# ---------------------------------------------------------------------------
# the block in docs/how-it-works.md

def block(picture: str) -> str:
    return f"{BEGIN}\n\n```text\n{picture}\n```\n\n{END}"


def documented(doc: pathlib.Path = DOC) -> str | None:
    """The block between the markers in `doc`, markers included; None without markers."""
    text = doc.read_text(encoding="utf-8")
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        return None
    return text[start:end + len(END)]


def write(doc: pathlib.Path = DOC, package: pathlib.Path = PACKAGE) -> bool:
    """Put the code's picture into `doc`; True if that changed it."""
    old = documented(doc)
    if old is None:
        raise SystemExit(f"{_shown(doc)} has no layer picture: put the two lines\n{BEGIN}\n{END}\n"
                         f"where it goes, then run {COMMAND}")
    new = block(render(package))
    if old == new:
        return False
    text = doc.read_text(encoding="utf-8")
    doc.write_text(text.replace(old, new), encoding="utf-8")
    return True


def difference(doc: pathlib.Path = DOC, package: pathlib.Path = PACKAGE) -> str:
    """"" when `doc` shows the code's picture; else what differs, and the command to run."""
    old = documented(doc)
    new = block(render(package))
    if old == new:
        return ""
    if old is None:
        return f"{_shown(doc)} has no layer picture (markers {BEGIN!r} ... {END!r}); run {COMMAND}"
    diff = difflib.unified_diff(old.splitlines(), new.splitlines(), f"{doc.name} (documented)",
                                "the code", lineterm="")
    return (f"the layer picture in {_shown(doc)} is not the code's; regenerate it with `{COMMAND}`\n"
            + "\n".join(diff))


def _shown(path: pathlib.Path) -> str:
    try:
        return str(path.relative_to(REPO))
    except ValueError:
        return str(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"update the picture in {_shown(DOC)}")
    mode.add_argument("--check", action="store_true", help="exit 1 if that picture is not the code's")
    args = p.parse_args(argv)
    if args.write:
        print(f"{_shown(DOC)}: {'updated' if write() else 'already up to date'}")
        return 0
    if args.check:
        diff = difference()
        print(diff or f"{_shown(DOC)}: the layer picture is the code's")
        return 1 if diff else 0
    print(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
