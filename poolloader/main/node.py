"""One pool per node: PoolLoader(node_pool=True) under torchrun.

The local ranks' node-pool loaders, built in the same order on every rank, meet: the
k-th one of local rank 0 is the *host*; it starts the node's physical worker
processes (poolloader.worker.node: P = node_workers, default num_workers) and
listens; the k-th one of every other local rank connects. A rank keeps everything
that makes its batches its own (its sampler, order, pool, ledger, resume state,
CUDA registration): only the processes that run its logical workers are shared. Its
iterator sends the host its logical workers' configs (its pool's locator and its
pickled start payload: a few integers each), the host forwards them to the physical
processes, and from then on requests and replies go through the rank's own rings as
with any PoolLoader; a physical process waits on its doorbell in the node segment
(poolloader.shm.node), which every rank rings.

Rendezvous: an abstract Unix socket (nothing in /dev/shm or on disk; it goes with the
host) named from the user id, the PID namespace, torchrun's run id and node rank, and
k. Another job, another user or another PID namespace never meets it, and both ends
check the other's uid (SO_PEERCRED) before anything is unpickled. A rank whose loader
differs from the host's in dataset, length, collate_fn, batch_size, drop_last,
num_workers or node_workers is refused, with the difference named, while its loader
is built.

Placement: logical worker i of local rank r runs in process
(r × num_workers + (i + r) % num_workers) % P; a process serves its logical workers
round robin, one request each (no rank starves). The turn by r spreads ranks that ask
for the same batch number at once (a DDP step) over the processes when P < num_workers
× ranks.

In flight (in_order=True): the node's P processes make P × prefetch_factor batches
ahead for all its ranks together, as a DataLoader of P workers would; each rank keeps
its share of requests sent and not yet delivered, ceil(P × prefetch_factor / local
ranks), at least 1, at most its own num_workers × prefetch_factor, and a pool that many
slots (+ 2) large; a share_batches leader counts its followers here, which send none.
Every DataLoader call still draws its index and picks its worker when DataLoader's
does; the requests past the share are held in the iterator and sent, in that order, as
batches are delivered, and at an epoch left early (persistent workers) in waves before
the next one, so every logical worker fetches what its DataLoader worker fetches, in
the same order. The node's memory is then the slots of the batches it makes, not ranks
× num_workers × prefetch_factor. With in_order=False, where DataLoader picks a worker
by the tasks each has out, every request goes at once, as without a node pool.
"""
from __future__ import annotations

import datetime
import hashlib
import itertools
import os
import pickle
import selectors
import socket
import struct
import threading
import time
import weakref
from typing import NamedTuple

from poolloader.errors import WorkerDied
from poolloader.main import supervise
from poolloader.shm import fork
from poolloader.shm.node import NodeSegment
from poolloader.worker.node import node_loop
from poolloader.worker.popen import start_without_pipes

NODE_POOL_ENV = "POOLLOADER_NODE_POOL"
# Set by a rank when it joins its first node pool, to its pid: a process that inherits
# torchrun's variables from a rank (a worker, a subprocess) is not that rank, and its
# loaders are ordinary ones (local_group).
RANK_PID_ENV = "POOLLOADER_NODE_RANK_PID"
TIMEOUT_ENV = "POOLLOADER_NODE_TIMEOUT"
# How long a rank waits for local rank 0's loader to listen, and the host for its
# physical processes to start (seconds; TIMEOUT_ENV overrides).
RENDEZVOUS_TIMEOUT = 120.0
# How long the host, once its own loader and iterators are gone, waits for every other
# local rank to have come and let go of its loader before it stops the node's
# processes (seconds).
LINGER_S = 10.0
_ordinal = itertools.count()  # node-pool loaders built in this process
_iterators = itertools.count()  # iterators attached from this process (group keys)


def wanted(node_pool) -> bool:
    """PoolLoader(node_pool=): True/False, or None: the POOLLOADER_NODE_POOL variable."""
    if node_pool is None:
        value = os.environ.get(NODE_POOL_ENV, "").strip().lower()
        if value in ("", "0", "false", "no", "off"):
            return False
        if value in ("1", "true", "yes", "on"):
            return True
        raise ValueError(f"{NODE_POOL_ENV}={value!r}: use 1 or 0")
    if not isinstance(node_pool, bool):
        raise ValueError(f"node_pool must be True, False or None, got {node_pool!r}")
    return node_pool


