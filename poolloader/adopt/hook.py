"""Build the DataLoaders a script constructs as PoolLoaders, without editing the script.

The runner (`python -m poolloader SCRIPT`, `poolloader.adopt.runner`) sets
`torch.utils.data.DataLoader.__new__` once per process (`enable`) to `_new` below
(through a descriptor that keeps `inspect.signature(DataLoader)` DataLoader's own,
for tools that configure loaders by introspection: LightningCLI, jsonargparse).
From then on, `DataLoader(..., num_workers=N > 0)` returns a `PooledDataLoader` (a
PoolLoader carrying the runner's pool options) and Python runs that class's `__init__`
with the caller's arguments. Why this and not replacing the name:

* `torch.utils.data.DataLoader` stays the class it was, so `isinstance(x, DataLoader)`
  holds for every loader (plain ones included), pickling a plain loader still finds its
  class by name, and it makes no difference when a library bound the name
  (`from torch.utils.data import DataLoader` at import, as RF-DETR's module_data.py
  does, before or after the runner started).
* Only the class itself is adopted. A subclass (torchdata's `StatefulDataLoader`,
  `torch_geometric.loader.DataLoader`, ultralytics' `InfiniteDataLoader`, your own) is
  built as written: it may override `__iter__`, `_get_iterator` or use attribute names
  PoolLoader also uses (`device`, `stats`), so pooling it could change what it does. The
  summary lists such loaders as not pooled, with where they were built.
* `num_workers=0` stays a plain DataLoader: there are no workers to pool.

spawn and forkserver children: multiprocessing pickles a dict of preparation data
(sys.path, argv, which main module to re-import) for every child, which the child
unpickles before it re-imports the parent's main module. `enable` adds one entry whose
unpickling calls `_enable_in_child` with the parent's options, so the patch is on before
any of the child's own code runs, on any start method, with nothing on disk (no
sitecustomize, no .pth) and nothing the script can see (`__main__`, `__spec__`,
`sys.argv` are untouched). The forkserver's own environment is frozen when it starts,
which is why an environment variable would not reach its later children. Fork children
inherit the patch with the parent's memory. Processes started some other way
(`subprocess`, torchrun, `accelerate launch`) need the runner in their command line.
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import functools
import inspect
import multiprocessing
import multiprocessing.spawn
import multiprocessing.util
import os
import sys
import threading
import time
import types
import typing
import weakref
from collections.abc import Callable, Iterator
from typing import ClassVar

from torch.utils.data import DataLoader

from poolloader.adopt import rebuilds
from poolloader.errors import user_frame
from poolloader.loader import PoolLoader

_DATALOADER_PARAMS = inspect.signature(DataLoader.__init__)
_POOLLOADER_PARAMS = inspect.signature(PoolLoader.__init__)


def pool_option_names() -> tuple[str, ...]:
    """PoolLoader's own keyword arguments (slot_bytes, slots, ...), read from its
    signature so the runner passes whatever PoolLoader accepts, by name."""
    return tuple(name for name, p in _POOLLOADER_PARAMS.parameters.items()
                 if p.kind is p.KEYWORD_ONLY and name not in _DATALOADER_PARAMS.parameters)


# Pool options that belong to one loader, not to a script (none now; the runner offers
# every other pool option for all the loaders of a script: poolloader.adopt.runner).
PER_LOADER_OPTIONS: tuple[str, ...] = ()
# Pool options the runner takes as "auto" only: a count (node_workers=P) is bounded by each
# loader's own num_workers, so it belongs to one loader; "auto" suits every loader.
AUTO_ONLY_OPTIONS = ("node_workers",)
# Pool options whose runner flag takes no value (`python -m poolloader --node-pool x.py`):
# given, the option is True; its environment variable still takes true/false/1/0.
SWITCH_OPTIONS = ("node_pool",)
# Pool options that take true/false/1/0 although their default is None (the environment
# variable PoolLoader reads itself decides): `--zygote false`, `POOLLOADER_ZYGOTE=0`.
BOOLEAN_OPTIONS = ("zygote",)
# Pool options whose runner value is a list of global ranks, separated by commas
# (`--share-batches 0,1`, `POOLLOADER_SHARE_BATCHES=0,1`): PoolLoader(share_batches=[0, 1]).
RANK_LIST_OPTIONS = ("share_batches",)


def runner_option_names() -> tuple[str, ...]:
    """The pool options the runner offers for every loader of a script (its flags and
    environment variables): pool_option_names() less PER_LOADER_OPTIONS."""
    return tuple(name for name in pool_option_names() if name not in PER_LOADER_OPTIONS)


def pool_options_of(loader: PoolLoader) -> dict:
    """The pool options `loader` was built with (its attributes of the same names)."""
    return {name: getattr(loader, name) for name in pool_option_names() if hasattr(loader, name)}


class PooledDataLoader(PoolLoader):
    """A `DataLoader(...)` built while pooling was on: a PoolLoader with the runner's pool
    options. It takes PoolLoader's arguments; a pool option given explicitly wins."""

    options: ClassVar[dict] = {}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**PooledDataLoader.options, **kwargs})


