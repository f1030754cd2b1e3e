"""Worker start at fork's speed under spawn and forkserver: a start-up process (a
"zygote") that imported torch once, forking each worker on request.

Under spawn and forkserver every DataLoader worker is a fresh interpreter that imports
torch, numpy and the user's modules again: seconds per worker, at every epoch without
persistent workers. Here each loader-owning process keeps one zygote per start method
(a private `multiprocessing.forkserver.ForkServer`, never the global one, so
`set_forkserver_preload` and every other user of multiprocessing are untouched):

* started as a fresh interpreter (nothing of main is inherited; main's `sys.path` as of
  its start, so the user's modules import there as in main), it imports torch, numpy,
  poolloader's worker loop and the modules the loader's dataset, `collate_fn` and
  `worker_init_fn` (and the dataset's attributes) are defined in and what the main
  script imported, then serves fork requests exactly as CPython's forkserver does (the
  same code: `forkserver.main`). It touches no device and forks from one thread: the
  thread OpenBLAS starts as numpy is imported stops before every fork (its at-fork
  handler; a first fork right after the imports stops it), and the forkserver loop is
  single-threaded; a module whose import leaves another thread running is announced on
  stderr and the modules after it are left to the workers.
* each worker is a fork of it that then runs CPython's spawn bootstrap
  (`spawn._main`): main's `sys.path`, working directory, `sys.argv`, process name and
  authkey as of `iter()` (multiprocessing's preparation data), and `__main__` as spawn
  and forkserver give it on this Python (the main script run again as `__mp_main__`;
  its imports are already loaded, so this costs what its own top level does). Before
  that, main's `os.environ` as of `iter()` replaces the zygote's (`_Environ`). The
  process object is the one `ctx.Process` made (same class, name, `parent_process()`).
* main talks to a worker through the forkserver protocol: the status pipe gives its pid
  and, when the zygote reaps it, its exit status (a signal is named as under
  forkserver). That is one descriptor per worker in main, under spawn too (as
  DataLoader's forkserver workers keep).
* the zygote exits with its owner: when the last holder of the alive pipe's write end
  (main, and children main forked while it ran) is gone, SIGKILL included. A zygote
  that died is started again at the next worker start; a worker whose zygote died
  mid-epoch is killed (nobody could reap it or report its exit) and reported
  (`lost`).

Off: PoolLoader(zygote=False) or POOLLOADER_ZYGOTE=0; under fork it is never used.
Reaches into multiprocessing's internals (ForkServer's fields, the forkserver Popen),
like poolloader.worker.popen; nothing else in poolloader does.
"""
from __future__ import annotations

import functools
import io
import os
import signal
import socket
import sys
import threading
import time
import types
from collections.abc import Iterable
from multiprocessing import connection, forkserver, popen_forkserver, resource_tracker, spawn, util
from multiprocessing.context import reduction, set_spawning_popen  # type: ignore[attr-defined]

ENV = "POOLLOADER_ZYGOTE"
METHODS = ("spawn", "forkserver")
# Always preloaded: what every worker imports before it runs a line of the user's.
BASE_MODULES = ("torch", "numpy", "poolloader.worker.loop", "poolloader.worker.startup")


def enabled(requested: bool | None) -> bool:
    """PoolLoader(zygote=): True/False as given; None: $POOLLOADER_ZYGOTE (true/false/1/0,
    any case, as the runner's switches; unset or empty: on)."""
    if requested is not None:
        return bool(requested)
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", "1", "true"):
        return True
    if value in ("0", "false"):
        return False
    raise ValueError(f"{ENV}={value!r}: must be one of true, false, 1, 0 (any case); or "
                     "PoolLoader(zygote=True/False), which wins")


def method_of(ctx) -> str | None:
    """The start method of a multiprocessing context (or of torch.multiprocessing)."""
    get = getattr(ctx, "get_start_method", None)
    return get() if get is not None else None


def modules_of(*objects) -> list[str]:
    """What a zygote preloads beyond BASE_MODULES: the modules `objects` (dataset,
    collate_fn, worker_init_fn), their types and the types of a dataset's attribute
    values are defined in, and what the main script imported (its module-level names
    that are modules, classes or functions): each worker runs the main script again
    (as `__mp_main__`, as spawn does), and those imports then cost nothing."""
    names: list[str] = []
    for obj in objects:
        if obj is None:
            continue
        found = [getattr(obj, "__module__", None), type(obj).__module__]
        found += [type(v).__module__ for v in getattr(obj, "__dict__", {}).values()]
        found += [getattr(getattr(obj, "func", None), "__module__", None)]  # partial
        names += [n for n in found if isinstance(n, str)]
    main = sys.modules.get("__main__")
    for value in list(getattr(main, "__dict__", {}).values()):
        if isinstance(value, types.ModuleType):
            names.append(value.__name__)
        elif isinstance(value, type) or isinstance(value, types.FunctionType):
            names.append(getattr(value, "__module__", None))  # type: ignore[arg-type]
    skip = ("builtins", "__main__", "__mp_main__")
    return [n for n in dict.fromkeys(names) if isinstance(n, str) and n not in skip]