class LocalGroup(NamedTuple):
    """This process's place among the job's ranks on this node."""

    rank: int  # local rank
    size: int  # local world size
    run_key: str  # the same on every local rank of this job, and only there
    ranks: tuple[int, ...] | None  # the node's global ranks by local rank (None: unknown)


def local_group() -> LocalGroup | None:
    """This rank's LocalGroup where 2 or more ranks of the job share this node; None
    otherwise, where node_pool=True is an ordinary PoolLoader. Under torchrun from its
    variables (LOCAL_RANK, LOCAL_WORLD_SIZE, TORCHELASTIC_RUN_ID, GROUP_RANK, RANK);
    else from an initialised torch.distributed (mp.spawn, a launcher of one's own):
    see _dist_group."""
    env = os.environ
    if env.get(RANK_PID_ENV, str(os.getpid())) != str(os.getpid()):
        return None  # a child of the rank (module docstring of RANK_PID_ENV)
    run_id = env.get("TORCHELASTIC_RUN_ID")
    try:
        rank, size = int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        run_id = None
    if not run_id:  # not torchrun (a launcher may set LOCAL_RANK of its own)
        return _dist_group()
    if size < 2 or not 0 <= rank < size:
        return None
    try:
        first = int(env["RANK"]) - rank  # torchrun gives a node consecutive global ranks
        ranks: tuple[int, ...] | None = tuple(range(first, first + size))
    except (KeyError, ValueError):
        ranks = None
    # the agent's pid: torchrun's default run id, "none", is shared by every job
    key = f"torchrun/{os.getppid()}/{run_id}/{env.get('GROUP_RANK', '0')}/" \
          f"{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return LocalGroup(rank, size, key, ranks)


# The local ranks' pids where the group came from torch.distributed: then a peer must be
# one of them (peer_is_a_local_rank); and the group found for the current default
# process group (_dist_group), kept for that group only.
_dist_peers: set[int] = set()
_dist_found: list = []  # [(the default process group, LocalGroup or None)]: one at most


def _node_identity() -> str:
    """What two processes that can share memfd segments and abstract sockets share: the
    machine's boot, the user, the PID and network namespaces."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    return (f"{boot}/{os.getuid()}/{os.stat('/proc/self/ns/pid').st_ino}/"
            f"{os.stat('/proc/self/ns/net').st_ino}")


def _dist_group() -> LocalGroup | None:
    """The LocalGroup from an initialised torch.distributed default process group.

    Once per process group, every rank of the world writes its node's identity and its
    pid to the group's store (keys poolloader/node/<rank>) and reads every rank's,
    bounded by rendezvous_timeout(): the ranks of this node by global rank are its
    local ranks. It needs every rank of the world to build a node-pool or
    share_batches loader (as every local rank must, under torchrun); the store is read
    once, not per loader. The run key is those ranks' pids: the same on each of them,
    and on no other job's."""
    try:
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            return None
        default = dist.group.WORLD
    except (ImportError, RuntimeError, AttributeError):
        return None
    if _dist_found and _dist_found[0][0] is default:
        return _dist_found[0][1]
    _dist_found.clear()  # an earlier, destroyed group's: not kept alive
    _dist_peers.clear()
    world, me = dist.get_world_size(), dist.get_rank()
    found = None
    if world >= 2:
        store = dist.distributed_c10d._get_default_store()
        keys = [f"poolloader/node/{r}" for r in range(world)]
        store.set(keys[me], f"{_node_identity()} {os.getpid()}")
        timeout = rendezvous_timeout()
        try:
            store.wait(keys, datetime.timedelta(seconds=timeout))
        except RuntimeError:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            raise RuntimeError(
                f"PoolLoader(node_pool/share_batches): rank {me} waited {timeout:.0f} s for "
                f"every rank of the torch.distributed world ({world}) to build its loader; "
                f"ranks {missing} did not (each rank must build the same node-pool and "
                f"share_batches loaders). {TIMEOUT_ENV} sets the wait; node_pool=False and "
                "share_batches=None give this rank an ordinary loader.") from None
        entries = [store.get(k).decode().rsplit(" ", 1) for k in keys]
        here = [r for r, (identity, _pid) in enumerate(entries) if identity == entries[me][0]]
        if len(here) >= 2:
            pids = [int(entries[r][1]) for r in here]
            _dist_peers.update(p for p in pids if p != os.getpid())
            found = LocalGroup(here.index(me), len(here),
                               "dist/" + "/".join(map(str, pids)), tuple(here))
    _dist_found.append((default, found))
    return found


