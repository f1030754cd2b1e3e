"""The ranks' zygote: one process of the test session that has imported torch and forks
each simulated rank (tests/test_node_pool.py `_ranks`) from there.

Why: a rank is `python tests/_node_children.py CASE ...`, and importing torch is most of
its start (2.3 s of CPU on the 2-core CI machine; the rank tests start some two hundred
ranks, each test two to four at once). A fork of a process that has imported torch and
nothing else starts in milliseconds, as the ranks of `torch.multiprocessing` with the
fork or forkserver method (or Lightning's `ddp_fork`) do. What a rank does after that is
the same: the zygote imports torch only (no poolloader, no test module, nothing run), so
the child script imports everything else itself, under the rank's own environment.

The forked rank is made to look like `subprocess.Popen([sys.executable, script, *args],
env=env, stdout=log, stderr=STDOUT, stdin=DEVNULL, start_new_session=True)`: a session
of its own, the environment replaced, stdin from /dev/null, stdout and stderr to the
log, `sys.argv` and `sys.path[0]` (+ PYTHONPATH) those of the script; it runs the script
as `__main__` and leaves through the interpreter's own exit (threads joined, atexit
handlers run), its status that of `python script`. Ranks that must not share a parent
(the tests' `dist=True` ranks, each the child of its own shell) do not come from here.

Protocol, one JSON line each way: the client writes {"argv", "env", "log"}, the zygote
answers {"started": pid} and, when that child exits, {"pid": pid, "code": exit code as
Popen's returncode}. The zygote leaves when its stdin closes (at the session's end).
"""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time

# ---------------------------------------------------------------------------------------
# client side (the pytest process)

_lock = threading.Lock()
_server: subprocess.Popen | None = None
_buffer = b""
_codes: dict[int, int] = {}  # pid -> exit code, as the zygote reported it
_started: list[int] = []


def _ensure_server() -> subprocess.Popen:
    global _server, _buffer
    if _server is not None and _server.poll() is None:
        return _server
    _server = subprocess.Popen([sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=None)
    _buffer = b""
    os.set_blocking(_server.stdout.fileno(), False)
    return _server


def pids() -> list[int]:
    """The zygote's pid, if it runs (a session-long service process, as the forkserver)."""
    return [_server.pid] if _server is not None and _server.poll() is None else []


def stop() -> None:
    global _server
    if _server is not None:
        _server.stdin.close()
        try:
            _server.wait(10)
        except subprocess.TimeoutExpired:
            _server.kill()
            _server.wait(10)
        _server = None


def _read(timeout: float) -> list[dict]:
    """The complete lines the zygote wrote, waiting up to `timeout` s for the first."""
    global _buffer
    server = _ensure_server()
    fd = server.stdout.fileno()
    ready, _, _ = select.select([fd], [], [], timeout)
    if ready:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            chunk = b""
        if not chunk and server.poll() is not None:
            raise RuntimeError(f"the ranks' zygote exited ({server.returncode})")
        _buffer += chunk
    *lines, _buffer = _buffer.split(b"\n")
    messages = [json.loads(line) for line in lines if line]
    for message in messages:
        if "code" in message:
            _codes[message["pid"]] = message["code"]
        else:
            _started.append(message["started"])
    return messages


class Rank:
    """A rank the zygote forked: Popen's pid, poll(), wait() and returncode."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            with _lock:
                _read(0)
                self.returncode = _codes.pop(self.pid, None)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout)
            with _lock:
                _read(0.02)
        return self.returncode


def start(argv: list[str], env: dict, log_path: str, timeout: float = 30.0) -> Rank:
    """Fork `python argv...` under `env`, its output appended to `log_path`."""
    with _lock:
        server = _ensure_server()
        server.stdin.write(json.dumps({"argv": argv, "env": env, "log": log_path}).encode() + b"\n")
        server.stdin.flush()
        deadline = time.monotonic() + timeout
        while not _started:
            if time.monotonic() >= deadline:
                raise RuntimeError(f"the ranks' zygote did not start {argv} in {timeout} s")
            _read(0.05)
        return Rank(_started.pop(0))


# ---------------------------------------------------------------------------------------
# server side (the zygote)

def _become_rank(request: dict) -> None:
    """In the forked child: the state `python argv...` would start with, then run it."""
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(devnull)
    os.close(log)
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    script, *args = request["argv"]
    script = os.path.abspath(script)
    sys.argv = [script, *args]
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    rest = [p for p in sys.path[1:] if p not in extra]
    sys.path[:] = [os.path.dirname(script), *extra, *rest]
    import runpy
    runpy.run_path(script, run_name="__main__")


def serve() -> None:
    import torch  # noqa: F401  the import every rank would repeat

    requests = sys.stdin.buffer
    out = sys.stdout.buffer
    children: set[int] = set()
    pending = b""
    while True:
        ready, _, _ = select.select([requests], [], [], 0.05)
        if ready:
            chunk = os.read(requests.fileno(), 1 << 16)
            if not chunk:
                return
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if not line:
                    continue
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _become_rank(request)
                    sys.exit(0)  # the script ran to its end: leave as `python script` does
                children.add(pid)
                out.write(json.dumps({"started": pid}).encode() + b"\n")
                out.flush()
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                out.write(json.dumps({"pid": pid, "code": os.waitstatus_to_exitcode(status)}).encode()
                          + b"\n")
                out.flush()


if __name__ == "__main__":
    serve()