class _Zygote(forkserver.ForkServer):
    """One private forkserver of this process: CPython's ForkServer, started with our
    command (main's sys.path; `serve`'s preload) instead of the global one's."""

    def __init__(self, method: str, modules: Iterable[str]):
        super().__init__()
        self.method = method
        self.modules = tuple(dict.fromkeys((*BASE_MODULES, *modules)))
        self._preload_modules = list(self.modules)

    @property
    def pid(self) -> int | None:
        return self._forkserver_pid

    def ensure_running(self) -> None:
        """Start the zygote unless it runs (CPython's ensure_running, our command); a
        zygote that exited is reaped and started again."""
        with self._lock:  # type: ignore[attr-defined]
            resource_tracker.ensure_running()
            if self._forkserver_pid is not None:  # type: ignore[has-type]
                if not _exited(self._forkserver_pid):  # type: ignore[has-type]
                    return
                self._forget()
            cmd = (f"import sys; sys.path[:] = {sys.path!r}; "
                   "from poolloader.worker.zygote import serve; "
                   f"serve(%d, %d, {list(self.modules)!r})")
            with socket.socket(socket.AF_UNIX) as listener:
                address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
                listener.bind(address)
                if not util.is_abstract_socket_namespace(address):
                    os.chmod(address, 0o600)
                listener.listen()
                alive_r, alive_w = os.pipe()
                try:
                    exe = spawn.get_executable()
                    args = [exe, *util._args_from_interpreter_flags(), "-c",  # type: ignore[attr-defined]
                            cmd % (listener.fileno(), alive_r)]
                    pid = util.spawnv_passfds(exe, args, [listener.fileno(), alive_r])  # type: ignore[arg-type]
                except BaseException:
                    os.close(alive_w)
                    raise
                finally:
                    os.close(alive_r)
                self._forkserver_address = address
                self._forkserver_alive_fd = alive_w
                self._forkserver_pid = pid

    def connect_to_new_process(self, fds):
        """CPython's request for a child; a zygote found dead here (killed since the
        last request: its socket refuses) is reaped and started again, once."""
        try:
            return super().connect_to_new_process(fds)
        except OSError:
            if not self._reaped_within(5.0):
                raise
        return super().connect_to_new_process(fds)

    def _reaped_within(self, timeout: float) -> bool:
        """Whether the zygote exited (reaped and forgotten) within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._lock:  # type: ignore[attr-defined]
            while self._forkserver_pid is not None:
                if _exited(self._forkserver_pid):
                    self._forget()
                    return True
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.01)
        return True

    def _forget(self) -> None:
        os.close(self._forkserver_alive_fd)
        address = self._forkserver_address
        if address and not util.is_abstract_socket_namespace(address):
            try:
                os.unlink(address)
            except OSError:
                pass
        self._forkserver_address = self._forkserver_alive_fd = self._forkserver_pid = None  # type: ignore[assignment]

    def stop(self, timeout: float = 5.0) -> None:
        """Close the alive pipe (the zygote exits) and reap it, bounded: SIGKILL after
        `timeout` seconds."""
        with self._lock:  # type: ignore[attr-defined]
            pid = self._forkserver_pid
            if pid is None:
                return
            self._forget()
            deadline = time.monotonic() + timeout
            while not _exited(pid):
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    while not _exited(pid):
                        time.sleep(0.01)
                    return
                time.sleep(0.01)


def _exited(pid: int) -> bool:
    """Whether the zygote `pid` (this process's child) exited; reaps it if so. One that
    someone else reaped (os.waitpid(-1)) has exited too."""
    try:
        return os.waitpid(pid, os.WNOHANG)[0] != 0
    except ChildProcessError:
        return True


_lock = threading.Lock()
_zygotes: dict[tuple[int, str], _Zygote] = {}


def get(method: str, modules: Iterable[str] = ()) -> _Zygote:
    """This process's zygote for `method` (spawn or forkserver), started (in the
    background: it imports while the caller goes on) if it is not running. Reused by
    every loader of this process with that start method; the first caller's `modules`
    are preloaded (a later loader's other modules are imported by each worker)."""
    if method not in METHODS:
        raise ValueError(f"internal error: no zygote for start method {method!r}")
    with _lock:
        key = (os.getpid(), method)  # a forked child starts its own
        zygote = _zygotes.get(key)
        if zygote is None:
            zygote = _zygotes[key] = _Zygote(method, modules)
    zygote.ensure_running()
    return zygote


def pids() -> list[int]:
    """The pids of this process's running zygotes (tests count them as service
    processes, like multiprocessing's forkserver)."""
    me = os.getpid()
    return [z.pid for (owner, _), z in list(_zygotes.items()) if owner == me and z.pid is not None]


def stop_all() -> None:
    """Stop this process's zygotes and forget them: a worker started later starts a
    fresh one, which preloads its own loader's modules."""
    me = os.getpid()
    with _lock:
        mine = [_zygotes.pop(key) for key in list(_zygotes) if key[0] == me]
    for z in mine:
        z.stop()


def serve(listener_fd: int, alive_r: int, modules: list[str]) -> None:
    """The zygote's main (its command line calls it): import `modules` (one that fails
    is left to the workers, which import it again and report its error), then
    CPython's forkserver loop until the alive pipe closes."""
    for name in modules:
        try:
            __import__(name)
        except BaseException:  # noqa: BLE001 - a worker imports it again and reports it
            pass
        threads = _threads() if _threads() == 1 else _threads_after_a_fork()
        if threads > 1:  # a fork copies one thread: locks the others held stay held
            print(f"poolloader: importing {name!r} in the start-up process (zygote) started "
                  f"{threads - 1} thread(s); its workers are forked with them gone, which a "
                  "library may not expect. Modules after it are left to each worker; "
                  "PoolLoader(zygote=False) or POOLLOADER_ZYGOTE=0 starts every worker as a "
                  "fresh interpreter.", file=sys.stderr, flush=True)
            break
    forkserver.main(listener_fd, alive_r, [])


def _threads_after_a_fork() -> int:
    """_threads() once a child was forked (and left at once): libraries whose thread
    pools are fork-safe stop them in their at-fork handlers (OpenBLAS, which numpy
    loads, starts one at import and stops it before every fork)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return _threads()


def _threads() -> int:
    """This process's threads (native ones too), 1 where /proc cannot tell."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def _apply_environ(environ: dict, stdio: tuple = ()) -> None:
    """In a worker, while its preparation data is unpickled (before the main script
    runs again): main's os.environ as of its start replaces the zygote's, and main's
    stdout and stderr (passed with the request: `stdio` pairs the fd to replace with
    its index among the inherited descriptors) replace the zygote's, as a spawned
    child inherits them."""
    os.environ.clear()
    os.environ.update(environ)
    inherited = forkserver.get_inherited_fds() or []
    for target, index in stdio:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        os.dup2(inherited[index], target)
        os.close(inherited[index])


class _Environ:
    """Main's os.environ (and stdout/stderr), carried in the preparation data;
    unpickling applies them (_apply_environ)."""

    def __init__(self, environ: dict, stdio: tuple):
        self.environ = environ
        self.stdio = stdio

    def __reduce__(self):
        return _apply_environ, (self.environ, self.stdio)


class _ZygotePopen(popen_forkserver.Popen):
    """popen_forkserver.Popen through `zygote` instead of the global forkserver, with
    main's os.environ in the preparation data; a status pipe that ends without a status
    (the zygote died) kills the orphaned worker and marks it `zygote_lost`."""

    zygote_lost: int | None = None  # the dead zygote's pid

    def __init__(self, process_obj, zygote: _Zygote):
        vars(process_obj).pop("_Popen", None)  # set by `start`, not part of the process
        self._zygote = zygote
        super().__init__(process_obj)

    def _launch(self, process_obj) -> None:
        prep_data = spawn.get_preparation_data(process_obj._name)
        stdio = tuple((fd, self.duplicate_for_child(fd)) for fd in (1, 2) if _is_open(fd))
        prep_data["poolloader_environ"] = _Environ(dict(os.environ), stdio)
        buf = io.BytesIO()
        set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            set_spawning_popen(None)
        self.sentinel, w = self._zygote.connect_to_new_process(self._fds)  # type: ignore[attr-defined]
        _parent_w = os.dup(w)
        self.finalizer = util.Finalize(self, util.close_fds, (_parent_w, self.sentinel))  # type: ignore[attr-defined]
        try:
            with open(w, "wb", closefd=True) as f:
                f.write(buf.getbuffer())
            self.pid = forkserver.read_signed(self.sentinel)
        except (OSError, EOFError):
            self.finalizer()
            raise RuntimeError(
                f"PoolLoader: the start-up process (zygote, pid {self._zygote.pid}) exited "
                "before it started a worker; the next iter() starts a new one. "
                "PoolLoader(zygote=False) or POOLLOADER_ZYGOTE=0 starts every worker as a "
                "fresh interpreter instead") from None

    def poll(self, flag=os.WNOHANG):
        if self.returncode is None:
            timeout = 0 if flag == os.WNOHANG else None
            if not connection.wait([self.sentinel], timeout):
                return None
            try:
                self.returncode = forkserver.read_signed(self.sentinel)
            except (OSError, EOFError):
                self.zygote_lost = self._zygote.pid or -1
                try:
                    os.kill(self.pid, signal.SIGKILL)  # orphaned: nobody reaps or reports it
                except OSError:
                    pass
                self.returncode = 255  # as multiprocessing reports a lost forkserver
        return self.returncode


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def start(process, zygote: _Zygote) -> None:
    """Start `process` (made by ctx.Process, not started) as a fork of `zygote`."""
    process._Popen = functools.partial(_ZygotePopen, zygote=zygote)
    process.start()


def lost(process) -> int | None:
    """The pid of the zygote whose death ended `process` (a worker it forked), else None."""
    return getattr(getattr(process, "_popen", None), "zygote_lost", None)