def rendezvous_timeout() -> float:
    value = os.environ.get(TIMEOUT_ENV)
    if value is None:
        return RENDEZVOUS_TIMEOUT
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={value!r}: a number of seconds") from None


def rendezvous_address(run_key: str, k: int) -> bytes:
    """The rendezvous name: the uid, the PID namespace, the run (LocalGroup.run_key:
    torchrun's agent, run id, node rank and restart, or the local ranks' pids), and the
    loader's ordinal."""
    namespace = os.stat("/proc/self/ns/pid").st_ino
    run = hashlib.blake2b(run_key.encode(), digest_size=8).hexdigest()
    return f"\0poolloader-{os.getuid()}-{namespace}-{run}-{k}".encode()


def qualified_name(obj) -> str:
    """module.qualname of a function, or of the class of anything else."""
    if isinstance(obj, type) or not hasattr(obj, "__qualname__"):
        kind = obj if isinstance(obj, type) else type(obj)
        return f"{kind.__module__}.{kind.__qualname__}"
    return f"{getattr(obj, '__module__', None)}.{obj.__qualname__}"


def fingerprint(loader, processes: int) -> dict:
    """What the local ranks' loaders must agree on to share processes."""
    try:
        length = len(loader.dataset)
    except Exception:
        length = None
    return {"dataset": qualified_name(type(loader.dataset)), "len(dataset)": length,
            "collate_fn": qualified_name(loader.collate_fn), "batch_size": loader.batch_size,
            "drop_last": loader.drop_last, "num_workers": loader.num_workers,
            "node_workers": processes}


def first_difference(mine: dict, theirs: dict) -> str | None:
    for key in mine:
        if mine[key] != theirs.get(key):
            return f"{key}: {mine[key]!r} here, {theirs.get(key)!r} on local rank 0"
    return None


# -- messages: a 4-byte length, then a pickle; only between processes of one uid ------

def _send(sock: socket.socket, message) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(struct.pack("!I", len(data)) + data)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        part = sock.recv(n - got)
        if not part:
            raise ConnectionError("the other end closed the connection")
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def _recv(sock: socket.socket):
    (n,) = struct.unpack("!I", _recv_exactly(sock, 4))
    return pickle.loads(_recv_exactly(sock, n))


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rfind(b")") + 2:].split()[1])


def peer_is_a_local_rank(sock: socket.socket) -> bool:
    """Whether the other end is a process of this user, in this PID namespace, that is
    another local rank of this job: through torch.distributed, one whose pid the job's
    store gave (_dist_group); under torchrun, one whose parent is ours (the agent).
    Checked before anything it sends is unpickled."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    if uid != os.getuid() or pid <= 0:
        return False
    if _dist_peers:
        return pid in _dist_peers
    return _parent_of(pid) == os.getppid()


def held_socket(kind: int = socket.SOCK_STREAM) -> socket.socket:
    """A Unix socket a forked child closes at once (poolloader.shm.fork)."""
    with fork.creating():
        sock = socket.socket(socket.AF_UNIX, kind)
        fork.hold(sock.fileno())
    return sock


def close_socket(sock: socket.socket | None) -> None:
    if sock is not None and sock.fileno() >= 0:
        fork.release(sock.detach())


class NodeProcess:
    """A physical process of the node as a rank's iterator sees it (its `_workers`
    entries): alive while its lock and the host's are held (poolloader.shm.node)."""

    exitcode = None  # not this process's child: its exit status cannot be read here

    def __init__(self, node, p: int, pid: int):
        self._node = node
        self.p = p
        self.pid = pid

    def is_alive(self) -> bool:
        return self._node.host_alive() and self._node.segment.process_alive(self.p)

    def death(self, worker: int) -> str:
        """The WorkerDied message (supervise.check_alive) once is_alive() is False."""
        node = self._node
        if not node.host_alive():
            return (f"PoolLoader(node_pool=True): the node pool's host, local rank 0 (pid "
                    f"{node.host_pid}), exited, and the worker processes it hosted (pids "
                    f"{', '.join(map(str, node.pids))}) with it; logical worker {worker} of "
                    f"this rank was waiting on process {self.p} (pid {self.pid}). The other "
                    "ranks cannot go on loading: see local rank 0's error.")
        error = node.segment.error(self.p)  # the traceback it failed with, if it did
        return (f"DataLoader worker (pid {self.pid}) exited unexpectedly. PoolLoader worker "
                f"{worker} (pid {self.pid}: node pool process {self.p}, hosted by local rank 0, "
                f"pid {node.host_pid}, for every local rank) "
                + (f"failed:\n{error}" if error else "exited unexpectedly. If it was "
                   "killed for memory (signal 9), lower num_workers or batch_size; run with "
                   "num_workers=0 to see the error in the main process."))


