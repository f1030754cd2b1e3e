"""The package's plan, checked: every import points down (no cycle, counting imports
inside functions and under TYPE_CHECKING, between modules and between the packages of
the picture in docs/how-it-works.md), no folder imports the public top-level modules,
no module imports, calls or reads another's private name, and no module writes a
private attribute of an object it does not own.

The exceptions are named here with their reasons: `poolloader.worker.popen`, the one
adapter over CPython's multiprocessing internals (see its docstring), adopt/ (the layer
above the public API), one write into torch, and the reads of torch's and CPython's
private names that a DataLoader subclass (or its worker) must make."""
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
    "poolloader.worker.zygote": "a private CPython ForkServer and its Popen, started and "
                                "driven as multiprocessing's own forkserver is (its docstring)",
}
# Single writes allowed elsewhere, and why.
ALLOWED_WRITES = {
    ("poolloader.worker.loop", "torch_worker._worker_info"):
        "get_worker_info() in a worker: torch's own worker loop sets it, and has no setter",
}

# Reads (a call, an attribute, getattr) of a private name defined in no module of the
# reader allowed, and why: (module, the expression as ast.unparse writes it).
ALLOWED_READS = {
    ("poolloader.errors", "sys._getframe"):
        "user_frame, the one walk of the stack for warning locations: CPython's frame "
        "access (inspect.currentframe is the same call, less cheap)",
    ("poolloader.shm.backends.memfd", "os._exit"):
        "the probe's forked child leaves without the parent's atexit handlers and "
        "buffers: os._exit is Python's documented exit for a child of os.fork",
    ("poolloader.adopt.runner", "runpy._run_module_as_main"):
        "`python -m poolloader -m module` runs the module as `python -m` does (its "
        "__main__, sys.argv, sys.path[0]); runpy.run_module does not",
    ("poolloader.loader", "self._iterator._shutdown_workers"):
        "torch's names: DataLoader keeps a persistent iterator in _iterator and stops it "
        "with _shutdown_workers (PoolLoaderIter overrides it)",
    ("poolloader.resume.keys", "loader._index_sampler"):
        "DataLoader's property, the sampler an epoch draws from (batch_sampler or "
        "sampler): torch's own iterators read it so, and it has no public name",
    ("poolloader.main.rendezvous", "dist.distributed_c10d._get_default_store"):
        "the initialised default process group's store, where a node pool started "
        "without torchrun (mp.spawn) finds its local ranks with a bounded wait: torch "
        "has no public getter for it, and a collective would wait unbounded",
    ("poolloader.cuda.gate", "getattr(loader, '_cuda_runtime')"):
        "the tests' CPU stand-in for CUDA (tests/cuda_standin.py) is set on a loader "
        "under this name: the one injection point, never set by poolloader",
    ("poolloader.main.tracked", "torch.autograd._profiler_enabled"):
        "whether a profiler records, checked before entering record_function on every "
        "next(): torch's datapipes make the same check, and torch has no public name for it",
    ("poolloader.main.tracked", "getattr(monitor, '_monitor_singleton')"):
        "whether torch's CUPTI monitor was started (record_function feeds it annotations): "
        "the module's own global, which its push_user_annotation reads; no public getter",
    ("poolloader.cuda.runtime", "torch._C"):
        "torch._C._cuda_hasPrimaryContext: whether a device already has a context, "
        "without creating one; torch has no public call for it",
    ("poolloader.cuda.runtime", "getattr(torch._C, '_cuda_hasPrimaryContext')"):
        "the same call, looked up where a torch build may lack it",
    ("poolloader.cuda.runtime", "torch.cuda._sleep"):
        "the one kernel launch that clears cudart's last error when torch links cudart "
        "statically (its check reads the error)",
    ("poolloader.wire.codec", "torch._C._storage_Use_Count"):
        "how many tensors share a storage (whether a tensor is still in use); torch "
        "has no public call for it",
    ("poolloader.wire.codec", "t.untyped_storage()._cdata"):
        "the storage handle that torch._C._storage_Use_Count takes",
    ("poolloader.wire.codec", "torch._C"):
        "torch._C._AutoDispatchBelowADInplaceOrView: the guard (C++ "
        "at::AutoDispatchBelowADInplaceOrView) under which a decoded batch's tensors are "
        "made as torch.load makes its own, not views, each with its own version counter; "
        "torch has no public name for it",
    ("poolloader.wire.codec", "getattr(torch._C, '_AutoDispatchBelowADInplaceOrView')"):
        "the same guard, looked up where a torch build may lack it",
    ("poolloader.main.startup", "obj._untyped_storage"):
        "the UntypedStorage under a TypedStorage, as torch's Tensor.__reduce_ex__ reads "
        "it: TypedStorage.untyped() warns that TypedStorage is deprecated",
    ("poolloader.main.startup", "torch._utils._rebuild_tensor_v3"):
        "torch's rebuild of a tensor whose dtype TypedStorage lacks: the start-up "
        "pickler recognises it in the tensor's own __reduce_ex__ to give it the storage "
        "torch.load would (torch has no public name for it)",
    ("poolloader.worker.loop", "signal_handling._set_worker_signal_handlers"):
        "torch's own worker loop installs these handlers: a worker behaves as DataLoader's",
    ("poolloader.worker.loop", "torch.multiprocessing._set_thread_name"):
        "torch's own worker loop names its thread so: a worker looks like DataLoader's",
}
# Underscore names that are public API: namedtuple's methods and fields.
PUBLIC_UNDERSCORE = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}
# Folders allowed to import the public top-level modules, and why (errors, the lowest
# layer, may be imported by any folder).
ABOVE_THE_API = {
    "adopt": "the runner's hook and the Accelerate bridge build PoolLoaders: the layer "
             "above the public API (poolloader.loader keeps an extension point for it, "
             "on_plain_rebuild, instead of importing it)",
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


def _upward(package: pathlib.Path) -> list[str]:
    """Imports between the packages of the picture that do not point to a lower level,
    and imports of a public top-level module from a folder outside ABOVE_THE_API."""
    mods = layers.modules(package)
    edges = layers.layer_graph(package)
    level = layers.levels(edges)
    found = [f"{a} (level {level[a]}) imports {b} (level {level[b]})"
             for a in sorted(edges) for b in sorted(edges[a]) if level[b] >= level[a]]
    for name, targets in layers.graph(mods).items():
        folder = name.split(".")[1] if layers.layer(name, mods).endswith("/") else None
        if folder is None or folder in ABOVE_THE_API:
            continue
        found += [f"{name} imports the public {t}" for t in sorted(targets)
                  if not layers.layer(t, mods).endswith("/")
                  and t not in (f"{package.name}", f"{package.name}.errors")]
    return found


def test_every_arrow_of_the_picture_points_down():
    # between packages (folders and top-level modules), as docs/how-it-works.md draws them
    assert layers.cycles(layers.layer_graph(PACKAGE)) == []
    assert _upward(PACKAGE) == []


def test_the_layer_check_sees_an_upward_import(tmp_path):
    package = tmp_path / "poolloader"
    (package / "low").mkdir(parents=True)
    (package / "low" / "__init__.py").write_text("")
    (package / "low" / "a.py").write_text("from poolloader.stats import S\n")
    (package / "stats.py").write_text("import poolloader.low.a\n")
    (package / "errors.py").write_text("")
    (package / "__init__.py").write_text("from poolloader import stats\n")
    assert layers.cycles(layers.layer_graph(package)) == [["low/", "stats"]]
    assert _upward(package) == ["low/ (level 0) imports stats (level 0)",
                                "stats (level 0) imports low/ (level 0)",
                                "poolloader.low.a imports the public poolloader.stats"]


def test_the_graph_sees_a_cycle():
    # the checker itself: a cycle made by hand is found
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_private_name_crosses_a_module():
    crossings = [f"{name} imports {imported} from {module}"
                 for name, path in MODULES.items()
                 for module, imported in _imports(name, path)
                 if imported.startswith("_") and not imported.startswith("__")]
    assert crossings == []


def _defined(tree: ast.AST) -> set[str]:
    """Every name a module defines: functions, classes, arguments, assigned names and
    attributes (`self._x = ...`), setattr's names."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "setattr" and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant)):
            names.add(str(node.args[1].value))
    return names


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in PUBLIC_UNDERSCORE


def _private_reads(path: pathlib.Path) -> list[str]:
    """`x._name` read or called, and getattr(x, "_name"), where x is not self or cls and
    the module defines no `_name` itself: another module's private name (the outermost
    of a chain: `torch._C._f` once, not also `torch._C`)."""
    tree = ast.parse(path.read_text(), str(path))
    defined = _defined(tree)
    attributes = [node for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)
                  and _private(node.attr) and node.attr not in defined
                  and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))]
    inner = {id(node.value) for node in attributes}
    found = [(node.lineno, ast.unparse(node)) for node in attributes if id(node) not in inner]
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant) and _private(str(node.args[1].value))
                and node.args[1].value not in defined
                and not (isinstance(node.args[0], ast.Name) and node.args[0].id in ("self", "cls"))):
            found.append((node.lineno, f"{node.func.id}({ast.unparse(node.args[0])}, "
                                       f"{node.args[1].value!r})"))
    return [f"line {line}: {text}" for line, text in sorted(found)]


def test_no_module_calls_or_reads_another_modules_private_names():
    reads = {name: [r for r in _private_reads(path)
                    if (name, r.split(": ", 1)[1]) not in ALLOWED_READS]
             for name, path in MODULES.items() if path.suffix == ".py" and name not in ADAPTERS}
    assert {name: r for name, r in reads.items() if r} == {}


def test_every_allowed_read_is_still_made():
    # an exception whose read is gone is removed from ALLOWED_READS, not kept as a loophole
    made = {(name, r.split(": ", 1)[1]) for name, path in MODULES.items()
            if path.suffix == ".py" for r in _private_reads(path)}
    assert set(ALLOWED_READS) - made == set()


def test_the_read_check_sees_a_private_call(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import other\n"
        "def f(it, loader):\n"
        "    other._helper(1)\n"
        "    n = it._num_workers + self._mine + cls._mine\n"
        "    getattr(loader, '_hidden', None)\n"
        "    return _own(), it._own, torch._C._f(), p._replace(x=1)\n"
        "def _own():\n"
        "    pass\n")
    assert _private_reads(probe) == ["line 3: other._helper", "line 4: it._num_workers",
                                     "line 5: getattr(loader, '_hidden')",
                                     "line 6: torch._C._f"]


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
