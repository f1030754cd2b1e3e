"""backend.py and shm/backends/: every backend is one module behind one interface.

The backends are the modules of poolloader/shm/backends/, each exposing what
backend.Backend names, with the two sides' methods as MainSide and WorkerSide
declare them; nothing outside shm/backends/ chooses among them by name; and a third
backend is one new module: dropped into a copy of the package, a PoolLoader runs on
it, workers included, with no other file edited."""
from __future__ import annotations

import ast
import inspect
import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

from helpers import communicate_within

import poolloader
from poolloader.shm import backend, backends
from poolloader.shm.pool import SlotPool, WorkerSlots

PACKAGE = pathlib.Path(poolloader.__file__).parent
HERE = pathlib.Path(__file__).parent


def _protocol_members(protocol) -> dict[str, object]:
    """The names a protocol declares (attributes and methods), with their definitions."""
    names = set(getattr(protocol, "__annotations__", {}))
    names |= {n for n, v in vars(protocol).items()
              if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    return {n: vars(protocol).get(n) for n in sorted(names)}


def _parameters(function) -> int:
    """How many arguments it takes besides self (callers pass them by position)."""
    return len([p for p in inspect.signature(function).parameters if p != "self"])


def test_the_backends_are_the_modules_of_shm_backends():
    modules = sorted(p.stem for p in (PACKAGE / "shm" / "backends").glob("*.py")
                     if not p.name.startswith("_"))
    assert sorted(backends.kinds()) == modules
    assert backends.kinds()[0] == backends.PREFERENCE[0]  # the default first
    for kind in modules:
        module = backends.load(kind)
        assert module.KIND == kind
        for name, declared in _protocol_members(backend.Backend).items():
            assert hasattr(module, name), f"backends/{kind}.py has no {name}"
            if callable(declared):
                assert _parameters(getattr(module, name)) == _parameters(declared), (kind, name)
        for side, protocol in ((module.Segments, backend.MainSide),
                               (module.Attachment, backend.WorkerSide)):
            for name, declared in _protocol_members(protocol).items():
                if name in ("control_mapping",):  # set by __init__
                    continue
                assert hasattr(side, name), f"backends/{kind}.py: {side.__name__} has no {name}"
                if callable(declared):
                    assert _parameters(getattr(side, name)) == _parameters(declared), (kind, name)
        assert module.Segments.kind == kind
        assert module.refuses(0) is None or isinstance(module.refuses(0), str)


def _strings(path: pathlib.Path) -> list[str]:
    """Every string literal of a module except its docstrings."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docstrings]


def test_no_backend_is_named_outside_shm_backends_but_in_the_preference():
    kinds = backends.kinds()
    for relative in ("shm/pool.py", "shm/backend.py", "loader.py"):
        path = PACKAGE / relative
        named = [s for s in _strings(path) if any(k in s.lower() for k in kinds)]
        assert named == [], f"{relative} names a backend: {named}"
        imports = [node for node in ast.walk(ast.parse(path.read_text()))
                   if isinstance(node, (ast.Import, ast.ImportFrom))]
        for node in imports:
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [f"{node.module}.{a.name}" for a in node.names])
            assert not any(m.startswith("poolloader.shm.backends.") for m in modules), \
                f"{relative} imports a backend: {modules}"
    # in backends/__init__.py, only PREFERENCE: the default and the fallback order, as data
    init = ast.parse((PACKAGE / "shm" / "backends" / "__init__.py").read_text())
    preference = next(n.value for n in init.body if isinstance(n, ast.Assign)
                      and any(getattr(t, "id", "") == "PREFERENCE" for t in n.targets))
    in_preference = {id(n) for n in ast.walk(preference)}
    elsewhere = [n.value for n in ast.walk(init) if isinstance(n, ast.Constant)
                 and n.value in kinds and id(n) not in in_preference]
    assert elsewhere == []


def test_both_sides_of_every_backend_meet_through_the_locator():
    """Whatever modules shm/backends/ holds: a worker attaches by the locator alone, maps
    the slots, and sees the owner lock go with the pool."""
    for kind in backends.kinds():
        pool = SlotPool(num_workers=1, slots=2, max_slots=3, slot_bytes=10_000, backend=kind)
        try:
            assert pool.backend == kind and pool.locator[0] == kind
            worker = WorkerSlots(pool.locator, 0)
            assert set(worker.mappings) == {0, 1} and worker.owner_alive()
            assert pool.unlink_mapped() == 0
        finally:
            pool.close()
        assert not worker.owner_alive(), kind


NODE_BACKEND = '''
"""A third backend for the test: memfd's segments under another kind."""
from poolloader.shm.backends import memfd

KIND = "node"
DESCRIPTION = "the test's node backend"
supported = memfd.supported
refuses = memfd.refuses
Attachment = memfd.Attachment


class Segments(memfd.Segments):
    kind = KIND
'''

CHILD = '''
import json, sys
import poolloader
from poolloader.shm import backends
import compare, loader_datasets as ds

assert poolloader.__file__.startswith(sys.argv[1]), poolloader.__file__
out = {"kinds": list(backends.kinds()), "pool_backend": None}


def run(loader):
    it = iter(loader)
    batches = [next(it)]
    if hasattr(it, "_pool"):
        out["pool_backend"] = it._pool.backend
    return batches + list(it)


want, got = compare.both_loaders(lambda cls: cls(ds.AugmentDataset(), batch_size=4, num_workers=2,
                                                 **compare.pool_only(cls, shm_backend="node")), run)
compare.assert_same(want, got)
out["batches"] = [len(want), len(got)]
del want, got
print(json.dumps(out))
'''


def test_a_third_backend_is_one_new_module(tmp_path):
    copy = tmp_path / "poolloader"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "*.c"))
    (copy / "shm" / "backends" / "node.py").write_text(textwrap.dedent(NODE_BACKEND))
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{HERE}")
    env.pop("POOLLOADER_SHM_BACKEND", None)
    child = subprocess.Popen([sys.executable, str(script), str(copy)], env=env, cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = communicate_within(child, 300, "a PoolLoader on a dropped-in backend")
    assert child.returncode == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["kinds"] == ["memfd", "posix", "node"]  # PREFERENCE, then the rest by name
    assert result["pool_backend"] == "node"
    assert result["batches"][0] == result["batches"][1] > 0