class Users:
    """Closed with its last user: this rank's loader and its live iterators (an
    iterator can outlive its loader), each counted by `acquire` and `release`."""

    _users = 0
    _users_lock = threading.Lock()

    def close(self) -> None:
        raise NotImplementedError

    def acquire(self) -> None:
        """One more user here (the loader, an iterator); `release` when it is gone."""
        with self._users_lock:
            self._users += 1

    def release(self) -> None:
        with self._users_lock:
            self._users -= 1
            last = self._users == 0
        if last:
            self.close()


class _Node(Users):
    """What host and client share: the segment, the processes, the placement."""

    segment: NodeSegment
    host_pid: int
    pids: list[int]
    local_rank: int

    def host_alive(self) -> bool:
        raise NotImplementedError

    local_world: int  # the local ranks (join)

    def place(self, worker: int, num_workers: int) -> int:
        """The process hosting this rank's logical worker `worker` (module docstring)."""
        turned = (worker + self.local_rank) % num_workers
        return (self.local_rank * num_workers + turned) % len(self.pids)

    def in_flight(self, num_workers: int, prefetch_factor: int, weight: int = 1) -> int:
        """The requests this rank keeps in flight (module docstring), making the batches
        of `weight` local ranks (a share_batches leader's followers send none)."""
        share = -(-len(self.pids) * prefetch_factor * weight // self.local_world)
        return max(1, min(num_workers * prefetch_factor, share))

    def processes(self, num_workers: int) -> list[NodeProcess]:
        """One NodeProcess per logical worker (the same object for one process)."""
        procs = self._procs
        return [procs[self.place(i, num_workers)] for i in range(num_workers)]

    def bells(self, num_workers: int) -> list:
        return [self.segment.bells[self.place(i, num_workers)] for i in range(num_workers)]

    def _made(self) -> None:
        self._procs = [NodeProcess(self, p, pid) for p, pid in enumerate(self.pids)]

    def attach(self, cfgs) -> None:
        """Hand this rank's logical workers (`cfgs`, in worker order) to their processes."""
        placed: dict[int, list] = {}
        for i, cfg in enumerate(cfgs):
            placed.setdefault(self.place(i, len(cfgs)), []).append(cfg)
        key = (os.getpid(), next(_iterators))
        self._forward(key, {p: tuple(c) for p, c in placed.items()})

    def _forward(self, key, placed: dict) -> None:
        raise NotImplementedError


class NodeHost(_Node):
    """Local rank 0's side: the physical processes, the listener, the forwarding."""

    def __init__(self, ctx, processes: int, mine: dict, address: bytes, timeout: float,
                 expected: int):
        self.local_rank = 0
        self.host_pid = os.getpid()
        self._mine = mine
        # RLock: a collection inside _forward may run the loader's finaliser, so close()
        self._lock = threading.RLock()
        self._closed = False
        self._listener: socket.socket | None = None
        self._clients = 0  # ranks connected (each lets go when its loader is gone)
        self._came = 0  # ranks that connected at all
        self._expected = expected  # the other local ranks
        self._thread: threading.Thread | None = None
        self._pipes: list = []
        self._workers: list = []
        self.segment = NodeSegment.create(processes)
        try:
            for p in range(processes):
                with fork.creating():  # a child forked later closes the write end
                    read, write = ctx.Pipe(duplex=False)
                    fork.hold(write.fileno())
                self._workers.append(start_without_pipes(ctx, node_loop,
                                                         (p, self.segment.locator, read)))
                read.close()
                self._pipes.append(write)
            self.pids = [w.pid for w in self._workers]
            self._made()
            self._wait_started(timeout)
            self._listener = held_socket()
            try:
                self._listener.bind(address)
            except OSError as e:
                raise RuntimeError(
                    f"PoolLoader(node_pool=True): local rank 0 cannot listen for the other "
                    f"ranks ({e}): another process of this job and node already hosts a "
                    "node pool loader under that name (a loader built twice in the same "
                    "order?)") from None
            self._listener.listen(64)
            self._thread = threading.Thread(target=self._serve, name="poolloader-node-host",
                                            daemon=True)
            self._thread.start()
        except BaseException:
            self.close()
            raise

    def host_alive(self) -> bool:
        return not self._closed  # this process: its own lock does not show to itself

    def _wait_started(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for p, worker in enumerate(self._workers):
            while not self.segment.process_alive(p):
                if not worker.is_alive():
                    raise WorkerDied(f"PoolLoader(node_pool=True): node pool process {p} (pid "
                                     f"{worker.pid}) exited while starting, with "
                                     f"{supervise.describe_exit(worker.exitcode)}")
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"PoolLoader(node_pool=True): node pool process {p} (pid {worker.pid}) "
                        f"did not start within {timeout:.0f} s ({TIMEOUT_ENV} sets the limit)")
                time.sleep(0.005)

    def _forward(self, key, placed: dict) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("PoolLoader(node_pool=True): this node pool was closed")
            for p, cfgs in placed.items():
                self._pipes[p].send(("attach", key, cfgs))
                self.segment.bells[p].ring()

    def _serve(self) -> None:
        """The listener thread: accept ranks, check them, forward their attachments."""
        selector = selectors.DefaultSelector()
        listener = self._listener
        assert listener is not None
        selector.register(listener, selectors.EVENT_READ)
        try:
            while not self._closed:
                for key, _ in selector.select(timeout=0.25):
                    sock = key.fileobj
                    if sock is listener:
                        try:
                            with fork.creating():  # no fork between the accept and the hold
                                conn, _ = listener.accept()
                                fork.hold(conn.fileno())
                        except OSError:
                            continue
                        if not peer_is_a_local_rank(conn):
                            close_socket(conn)
                            continue
                        conn.settimeout(30.0)
                        selector.register(conn, selectors.EVENT_READ)
                        self._clients += 1
                        self._came += 1
                        continue
                    try:
                        self._answer(sock, _recv(sock))  # type: ignore[arg-type]
                    except Exception:  # that rank let go, died, or sent what cannot be read
                        selector.unregister(sock)
                        close_socket(sock)  # type: ignore[arg-type]
                        self._clients -= 1  # that rank let go (or died)
        except (OSError, ValueError):
            pass  # closed under the selector
        finally:
            for key in list(selector.get_map().values()):
                if key.fileobj is not listener:
                    close_socket(key.fileobj)  # type: ignore[arg-type]
            selector.close()

    def _answer(self, sock: socket.socket, message) -> None:
        if message[0] == "hello":
            difference = first_difference(message[1], self._mine)
            if difference is not None:
                _send(sock, ("refused", difference))
            else:
                _send(sock, ("welcome", self.segment.locator, self.pids))
        elif message[0] == "attach":
            try:
                self._forward(message[1], message[2])
            except Exception as e:
                _send(sock, ("failed", f"{type(e).__name__}: {e}"))
            else:
                _send(sock, ("attached",))

    def close(self) -> None:
        """Stop everything, once the other ranks let go (bounded by LINGER_S): the
        listener, the physical processes (told, then the ladder), the node segment (the
        host's lock goes: a rank still loading sees it within a tick)."""
        deadline = time.monotonic() + LINGER_S
        listening = self._thread is not None and self._thread is not threading.current_thread()
        while (self._clients > 0 or self._came < self._expected) and listening \
                and self._thread.is_alive() and time.monotonic() < deadline:  # type: ignore[union-attr]
            time.sleep(0.01)
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for pipe in self._pipes:
                try:
                    pipe.send(None)
                except OSError:
                    pass
                fork.release(pipe.fileno(), lambda _fd, pipe=pipe: pipe.close())
            for bell in self.segment.bells:
                bell.ring()
        # the host's lock first: a rank that then finds a process gone says the host left
        self.segment.close()
        if listening:
            self._thread.join(2.0)  # type: ignore[union-attr]
        close_socket(self._listener)
        supervise.stop(self._workers)


class NodeClient(_Node):
    """Another local rank's side: connected to the host, the node segment attached."""

    def __init__(self, local_rank: int, mine: dict, address: bytes, timeout: float):
        self.local_rank = local_rank
        self._sock: socket.socket | None = None
        deadline = time.monotonic() + timeout
        while True:
            sock = held_socket()
            try:
                sock.connect(address)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                close_socket(sock)
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"PoolLoader(node_pool=True): local rank {local_rank} found no node "
                        f"pool to join within {timeout:.0f} s: local rank 0 did not build its "
                        "loader (the same node-pool loaders must be built in the same order on "
                        f"every local rank). {TIMEOUT_ENV} sets the wait; node_pool=False "
                        "gives this rank its own workers.") from None
                time.sleep(0.05)
        self._sock = sock
        try:
            if not peer_is_a_local_rank(sock):
                raise RuntimeError("PoolLoader(node_pool=True): the node pool's socket is held "
                                   "by a process that is not a local rank of this job")
            sock.settimeout(max(1.0, deadline - time.monotonic()))
            _send(sock, ("hello", mine))
            answer = _recv(sock)
            if answer[0] == "refused":
                raise ValueError(
                    f"PoolLoader(node_pool=True): local rank {local_rank}'s loader differs from "
                    f"local rank 0's, built in the same order, in {answer[1]}. The local ranks' "
                    "node-pool loaders must be built in the same order, each with the same "
                    "dataset (class and length), collate_fn, batch_size, drop_last, num_workers "
                    "and node_workers; or pass node_pool=False to this one.")
            _, locator, self.pids = answer
            sock.settimeout(30.0)
            self.segment = NodeSegment.attach(locator)
            self.host_pid = locator[0]
            self._made()
        except BaseException:
            self.close()
            raise

    def host_alive(self) -> bool:
        return self.segment.host_alive()

    def _forward(self, key, placed: dict) -> None:
        if self._sock is None:
            raise RuntimeError("PoolLoader(node_pool=True): this node pool was closed")
        try:  # bounded by the socket's timeout
            _send(self._sock, ("attach", key, placed))
            answer = _recv(self._sock)
        except (OSError, ConnectionError) as e:
            raise WorkerDied(f"PoolLoader(node_pool=True): the node pool's host, local rank 0 "
                             f"(pid {self.host_pid}), cannot be reached: {e}") from None
        if answer[0] != "attached":
            raise RuntimeError(f"PoolLoader(node_pool=True): local rank 0 could not hand this "
                               f"rank's workers to the node's processes: {answer[1]}")

    def close(self) -> None:
        sock, self._sock = self._sock, None
        close_socket(sock)
        segment = getattr(self, "segment", None)
        if segment is not None:
            segment.close()