# Frameworks that rebuild a loader from its __init__ signature (Lightning) see PoolLoader's.
PooledDataLoader.__init__.__signature__ = _POOLLOADER_PARAMS  # type: ignore[attr-defined]


class _Built:
    """One DataLoader built in this process while pooling was on (for the summary)."""

    def __init__(self, kind: str, name: str, where: str, num_workers, stats=None):
        self.kind = kind  # "pool", "no workers", "subclass", "unsupported: <why>"
        self.name = name
        self.where = where
        self.num_workers = num_workers
        self.stats = stats  # LoaderStats outlives its loader: the summary reads it at exit
        self.pid = os.getpid()
        self.loader: weakref.ref | None = None


# The summary lists the first and the last LISTED loaders of each kind (pooled, left as
# DataLoader) a process built; those between are counted and their figures added up,
# by where they were built (at most WHERES places, the rest as "elsewhere"), so a script
# that builds a loader per epoch or per evaluation keeps a summary of bounded size.
LISTED = 8
WHERES = 8
_FOLDED_STATS = ("batches", "worker_batches", "main_wait_s", "worker_busy_s", "worker_idle_s",
                 "slot_growths", "pool_growths", "detaches")


class _Group:
    """The loaders of one kind a process built, in memory bounded by LISTED and WHERES:
    the first and last LISTED in full, the ones between folded into `totals` (their
    stats as they were when LISTED later loaders had been built) and `wheres`."""

    def __init__(self) -> None:
        self.count = 0
        self.first: list[_Built] = []
        self.last: collections.deque[_Built] = collections.deque()
        self.folded = 0
        self.totals: dict[str, float] = dict.fromkeys(_FOLDED_STATS, 0)
        self.wheres: collections.Counter[str] = collections.Counter()

    def add(self, built: _Built) -> None:
        self.count += 1
        if len(self.first) < LISTED and not self.folded and not self.last:
            self.first.append(built)
            return
        self.last.append(built)
        if len(self.last) > LISTED:
            self._fold(self.last.popleft())

    def _fold(self, built: _Built) -> None:
        self.folded += 1
        if built.stats is not None:
            for name in _FOLDED_STATS:
                self.totals[name] += getattr(built.stats, name)
        what = _plural(built.num_workers, "worker") if built.kind == "pool" else _why(built.kind)
        where = f"{built.name} ({what}) at {built.where}"
        if where not in self.wheres and len(self.wheres) >= WHERES:
            where = "elsewhere"
        self.wheres[where] += 1

    def listed(self) -> list[_Built]:
        return self.first + list(self.last)

    def forget(self, loader) -> None:
        for entries in (self.first, self.last):
            for b in list(entries):
                if b.loader is not None and b.loader() is loader:
                    entries.remove(b)
                    self.count -= 1


