"""Checked cleanup for every test: no new /dev/shm name, no live child process.

The autouse fixture snapshots /dev/shm and this process's live children before
the test, and after it polls for up to SETTLE_S seconds (workers and spawned
children take a moment to exit and unlink). Whatever is still there is reported
as a teardown error, then cleaned up so one leak does not fail the tests after it:
the new names starting with "pl" are unlinked, the new children are SIGKILLed by
pid (never by name, never anything the test did not start).

Children are found (tests/proc.py, the tests' one /proc reader) by scanning
/proc/*/stat for our pid as ppid (the kernel here has no
/proc/<pid>/task/<tid>/children). Zombies do not count: an exited child that
multiprocessing has not reaped yet is not running anything. multiprocessing's own
service processes (resource tracker, forkserver), which live for the whole session
once started, are not counted either.

Other processes on the same host (another pytest session, an xdist worker, a
DataLoader run making and leaking torch_<pid>_* segments) also create names while
a test runs. A new name is not blamed on the test when
  * it is mapped or held open only by processes outside this process's tree
    (found through /proc/*/maps and /proc/*/fd), or
  * nobody holds it and it names no pid of this process or of a descendant seen
    during the test: its first number is another pid (`pltest-<pid>-`,
    `torch_<pid>_`), or it has none (multiprocessing's `sem.mp-<random>`, which
    another job on the machine makes and may leave behind, or hold from a PID
    namespace whose processes this one cannot see).
Only what this test's processes hold or named after themselves is blamed: a name
this process or a descendant still holds, or an unheld one that carries one of
their pids. Every name poolloader and the tests make carries its creator's pid.
(Blind spots: an unheld name that carries the pid of a child which has already
exited; an unheld name without a pid that this test's processes left.)

Once every test module is imported, gc.freeze() moves what importing made (torch,
lightning, the test modules: some 300,000 objects) out of the collector's reach: each
gc.collect() here and in the tests (the teardown's, both_loaders' between its loaders)
took 0.25-0.5 s walking them, over a minute of a full run per hundred tests. What the
tests make afterwards is collected as before; nothing imported is garbage.

The forkserver preloads torch (multiprocessing.set_forkserver_preload), as a training
script that uses forkserver does to start workers fast: every forkserver child (the
tests start some hundred) is then a fork of a process that has imported torch, instead
of importing it again (1.5 s of CPU each, 27 s -> 7.5 s for the forkserver cases of
test_descriptors, test_shared_arrays and test_startup). poolloader and the tests'
modules are not preloaded: each worker still imports them and unpickles its start-up
arguments as any forkserver worker does. Spawn workers, the fully fresh start, are
unaffected and still run where a test covers spawn. That preload serves DataLoader's
forkserver workers (and PoolLoader(zygote=False)): PoolLoader's spawn and forkserver
workers are forked by this process's zygotes (poolloader.worker.zygote), started once
per start method and reused by every test, counted as service processes like the
forkserver; the workers they fork count as this process's children.

The ranks the tests start for a share_batches group wait for each other up to 60 s
(POOLLOADER_SHARE_WAIT, 5 s by default): on this loaded 2-core machine a rank's start
can lag its peers' by more than the default, and the group would then load apart
(correct batches, but not the sharing those tests check). The test of that wait sets
its own.

The README runs the suite in two pytest-xdist workers (`-n 2`): the machine has 2
cores and one pytest process used about 1.2 of them (its tests wait on their workers,
their children and their ranks). Each xdist worker is a pytest process of its own with
everything below (the checks see only its own tree; another worker's names and children
are another process's, as another session's are). The modules in ONE_WORKER_MODULES
make a module-scoped fixture that costs seconds (torchrun jobs, the runner's arms, the
resumes): their tests go to one worker together, so it is made once
(pytest_xdist_make_scheduler; xdist's own `--dist loadgroup` marks cannot do it with
pytest 9, whose node ids xdist can no longer rename).

A test's time is bounded twice. pytest-timeout (`timeout` in pyproject.toml, or the
test's own mark) raises in the test when it runs out: the test fails and the run goes
on. That exception can be lost, though: raised inside a `__del__` or a finaliser that
was waiting, it is printed and dropped, and the wait goes on. A hang must fail CI, never
eat its time, so a backstop (faulthandler's timer) fires BACKSTOP_S after the
test's own limit: it writes every thread's stack to the terminal and ends the run.
"""
import faulthandler
import gc
import multiprocessing
import os
import re
import signal
import time
import uuid

