"""The package's plan, checked: every import points down (no cycle, counting imports
inside functions and under TYPE_CHECKING), no module imports another's private name,
and no module writes a private attribute of an object it does not own.

The exceptions are named here with their reasons: `poolloader.worker.popen`, the one
adapter over CPython's multiprocessing internals (see its docstring), and one write
into torch."""
from __future__ import annotations

import ast
import importlib.util
import pathlib

import poolloader


def _load_layers():
    """scripts/layers.py, the one walk of the import graph (it also draws the picture in
    docs/how-it-works.md), loaded from its path: scripts/ is not a package."""
    path = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "layers.py"
    spec = importlib.util.spec_from_file_location("poolloader_layers", path)
    assert spec and spec.loader, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


layers = _load_layers()
PACKAGE = pathlib.Path(poolloader.__file__).parent
# Modules allowed to write private attributes of objects they do not own, and why.
ADAPTERS = {
    "poolloader.worker.popen": "the one adapter over CPython's multiprocessing internals",
}
# Single writes allowed elsewhere, and why.
ALLOWED_WRITES = {
    ("poolloader.worker.loop", "torch_worker._worker_info"):
        "get_worker_info() in a worker: torch's own worker loop sets it, and has no setter",
}


MODULES = layers.modules(PACKAGE)


def _imports(name: str, path: pathlib.Path) -> list[tuple[str, str]]:
    """(imported module, imported name or "") for every import of a poolloader module."""
    return layers.imports(path)


def _graph() -> dict[str, set[str]]:
    return layers.graph(MODULES)


_cycles = layers.cycles  # strongly connected components of more than one node


def test_every_import_points_down():
    graph = _graph()
    assert len(graph) > 20, sorted(graph)  # the walk found the package
    assert _cycles(graph) == []


def test_the_graph_sees_a_cycle():
    # the checker itself: a cycle made by hand is found
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_private_name_crosses_a_module():
    crossings = [f"{name} imports {imported} from {module}"
                 for name, path in MODULES.items()
                 for module, imported in _imports(name, path)
                 if imported.startswith("_") and not imported.startswith("__")]
    assert crossings == []


def _private_writes(path: pathlib.Path) -> list[str]:
    """`x._name = ...` (or +=, del) where x is not self or cls, and setattr(x, "_name")."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if (isinstance(t, ast.Attribute) and t.attr.startswith("_")
                        and not t.attr.startswith("__")
                        and not (isinstance(t.value, ast.Name) and t.value.id in ("self", "cls"))):
                    found.append(f"line {t.lineno}: {ast.unparse(t)}")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "setattr" and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant) and str(node.args[1].value).startswith("_")
                and not str(node.args[1].value).startswith("__")):
            found.append(f"line {node.lineno}: setattr(..., {node.args[1].value!r})")
    return found


def test_no_module_writes_another_objects_private_fields():
    writes = {name: [w for w in _private_writes(path)
                     if (name, w.split(": ", 1)[1]) not in ALLOWED_WRITES]
              for name, path in MODULES.items() if path.suffix == ".py" and name not in ADAPTERS}
    assert {name: w for name, w in writes.items() if w} == {}


def test_the_write_check_sees_a_write(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f(it):\n    it._x = 1\n    self._y = 2\n    setattr(it, '_z', 3)\n")
    assert _private_writes(probe) == ["line 2: it._x", "line 4: setattr(..., '_z')"]


def test_each_folder_says_what_it_owns():
    folders = sorted(p for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert [p.name for p in folders] == ["adopt", "cuda", "main", "resume", "shm", "wire", "worker"]
    for folder in folders:
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
        assert doc, f"{folder.name}/__init__.py has no docstring saying what the folder owns"


def test_the_layer_picture_in_the_docs_is_the_code():
    # docs/how-it-works.md shows the layers as built; regenerate with the command named
    difference = layers.difference(package=PACKAGE)
    assert not difference, difference


def test_the_layer_picture_sees_a_cycle(tmp_path):
    # the picture itself: an upward import between two folders shows as a cycle
    package = tmp_path / "poolloader"
    for folder, imported in (("low", "poolloader.high.b"), ("high", "poolloader.low.a")):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
        name = "a" if folder == "low" else "b"
        (package / folder / f"{name}.py").write_text(f"import {imported}\n")
    (package / "__init__.py").write_text("from poolloader.high import b\n")
    (package / "errors.py").write_text("")
    picture = layers.render(package)
    assert "cycle: high/ ↔ low/" in picture, picture
    assert "poolloader  → high/" in picture, picture