class _Listing:
    """The loaders built in one process (a forked child starts its own)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.pooled = _Group()
        self.other = _Group()


class _State:
    installed = False
    options: dict | None = None  # None: pooling off
    report = True  # children print a summary of the loaders they built
    started = time.monotonic()
    listing = _Listing()
    recorders: ClassVar[list[dict]] = []  # open `recording()` blocks
    exit_hook_pid = 0
    # (PoolLoader.__init__ while _observe_pool_loaders wraps it, the original)
    observer: tuple[Callable, Callable] | None = None
    lock = threading.Lock()


def enable(options: dict, report: bool = True) -> None:
    """Pool every `DataLoader(...)` with workers built from now on in this process and in
    its spawn/forkserver children, with `options` (PoolLoader keyword arguments).
    `report`: children that build loaders print a summary when they exit."""
    unknown = set(options) - set(pool_option_names())
    if unknown:
        raise ValueError(f"unknown pool option(s) {sorted(unknown)}; "
                         f"PoolLoader takes {list(pool_option_names())}")
    _install()
    PooledDataLoader.options = dict(options)
    _State.options = dict(options)
    _State.report = report
    _State.started = time.monotonic()
    _observe_pool_loaders(True)
    rebuilds.set_pooling_every_loader(True)
    if multiprocessing.spawn.get_preparation_data is not _preparation_data:
        _preparation_data.original = multiprocessing.spawn.get_preparation_data  # type: ignore[attr-defined]
        multiprocessing.spawn.get_preparation_data = _preparation_data


def disable() -> None:
    """Stop pooling in this process (what `enable` started; the `__new__` hook stays,
    doing nothing). Loaders already built are unchanged."""
    _State.options = None
    PooledDataLoader.options = {}
    _observe_pool_loaders(False)
    rebuilds.set_pooling_every_loader(False)
    if multiprocessing.spawn.get_preparation_data is _preparation_data:
        multiprocessing.spawn.get_preparation_data = _preparation_data.original  # type: ignore[attr-defined]


def enabled() -> bool:
    return _State.options is not None


@contextlib.contextmanager
def recording() -> Iterator[dict]:
    """Within the block, every DataLoader (or PoolLoader) built in this process is
    recorded: yields a dict {id(loader): (args, kwargs)} of DataLoader's arguments, so a
    caller can rebuild a loader someone else built (poolloader.accelerate does). Other
    subclasses (StatefulDataLoader) are not: their arguments are not DataLoader's alone.
    `DataLoader.__init__` is wrapped only while some block is open (functools.wraps:
    its signature stays)."""
    calls: dict = {}
    with _State.lock:
        if not _State.recorders:
            original = DataLoader.__dict__["__init__"]

            @functools.wraps(original)
            def recording_init(self, *args, **kwargs):
                if type(self) is DataLoader or isinstance(self, PoolLoader):
                    for recorder in list(_State.recorders):
                        recorder[id(self)] = (args, kwargs)
                original(self, *args, **kwargs)
            DataLoader.__init__ = recording_init  # type: ignore[method-assign]
        _State.recorders.append(calls)
    try:
        yield calls
    finally:
        with _State.lock:
            _State.recorders.remove(calls)
            if not _State.recorders:
                DataLoader.__init__ = DataLoader.__init__.__wrapped__  # type: ignore[attr-defined,method-assign]


def forget(loader) -> None:
    """Drop `loader` from the summary (a loader replaced before it was ever used)."""
    _State.listing.pooled.forget(loader)
    _State.listing.other.forget(loader)


# -- the hook ---------------------------------------------------------------------------

def _install() -> None:
    # Once per process, never undone: a class whose __new__ was assigned cannot get
    # object.__new__'s argument handling back, so _new stays and passes through. Only
    # the runner installs it (enable), never poolloader.accelerate.
    with _State.lock:
        if not _State.installed:
            DataLoader.__new__ = _AdoptingNew()  # type: ignore[assignment,method-assign]
            _State.installed = True


class _AdoptingNew:
    """DataLoader.__new__ while the hook is installed. A descriptor rather than a
    staticmethod: read from a class (by Python when it builds an instance, or by
    `inspect.signature`), it gives a callable that builds through `_new` and reports
    the signature that class has without the hook (its `__init__`'s), so
    `inspect.signature(DataLoader)` and a subclass's stay their own."""

    def __get__(self, obj, owner=None):
        return _BoundNew(owner if owner is not None else type(obj))


class _BoundNew:
    __slots__ = ("owner",)

    def __init__(self, owner: type):
        self.owner = owner

    def __call__(self, cls, *args, **kwargs):
        return _new(cls, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        # inspect drops the first parameter (self, for __init__; cls, for __new__)
        return inspect.signature(self.owner.__init__)  # type: ignore[misc]


def _new(cls, *args, **kwargs):
    target = cls
    if (args or kwargs) and _State.options is not None:  # none: copy/pickle re-creating one
        if cls is DataLoader:
            target, kind = _choose(args, kwargs)
            if target is DataLoader:
                _track(_Built(kind, "DataLoader", _where(), _num_workers(args, kwargs)))
        elif not issubclass(cls, PoolLoader):
            _track(_Built("subclass", cls.__qualname__, _where(), _num_workers(args, kwargs)))
    # cooperative: the next __new__ after DataLoader in the class's MRO (a mixin's, or
    # object's, which takes the class alone)
    new = super(DataLoader, target).__new__
    return new(target) if new is object.__new__ else new(target, *args, **kwargs)


def _choose(args, kwargs):
    """(class to build, why not pooled) for a `DataLoader(*args, **kwargs)` call."""
    try:
        bound = _DATALOADER_PARAMS.bind(None, *args, **kwargs).arguments
    except TypeError:
        return DataLoader, "unsupported: arguments DataLoader rejects"  # its __init__ says why
    workers = bound.get("num_workers", 0)
    if not isinstance(workers, int) or workers <= 0:
        return DataLoader, "no workers"
    foreign = [name for name in bound if name not in _POOLLOADER_PARAMS.parameters]
    if foreign:
        return DataLoader, f"unsupported: PoolLoader has no argument {foreign}"
    return PooledDataLoader, "pool"


def _num_workers(args, kwargs):
    try:
        return _DATALOADER_PARAMS.bind(None, *args, **kwargs).arguments.get("num_workers", 0)
    except TypeError:
        return None


def _observe_pool_loaders(on: bool) -> None:
    """While pooling is on, every PoolLoader (built by the hook or by the script itself)
    is listed once initialised: `PoolLoader.__init__` is wrapped (functools.wraps: its
    signature stays) by enable() and unwrapped by disable(), as recording() wraps
    DataLoader's. The loader itself knows nothing of the runner."""
    with _State.lock:
        current = PoolLoader.__dict__["__init__"]
        if on and _State.observer is None:
            @functools.wraps(current)
            def observed_init(self, *args, **kwargs):
                current(self, *args, **kwargs)
                _observe(self)
            _State.observer = (observed_init, current)
            PoolLoader.__init__ = observed_init  # type: ignore[method-assign]
        elif not on and _State.observer is not None and current is _State.observer[0]:
            PoolLoader.__init__ = _State.observer[1]  # type: ignore[method-assign]
            _State.observer = None


def _observe(loader: PoolLoader) -> None:
    """Every PoolLoader (built by the hook or by the script itself), once initialised."""
    kind = "pool" if loader.num_workers > 0 else "no workers"
    built = _Built(kind, type(loader).__qualname__, _where(), loader.num_workers, loader.stats)
    built.loader = weakref.ref(loader)
    if _State.report:  # the summary's memory line: read as each iterator stops its workers
        loader.stats.memory_at_shutdown = True
    _track(built)


def _track(built: _Built) -> None:
    if _State.listing.pid != os.getpid():
        _State.listing = _Listing()  # a forked child: the parent's loaders are not its own
    group = _State.listing.pooled if built.kind == "pool" else _State.listing.other
    group.add(built)
    if _State.report and _State.exit_hook_pid != os.getpid():
        # A process other than the runner's main one (a spawn child, a forked DDP rank)
        # reports the loaders it built when it exits. multiprocessing children leave
        # through os._exit (no atexit) after running multiprocessing's finalizers.
        _State.exit_hook_pid = os.getpid()
        if multiprocessing.parent_process() is not None:
            multiprocessing.util.Finalize(None, print_summary, exitpriority=0)
        else:
            atexit.register(print_summary)


def print_summary_at_exit() -> None:
    """Print `summary()` on stderr when this process exits, even if it built no loader
    (the runner's main process)."""
    _State.exit_hook_pid = os.getpid()
    atexit.register(print_summary)


def print_summary(file=None) -> None:
    """Print `summary()` (on stderr by default); what SIGUSR1 does under the runner."""
    print(summary(), file=sys.stderr if file is None else file, flush=True)


# -- where a loader was built -----------------------------------------------------------

def _where() -> str:
    """`file:line` of the code that built the loader (errors.user_frame: the innermost frame
    outside torch's data package, poolloader and typing), plus `via script:line` when the
    script's own line is further out."""
    frame, _level = user_frame(skip=(typing.__file__,))
    where = f"{_short(frame.f_code.co_filename)}:{frame.f_lineno}"
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    outer: types.FrameType | None = frame
    while outer is not None and main_file and outer.f_code.co_filename != main_file:
        outer = outer.f_back
    if outer is not None and outer is not frame and main_file:
        where += f" via {_short(main_file)}:{outer.f_lineno}"
    return where


def _short(path: str) -> str:
    """`path` relative to the sys.path entry (site-packages) or the cwd that holds it."""
    best = ""
    for root in [os.getcwd()] + [p for p in sys.path if p]:
        root = os.path.join(os.path.abspath(root), "")
        if path.startswith(root) and len(root) > len(best):
            best = root
    return path[len(best):] if best else path


# -- the summary ------------------------------------------------------------------------

def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"


def _plural(n: int, word: str, words: str = "") -> str:
    return f"{n} {word if n == 1 else words or word + 's'}"


AUTO_MOVES_SHOWN = 4  # node_workers="auto": its latest moves in a loader's summary


def summary() -> str:
    """A short report of the loaders built in this process while pooling was on:
    per pooled loader, batches, how long next() waited (share of the run so far),
    worker busy/idle, pool size and growths, the memory line, and its stats.advice();
    then the loaders left as DataLoader."""
    pid = os.getpid()
    elapsed = time.monotonic() - _State.started
    listing = _State.listing if _State.listing.pid == pid else _Listing()
    pooled, other = listing.pooled, listing.other
    process = multiprocessing.current_process().name
    if os.environ.get("RANK") is not None:  # torchrun / accelerate launch
        process += f", rank {os.environ['RANK']}"
    head = (f"poolloader: {_plural(pooled.count, 'loader')} with a slot pool, "
            f"{elapsed:.1f} s run (pid {pid}, {process})")
    lines = [head]
    if not pooled.count and not other.count:
        lines.append("  no DataLoader was built")
    for i, b in _numbered(pooled):
        if b is None:
            lines += _folded_lines(pooled, elapsed)
            continue
        s = b.stats
        lines.append(f"  #{i} {b.name}, {_plural(b.num_workers, 'worker')}, built at {b.where}")
        if s.batches == 0 and s.worker_batches == 0:
            lines.append("     never iterated")
            continue
        work = s.worker_busy_s + s.worker_idle_s
        busy = f" ({100 * s.worker_busy_s / work:.0f}% busy)" if work > 0 else ""
        lines.append(
            f"     {_plural(s.batches, 'batch', 'batches')}; next() waited "
            f"{s.main_wait_s:.2f} s ({100 * s.main_wait_s / max(elapsed, 1e-9):.1f}% of the run); "
            f"workers busy {s.worker_busy_s:.2f} s, idle {s.worker_idle_s:.2f} s{busy}")
        lines.append(
            f"     pool {_plural(s.peak_slot_count, 'slot')}, {_mib(s.peak_pool_bytes)} at most "
            f"(slots of {_mib(max(s.learned_slot_bytes, s.slot_bytes))}); "
            f"{_plural(s.slot_growths, 'slot growth')}, {_plural(s.pool_growths, 'pool growth')}, "
            f"{s.detaches} held batches detached")
        lines += _memory_lines(s)
        moves = s.auto_moves  # node_workers="auto": its first choice and latest moves
        shown = moves[:1] + moves[1:][-AUTO_MOVES_SHOWN:]
        if len(moves) > len(shown):
            shown.insert(1, f"... {_plural(len(moves) - len(shown), 'earlier move')}")
        lines += [f"     {move}" for move in shown]
        for k, statement in enumerate(s.advice().splitlines()):
            lines.append(("     advice: " if k == 0 else "             ") + statement)
    if other.count:
        lines.append(f"  left as DataLoader ({other.count}):" if other.folded
                     else "  left as DataLoader:")
        for _i, b in _numbered(other):
            if b is None:
                lines.append(f"     ... {_plural(other.folded, 'more loader')} not listed:")
                lines += [f"       {n} x {where}" for where, n in other.wheres.most_common()]
                continue
            lines.append(f"     {b.name} ({_why(b.kind)}) built at {b.where}")
    return "\n".join(lines)


def _memory_lines(stats) -> list[str]:
    """The memory line of one loader: its workers' now if an iterator is live (SIGUSR1
    mid-epoch), else as they were when the last iterator stopped them."""
    memory = stats.memory()
    when = "now"
    if not memory.workers:
        memory, when = stats.last_memory, "as its workers stopped"
    if memory is None or not memory.workers:
        return []
    return [f"     memory ({when}): {memory.line()}"]


def _why(kind: str) -> str:
    return {"no workers": "num_workers=0",
            "subclass": "a DataLoader subclass, built as written"}.get(kind, kind)


def _numbered(group: _Group):
    """(number, loader) for each listed loader, with (None, None) where the folded ones
    were built."""
    for i, b in enumerate(group.first, 1):
        yield i, b
    if group.folded:
        yield None, None
    start = group.count - len(group.last) + 1
    for i, b in enumerate(group.last, start):
        yield i, b


def _folded_lines(group: _Group, elapsed: float) -> list[str]:
    t = group.totals
    first, last = len(group.first) + 1, len(group.first) + group.folded
    lines = [f"  #{first}-#{last}: {_plural(group.folded, 'more loader')} not listed (the "
             f"summary lists the first and last {LISTED}); together "
             f"{_plural(int(t['batches']), 'batch', 'batches')}; next() waited "
             f"{t['main_wait_s']:.2f} s ({100 * t['main_wait_s'] / max(elapsed, 1e-9):.1f}% "
             f"of the run); workers busy {t['worker_busy_s']:.2f} s, idle "
             f"{t['worker_idle_s']:.2f} s; {_plural(int(t['slot_growths']), 'slot growth')}, "
             f"{_plural(int(t['pool_growths']), 'pool growth')}, "
             f"{int(t['detaches'])} held batches detached"]
    lines += [f"     {n} x {where}" for where, n in group.wheres.most_common()]
    return lines


# -- spawn / forkserver children --------------------------------------------------------

class _ChildSetup:
    """Travels in multiprocessing's preparation data; unpickling it in the child turns
    pooling on there before the child re-imports the main module."""

    def __init__(self, options: dict, report: bool):
        self.options = options
        self.report = report

    def __reduce__(self):
        return _enable_in_child, (self.options, self.report)


def _enable_in_child(options: dict, report: bool) -> None:
    enable(options, report)


def _preparation_data(name):
    data = _preparation_data.original(name)
    if _State.options is not None:
        # prepare() ignores unknown keys
        data["poolloader"] = _ChildSetup(dict(_State.options), _State.report)
    return data