import _rank_zygote as rank_zygote
import proc
import pytest

SHM_DIR = "/dev/shm"
# POOLLOADER_TEST_START_METHOD=forkserver runs the tests with that process-wide default
# start method, as Python 3.14 has on Linux (DataLoader and PoolLoader both follow it).
START_METHOD_ENV = "POOLLOADER_TEST_START_METHOD"


def pytest_configure(config):
    multiprocessing.set_forkserver_preload(["torch"])  # see the module docstring
    os.environ.setdefault("POOLLOADER_SHARE_WAIT", "60")  # see the module docstring
    method = os.environ.get(START_METHOD_ENV)
    if method:
        multiprocessing.set_start_method(method, force=True)
    global _backstop_fd
    _backstop_fd = os.dup(2)  # the terminal: capture is not active in pytest_configure
    if getattr(config.option, "numprocesses", None) and config.option.maxworkerrestart is None:
        # under xdist a crashed worker (the backstop's exit among them) ends the run, as
        # the backstop ends a run without xdist; see pytest_xdist_make_scheduler
        config.option.maxworkerrestart = "0"


# Modules whose tests share a module-scoped fixture that costs seconds: under xdist all
# of a module's tests run in one worker (see the module docstring).
ONE_WORKER_MODULES = frozenset({"test_train_script.py", "test_runner.py", "test_resume.py"})


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`-n N` (xdist's `--dist load`): each test is a unit of its own, as with `load`,
    except that a module of ONE_WORKER_MODULES is one unit (sent first: xdist orders
    units by size). Only while a crashed worker ends the run (`--max-worker-restart 0`,
    set in pytest_configure unless given): LoadScopeScheduling's recovery sends a new
    worker one unit, and a worker runs nothing until it holds two, so with units of one
    test a replaced worker would wait forever. Otherwise xdist's own `load` runs."""
    if config.getoption("dist") != "load" or str(config.getoption("maxworkerrestart")) != "0":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            module = nodeid.split("::", 1)[0]
            return module if os.path.basename(module) in ONE_WORKER_MODULES else nodeid

    return ModuleFixtureScheduling(config, log)


def pytest_unconfigure(config):
    rank_zygote.stop()
    global _backstop_fd
    if _backstop_fd is not None:
        os.close(_backstop_fd)
        _backstop_fd = None


def _test_limit(item) -> float:
    """The test's pytest-timeout limit in seconds, as pytest-timeout reads it: the
    test's mark, else --timeout, else PYTEST_TIMEOUT, else the ini's; 0 without the
    plugin (-p no:timeout)."""
    mark = item.get_closest_marker("timeout")
    if mark is not None and mark.args:
        return float(mark.args[0] or 0)
    if mark is not None and "timeout" in mark.kwargs:
        return float(mark.kwargs["timeout"] or 0)
    try:
        option = item.config.getoption("timeout", None)
        ini = item.config.getini("timeout")
    except ValueError:  # the plugin is not loaded: no limit to back up
        return 0.0
    for value in (option, os.environ.get("PYTEST_TIMEOUT"), ini):
        if value not in (None, ""):
            return float(value)
    return 0.0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The backstop (see the module docstring): armed for the test's setup, call and
    teardown; a test with no limit has none."""
    limit = _test_limit(item)
    if limit > 0 and _backstop_fd is not None:
        faulthandler.dump_traceback_later(limit + BACKSTOP_S, exit=True, file=_backstop_fd)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()  # see the module docstring


SETTLE_S = 5.0
BACKSTOP_S = 60.0  # past the test's own limit (module docstring)
_backstop_fd = None  # a dup of the terminal's stderr, made in pytest_configure
_FIRST_NUMBER = re.compile(r"(?:^|[_.-])(\d+)(?:[_.-]|$)")


def _shm_names():
    try:
        return set(os.listdir(SHM_DIR))
    except FileNotFoundError:
        return set()


def _foreign(names, tree):
    """The names among `names` that are another process's (see the module docstring).

    `tree`: pids of this process and every descendant seen during the test.
    """
    foreign = set()
    for name, pids in proc.shm_holders(names).items():
        if pids:
            if not pids & tree:
                foreign.add(name)
        else:
            number = _FIRST_NUMBER.search(name)
            if not number or int(number.group(1)) not in tree:
                foreign.add(name)
    return foreign


def _service_pids():
    """multiprocessing's session-long helper processes, if started, poolloader's
    zygotes (poolloader.worker.zygote: one per start method, reused by every test) and
    the ranks' (tests/_rank_zygote.py)."""
    from multiprocessing import forkserver, resource_tracker

    from poolloader.worker import zygote

    pids = {getattr(resource_tracker._resource_tracker, "_pid", None),
            getattr(forkserver._forkserver, "_forkserver_pid", None), *zygote.pids(),
            *rank_zygote.pids()}
    return {pid for pid in pids if pid}


def _children(table):
    """This process's live children and those of its zygotes (the workers they forked
    for this process's loaders, the ranks the ranks' zygote forked)."""
    from poolloader.worker import zygote

    found = proc.live_children(table)
    for pid in [*zygote.pids(), *rank_zygote.pids()]:
        found.update(proc.live_children(table, pid))
    return found


@pytest.fixture(autouse=True)
def no_leaked_shm_or_children():
    names_before = _shm_names()
    table = proc.process_table()
    children_before = set(_children(table))
    tree = proc.tree(table)
    yield
    # A loader iterator kept alive by a reference cycle (an exception traceback
    # holding its frame) shuts down when collected, as DataLoader's does.
    gc.collect()
    deadline = time.monotonic() + SETTLE_S
    foreign = set()  # other processes' names, not this test's
    while True:
        multiprocessing.active_children()  # reaps multiprocessing children that exited
        table = proc.process_table()
        tree |= proc.tree(table)
        new_names = _shm_names() - names_before - foreign
        if new_names:
            foreign |= _foreign(new_names, tree)
            new_names = sorted(new_names - foreign)
        new_children = {pid: cmd for pid, cmd in _children(table).items()
                        if pid not in children_before and pid not in _service_pids()}
        if not (new_names or new_children) or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    if not (new_names or new_children):
        return

    problems = []
    if new_names:
        removed = []
        for name in new_names:
            if name.startswith("pl"):
                try:
                    os.unlink(os.path.join(SHM_DIR, name))
                    removed.append(name)
                except FileNotFoundError:
                    pass
        problems.append(
            f"left {len(new_names)} new name(s) in {SHM_DIR} after {SETTLE_S:.0f} s: "
            f"{new_names} (unlinked: {removed})")
    if new_children:
        for pid in new_children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        gone_by = time.monotonic() + 2.0
        while time.monotonic() < gone_by and set(new_children) & set(_children(proc.process_table())):
            multiprocessing.active_children()
            time.sleep(0.02)
        listing = ", ".join(f"pid {pid} ({cmd})" for pid, cmd in new_children.items())
        problems.append(
            f"left {len(new_children)} live child process(es) after {SETTLE_S:.0f} s: "
            f"{listing} (sent SIGKILL)")
    pytest.fail("; ".join(problems), pytrace=False)


@pytest.fixture
def shm_name_prefix():
    """A POSIX shm name prefix no other test (or parallel run) uses: `/pltest-<pid>-<rand>-`."""
    return f"/pltest-{os.getpid()}-{uuid.uuid4().hex[:8]}-"