def join(loader, ctx, processes: int, group: LocalGroup) -> _Node:
    """The node pool of `loader` (built on every local rank in the same order): host it
    (local rank 0) or join it; closed when the loader is collected, or at exit."""
    from poolloader.shm.backends import memfd

    backend = loader.shm_backend or os.environ.get("POOLLOADER_SHM_BACKEND")
    if backend not in (None, "", "memfd"):
        raise ValueError(f"PoolLoader(node_pool=True) needs shm_backend='memfd' (the node's "
                         f"processes open each rank's pool through /proc), got {backend!r}; "
                         "pass node_pool=False to use it")
    why_not = memfd.supported()
    if why_not is not None:
        raise OSError(f"PoolLoader(node_pool=True) needs anonymous shared memory that other "
                      f"processes can open: {why_not}; pass node_pool=False")
    rank, size, run_key, _ranks = group
    os.environ[RANK_PID_ENV] = str(os.getpid())
    address = rendezvous_address(run_key, next(_ordinal))
    mine = fingerprint(loader, processes)
    timeout = rendezvous_timeout()
    node: _Node
    if rank == 0:
        node = NodeHost(ctx, processes, mine, address, timeout, expected=size - 1)
    else:
        node = NodeClient(rank, mine, address, timeout)
    node.local_world = size
    node.acquire()
    weakref.finalize(loader, node.release)
    return node
