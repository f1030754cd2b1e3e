"""One pool per node: PoolLoader(node_pool=True) under torchrun.

The local ranks' node-pool loaders built at the same place in the program meet
(poolloader.main.rendezvous): the first rank to build one there is the *host*; it
starts the node's physical worker processes (poolloader.worker.node: P = node_workers,
default num_workers) and listens; every other local rank that builds one there while
the host's lives connects. A loader no other rank builds there (evaluation on rank 0)
is hosted by its own rank and nobody else: an ordinary loader of P processes, and
dropping it waits for nobody. A rank keeps everything that makes its batches its own
(its sampler, order, pool, ledger, resume state, CUDA registration): only the processes
that run its logical workers are shared. Its iterator sends the host its logical
workers' configs (its pool's locator and its pickled start payload: a few integers
each), the host forwards them to the physical processes, and from then on requests and
replies go through the rank's own rings as with any PoolLoader; a physical process
waits on its doorbell in the node segment (poolloader.shm.node), which every rank rings.

A rank whose loader differs from the host's in dataset, length, collate_fn, batch_size,
drop_last, num_workers or node_workers is not joined: it is warned, with the difference
named, and runs its own workers. The host, once its own loader and iterators are gone,
lets no rank join any more (one that comes then hosts anew) and stops the processes
when the ranks that joined let go (at most LINGER_S later).

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
The host counts every local rank for ALONE_S after it began serving the node, then
itself and the ranks joined now (sharing_ranks, read at every send): a loader nobody
joins takes the node's whole depth, and its pool's capacity allows for it.
Every DataLoader call still draws its index and picks its worker when DataLoader's
does; the requests past the share are held in the iterator and sent, in that order, as
batches are delivered, and at an epoch left early (persistent workers) in waves before
the next one, so every logical worker fetches what its DataLoader worker fetches, in
the same order. The node's memory is then the slots of the batches it makes, not ranks
× num_workers × prefetch_factor. With in_order=False, where DataLoader picks a worker
by the tasks each has out, every request goes at once, as without a node pool.

node_workers="auto" (poolloader.main.autotune): the host's loader chooses the count
before each of its epochs and `resize` replaces the processes, a *generation* at a
time: the new set gets a segment of its own; the old set is told to retire, serves the
iterators still attached to it and exits when they end (the host reaps it). A rank
asks the host for the current generation as its iterator is built (`refresh`), and an
attach that names a replaced one is answered with the current one, placed again. An
iterator keeps the generation it attached to (NodeProcess holds it).
"""
from __future__ import annotations

import itertools
import os
import selectors
import socket
import threading
import time
import weakref

from poolloader.errors import WorkerDied, warn
from poolloader.main import autotune, rendezvous, startup, supervise
from poolloader.shm import fork
from poolloader.shm.node import NodeSegment
from poolloader.worker.node import node_loop
from poolloader.worker.popen import start_without_pipes

NODE_POOL_ENV = "POOLLOADER_NODE_POOL"
# How long a host, once its own loader and iterators are gone, waits for the local ranks
# still connected to let go of the node's processes before it stops them (seconds).
LINGER_S = 10.0
# A host that no other local rank has joined ALONE_S after it began serving (an
# evaluation loader on rank 0) stops counting the ranks that never came in its share
# of the node's requests: ranks reaching the same place seconds apart still meet, so
# until then every local rank counts. POOLLOADER_NODE_ALONE_S overrides it (seconds).
ALONE_S = 5.0
ALONE_ENV = "POOLLOADER_NODE_ALONE_S"
MOVED_TRIES = 5  # attaches that may find the generation replaced before one holds
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


def alone_s() -> float:
    """ALONE_S, or POOLLOADER_NODE_ALONE_S."""
    return rendezvous.env_seconds(ALONE_ENV, ALONE_S)


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


class NodeProcess:
    """A physical process of the node as a rank's iterator sees it (its `_workers`
    entries): alive while its lock and the host's are held (poolloader.shm.node), in the
    segment of its generation (node_workers="auto" replaces the processes between
    epochs; an iterator keeps the ones it attached to)."""

    exitcode = None  # not this process's child: its exit status cannot be read here

    def __init__(self, node, gen, p: int, pid: int):
        self._node = node
        self._gen = gen
        self.p = p
        self.pid = pid

    def is_alive(self) -> bool:
        return self._node.host_alive(self._gen) and self._gen.segment.process_alive(self.p)

    def death(self, worker: int) -> str:
        """The WorkerDied message (supervise.check_alive) once is_alive() is False."""
        node = self._node
        if not node.host_alive(self._gen):
            return (f"PoolLoader(node_pool=True): the node pool's host, local rank "
                    f"{node.host_rank} (pid {node.host_pid}), exited, and the worker "
                    f"processes it hosted (pids "
                    f"{', '.join(map(str, self._gen.pids))}) with it; logical worker {worker} "
                    f"of this rank was waiting on process {self.p} (pid {self.pid}). The other "
                    f"ranks cannot go on loading: see local rank {node.host_rank}'s error.")
        error = self._gen.segment.error(self.p)  # the traceback it failed with, if it did
        return (f"DataLoader worker (pid {self.pid}) exited unexpectedly. PoolLoader worker "
                f"{worker} (pid {self.pid}: node pool process {self.p}, hosted by local rank "
                f"{node.host_rank}, pid {node.host_pid}, for every local rank) "
                + (f"failed:\n{error}" if error else "exited unexpectedly. If it was "
                   "killed for memory (signal 9), lower num_workers or batch_size; run with "
                   "num_workers=0 to see the error in the main process."))


class _Generation:
    """One set of the node's physical processes: its segment (doorbells, locks, error
    records), their pids, and the placement over them. node_workers="auto" replaces the
    set with one of another count between epochs (NodeHost.resize): an iterator keeps
    the generation it attached to until it ends."""

    def __init__(self, node, number: int, segment: NodeSegment, pids: list[int]):
        self.number = number
        self.segment = segment
        self.pids = pids
        self.procs = [NodeProcess(node, self, p, pid) for p, pid in enumerate(pids)]

    def place(self, local_rank: int, worker: int, num_workers: int) -> int:
        """The process hosting local rank `local_rank`'s logical worker `worker`."""
        turned = (worker + local_rank) % num_workers
        return (local_rank * num_workers + turned) % len(self.pids)


class _Node(rendezvous.Users):
    """What host and client share: the current generation of processes, the placement."""

    gen: _Generation
    host_pid: int
    host_rank: int  # the local rank that hosts (the first to build the loader)
    local_rank: int

    def host_alive(self, gen: _Generation | None = None) -> bool:
        raise NotImplementedError

    local_world: int  # the local ranks (join)

    @property
    def pids(self) -> list[int]:
        return self.gen.pids

    def sharing_ranks(self) -> int:
        """The local ranks the node's requests are shared among now (module docstring):
        every local rank, on a rank that joined a host."""
        return self.local_world

    def fewest_sharing_ranks(self) -> int:
        """The fewest sharing_ranks() may become while this loader lives."""
        return self.local_world

    def in_flight(self, num_workers: int, prefetch_factor: int, weight: int = 1,
                  ranks: int | None = None, gen: _Generation | None = None) -> int:
        """The requests this rank keeps in flight (module docstring), making the batches
        of `weight` local ranks (a share_batches leader's followers send none), the
        requests of `gen`'s processes (default: the current generation's) shared among
        `ranks` (default: sharing_ranks() now)."""
        ranks = self.sharing_ranks() if ranks is None else ranks
        share = -(-len((gen or self.gen).pids) * prefetch_factor * weight // ranks)
        return max(1, min(num_workers * prefetch_factor, share))

    def most_in_flight(self, num_workers: int, prefetch_factor: int, weight: int = 1) -> int:
        """The most in_flight() may become while this loader lives (for its pools)."""
        return self.in_flight(num_workers, prefetch_factor, weight, self.fewest_sharing_ranks())

    def processes(self, num_workers: int, gen: _Generation | None = None) -> list[NodeProcess]:
        """One NodeProcess per logical worker (the same object for one process)."""
        gen = gen or self.gen
        return [gen.procs[gen.place(self.local_rank, i, num_workers)] for i in range(num_workers)]

    def bells(self, num_workers: int, gen: _Generation | None = None) -> list:
        gen = gen or self.gen
        return [gen.segment.bells[gen.place(self.local_rank, i, num_workers)]
                for i in range(num_workers)]

    def refresh(self) -> int:
        """The processes the node runs now (a client asks the host: node_workers="auto"
        may have replaced them since its last iterator)."""
        return len(self.pids)

    def attach(self, cfgs) -> _Generation:
        """Hand this rank's logical workers (`cfgs`, in worker order) to the processes of
        the current generation; returns it (its bells and processes are the iterator's).
        A generation replaced meanwhile (the host moved the count) is placed again."""
        key = (os.getpid(), next(_iterators))
        for _ in range(MOVED_TRIES):
            gen = self.gen
            placed: dict[int, list] = {}
            for i, cfg in enumerate(cfgs):
                placed.setdefault(gen.place(self.local_rank, i, len(cfgs)), []).append(cfg)
            if self._forward(key, gen.number, {p: tuple(c) for p, c in placed.items()}):
                return gen
        raise RuntimeError(f"PoolLoader(node_pool=True): the node's processes were replaced "
                           f"{MOVED_TRIES} times while local rank {self.local_rank} attached "
                           "its workers")

    def _forward(self, key, number: int, placed: dict) -> bool:
        """Forward to generation `number`'s processes; False (and self.gen the current
        one) where it is no longer current."""
        raise NotImplementedError


class NodeHost(_Node):
    """The side of the first local rank to build the loader: the physical processes,
    the listener, the forwarding."""

    def __init__(self, ctx, processes: int, mine: dict, listener: socket.socket,
                 timeout: float, local_rank: int, zygote=None):
        """`zygote` (poolloader.worker.zygote; None: none): forks the node's processes."""
        alone = alone_s()  # a bad POOLLOADER_NODE_ALONE_S is refused before any process starts
        self.local_rank = self.host_rank = local_rank
        self.host_pid = os.getpid()
        self._mine = mine
        self._ctx, self._zygote, self._timeout = ctx, zygote, timeout
        # RLock: a collection inside _forward may run the loader's finaliser, so close()
        self._lock = threading.RLock()
        self._closed = False
        self._closing = False  # this rank let go: no rank joins any more
        self._listener: socket.socket | None = listener
        self._clients = 0  # ranks joined (each lets go when its loader is gone)
        self._alone_from = float("inf")  # see sharing_ranks: set once ranks may join
        self._joined: set = set()  # their sockets
        self._thread: threading.Thread | None = None
        self._pipes: list = []
        self._workers: list = []
        # generations replaced by a move (resize), each (gen, pipes, workers): their
        # processes serve the iterators attached to them and exit once those end
        self._retired: list[tuple] = []
        self._resize_lock = threading.Lock()  # one resize at a time (outside self._lock)
        try:
            self.gen, self._pipes, self._workers = self._start(processes, 0)
            self._thread = threading.Thread(target=self._serve, name="poolloader-node-host",
                                            daemon=True)
            self._thread.start()
            self._alone_from = time.monotonic() + alone  # others may join from now
        except BaseException:
            self.close()
            raise

    def _start(self, processes: int, number: int) -> tuple:
        """Generation `number`: a segment and `processes` processes, started. Stopped
        again if one fails to start."""
        segment = NodeSegment.create(processes)
        pipes: list = []
        workers: list = []
        try:
            for p in range(processes):
                with fork.creating():  # a child forked later closes the write end
                    read, write = self._ctx.Pipe(duplex=False)
                    fork.hold(write.fileno())
                pipes.append(write)
                try:
                    workers.append(start_without_pipes(self._ctx, node_loop,
                                                       (p, segment.locator, read), self._zygote))
                finally:
                    read.close()
            gen = _Generation(self, number, segment, [w.pid for w in workers])
            self._wait_started(gen, workers, self._timeout)
        except BaseException:
            self._stop(segment, pipes, workers)
            raise
        return gen, pipes, workers

    def sharing_ranks(self) -> int:
        """Every local rank until ALONE_S after this rank started serving the node (another
        may still be on its way); from then on this rank and those joined now: a loader no
        other rank builds takes the node's whole depth, as a loader of its own would.
        A rank that joins later is counted from then on (the requests this rank sent
        past its new share are delivered, not recalled)."""
        if time.monotonic() < self._alone_from:
            return self.local_world
        return min(self.local_world, 1 + self._clients)

    def fewest_sharing_ranks(self) -> int:
        return 1

    def host_alive(self, gen: _Generation | None = None) -> bool:
        return not self._closed  # this process: its own lock does not show to itself

    @staticmethod
    def _wait_started(gen: _Generation, workers: list, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for p, worker in enumerate(workers):
            while not gen.segment.process_alive(p):
                if not worker.is_alive():
                    raise WorkerDied(f"PoolLoader(node_pool=True): node pool process {p} (pid "
                                     f"{worker.pid}) exited while starting, with "
                                     f"{supervise.describe_exit(worker.exitcode)}")
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"PoolLoader(node_pool=True): node pool process {p} (pid {worker.pid}) "
                        f"did not start within {timeout:.0f} s ({rendezvous.TIMEOUT_ENV} sets "
                        "the limit)")
                time.sleep(0.005)

    def resize(self, processes: int) -> str | None:
        """node_workers="auto" (called as the host's iterator is built): from now on
        `processes` processes host the logical workers that attach. The current ones are
        told to retire: they serve the iterators attached to them (another rank may still
        be in the epoch before) and exit once those end; a rank learns of the new ones
        as it attaches (refresh, or a reply that the generation moved). The new ones
        start outside the lock, so the other ranks' attaches go on meanwhile (to the
        current ones). Returns None, or why the new ones did not start: the current ones
        then go on serving."""
        with self._resize_lock:
            if self._closed or self._closing or processes == len(self.gen.pids):
                return None
            try:
                gen, pipes, workers = self._start(processes, self.gen.number + 1)
            except Exception as e:
                return f"{type(e).__name__}: {e}"
            with self._lock:
                if self._closed:  # closed meanwhile: these never served
                    stopping = True
                else:
                    stopping = False
                    old = (self.gen, self._pipes, self._workers)
                    self.gen, self._pipes, self._workers = gen, pipes, workers
                    for p, pipe in enumerate(old[1]):
                        try:
                            pipe.send(("retire",))
                        except OSError:
                            pass  # it died: the ranks on it say so
                        old[0].segment.bells[p].ring()
                    self._retired.append(old)
            if stopping:
                self._stop(gen.segment, pipes, workers)
        self._reap()
        return None

    def _reap(self) -> None:
        """Close the retired generations whose processes have all exited."""
        with self._lock:
            done = [r for r in self._retired if not any(w.is_alive() for w in r[2])]
            self._retired = [r for r in self._retired if r not in done]
        for gen, pipes, workers in done:
            self._stop(gen.segment, pipes, workers)

    @staticmethod
    def _stop(segment, pipes: list, workers: list) -> None:
        """Tell a generation's processes to stop, close its segment, stop them (the
        ladder, for any that does not exit)."""
        for pipe in pipes:
            try:
                pipe.send(None)
            except OSError:
                pass
            fork.release(pipe.fileno(), lambda _fd, pipe=pipe: pipe.close())
        for bell in segment.bells if segment is not None else ():
            bell.ring()
        if segment is not None:
            segment.close()
        supervise.stop(workers)

    def _forward(self, key, number: int, placed: dict) -> bool:
        with self._lock:
            if self._closed:
                raise RuntimeError("PoolLoader(node_pool=True): this node pool was closed")
            if number != self.gen.number:
                return False
            for p, cfgs in placed.items():
                self._pipes[p].send(("attach", key, cfgs))
                self.gen.segment.bells[p].ring()
            return True

    def _serve(self) -> None:
        """The listener thread: accept ranks, check them, forward their attachments."""
        selector = selectors.PollSelector()  # no select(): descriptors above 1024
        listener = self._listener
        assert listener is not None
        selector.register(listener, selectors.EVENT_READ)
        try:
            while not self._closed:
                if self._retired:
                    self._reap()
                for key, _ in selector.select(timeout=0.25):
                    sock = key.fileobj
                    if sock is listener:
                        try:
                            conn = rendezvous.accept(listener)
                        except OSError:
                            continue
                        if conn is not None:
                            conn.settimeout(30.0)
                            selector.register(conn, selectors.EVENT_READ)
                        continue
                    try:
                        self._answer(sock, rendezvous.recv(sock))  # type: ignore[arg-type]
                    except Exception:  # that rank let go, died, or sent what cannot be read
                        selector.unregister(sock)
                        if sock in self._joined:
                            self._joined.discard(sock)
                            self._clients -= 1
                        rendezvous.close_socket(sock)  # type: ignore[arg-type]
        except (OSError, ValueError):
            pass  # closed under the selector
        finally:
            for key in list(selector.get_map().values()):
                if key.fileobj is not listener:
                    rendezvous.close_socket(key.fileobj)  # type: ignore[arg-type]
            selector.close()

    def _answer(self, sock, message) -> None:
        if message[0] == "hello":
            difference = rendezvous.first_difference(message[1], self._mine,
                                                     f"local rank {self.host_rank}")
            with self._lock:
                closing = self._closing or self._closed
                if not closing and difference is None:
                    self._clients += 1
                    self._joined.add(sock)
            if closing:  # this rank let go: the other builds its own
                rendezvous.send(sock, ("closing",))
            elif difference is not None:
                rendezvous.send(sock, ("refused", difference))
            else:
                rendezvous.send(sock, ("welcome", self.host_rank) + self._current())
        elif message[0] == "current":
            rendezvous.send(sock, ("generation",) + self._current())
        elif message[0] == "attach":
            try:
                attached = self._forward(message[2], message[1], message[3])
            except Exception as e:
                rendezvous.send(sock, ("failed", f"{type(e).__name__}: {e}"))
            else:
                rendezvous.send(sock, ("attached",) if attached
                                else ("moved",) + self._current())

    def _current(self) -> tuple:
        """What a client needs to attach to the current generation."""
        gen = self.gen
        return gen.number, gen.segment.locator, gen.pids

    def close(self) -> None:
        """Stop everything, once the ranks connected let go (bounded by LINGER_S; a rank
        that never came is not waited for): the listener, the physical processes (told,
        then the ladder), the node segment (the host's lock goes: a rank still loading
        sees it within a tick)."""
        with self._lock:
            self._closing = True  # a rank that comes now builds its own
        deadline = time.monotonic() + LINGER_S
        listening = self._thread is not None and self._thread is not threading.current_thread()
        while self._clients > 0 and listening \
                and self._thread.is_alive() and time.monotonic() < deadline:  # type: ignore[union-attr]
            time.sleep(0.01)
        with self._lock:
            if self._closed:
                return
            self._closed = True
            gen = getattr(self, "gen", None)
            stopping = [(gen.segment if gen is not None else None, self._pipes, self._workers)]
            stopping += [(g.segment, pipes, workers) for g, pipes, workers in self._retired]
            self._retired = []
        if listening:
            self._thread.join(2.0)  # type: ignore[union-attr]
        rendezvous.close_socket(self._listener)
        # each segment closes (the host's lock goes) before its processes are stopped: a
        # rank that then finds a process gone says the host left
        for segment, pipes, workers in stopping:
            self._stop(segment, pipes, workers)


class NodeClient(_Node):
    """The side of a local rank that came after the host: connected to it, the node
    segment attached."""

    def __init__(self, local_rank: int, sock: socket.socket, answer):
        self.local_rank = local_rank
        self._sock: socket.socket | None = sock
        self._old: list[_Generation] = []  # replaced generations an iterator may still use
        try:
            self.host_rank = answer[1]
            sock.settimeout(30.0)
            self.host_pid = answer[3][0]
            self._adopt(answer[2:])
        except BaseException:
            self.close()
            raise

    def _adopt(self, current) -> None:
        """Attach generation `current` ((number, locator, pids) from the host) as the
        current one; close the replaced ones whose processes have all exited."""
        number, locator, pids = current
        old = getattr(self, "gen", None)
        if old is not None and old.number == number:
            return
        self.gen = _Generation(self, number, NodeSegment.attach(locator), pids)
        if old is not None:
            self._old.append(old)
        for gen in [g for g in self._old if not any(
                g.segment.process_alive(p) for p in range(len(g.pids)))]:
            self._old.remove(gen)
            gen.segment.close()

    def host_alive(self, gen: _Generation | None = None) -> bool:
        return (gen or self.gen).segment.host_alive()

    def _ask(self, message):
        if self._sock is None:
            raise RuntimeError("PoolLoader(node_pool=True): this node pool was closed")
        try:  # bounded by the socket's timeout
            rendezvous.send(self._sock, message)
            return rendezvous.recv(self._sock)
        except (OSError, ConnectionError) as e:
            # an answer may still come: nothing may read it as the next one's
            sock, self._sock = self._sock, None
            rendezvous.close_socket(sock)
            raise WorkerDied(f"PoolLoader(node_pool=True): the node pool's host, local rank "
                             f"{self.host_rank} (pid {self.host_pid}), cannot be reached: "
                             f"{e}") from None

    def _follow(self, current) -> None:
        """_adopt the generation the host named; if it is gone before this rank could
        open it (the host moved again and reaped it), ask for the current one again."""
        for tries in range(MOVED_TRIES):
            try:
                self._adopt(current)
                return
            except RuntimeError:
                if tries == MOVED_TRIES - 1:
                    raise
            current = self._ask(("current",))[1:]

    def refresh(self) -> int:
        self._follow(self._ask(("current",))[1:])
        return len(self.pids)

    def _forward(self, key, number: int, placed: dict) -> bool:
        answer = self._ask(("attach", number, key, placed))
        if answer[0] == "moved":
            self._follow(answer[1:])
            return False
        if answer[0] != "attached":
            raise RuntimeError(f"PoolLoader(node_pool=True): local rank {self.host_rank} could "
                               f"not hand this rank's workers to the node's processes: "
                               f"{answer[1]}")
        return True

    def close(self) -> None:
        sock, self._sock = self._sock, None
        rendezvous.close_socket(sock)
        gen = getattr(self, "gen", None)
        for g in self._old + ([gen] if gen is not None else []):
            g.segment.close()
        self._old = []


def join(loader, ctx, processes, group: rendezvous.LocalGroup) -> _Node | None:
    """The node pool of `loader`: the first local rank to build a loader at this place
    in the program (rendezvous.build_site) hosts it, the others that build one there
    join it; closed when the loader is collected, or at exit. None where the loader
    the host built there differs (a warning says how): then this one is ordinary.
    `processes`: a count, or "auto" (poolloader.main.autotune: the host starts
    min(num_workers × local ranks, CPUs) and moves the count between its epochs)."""
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
    os.environ[rendezvous.RANK_PID_ENV] = str(os.getpid())
    name = rendezvous.address(run_key, rendezvous.place("node", rendezvous.build_site()))
    mine = fingerprint(loader, processes)
    timeout = rendezvous.rendezvous_timeout()
    deadline = time.monotonic() + timeout
    what = f"PoolLoader(node_pool=True) on local rank {rank}"
    node: _Node
    while True:
        hosting, sock = rendezvous.meet(name, deadline, what)
        if hosting:
            if processes == autotune.AUTO:  # AutoWorkers(num_workers, size) starts there
                processes = min(loader.num_workers * size, autotune.cpu_budget())
            node = NodeHost(ctx, processes, mine, sock, timeout, rank, startup.zygote_for(
                ctx, getattr(loader, "zygote", None), loader.dataset, loader.collate_fn,
                loader.worker_init_fn))
            break
        try:
            sock.settimeout(max(1.0, deadline - time.monotonic()))
            rendezvous.send(sock, ("hello", mine))
            answer = rendezvous.recv(sock)
        except (OSError, ConnectionError) as e:
            rendezvous.close_socket(sock)
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: the local rank hosting the loader built at the "
                                   f"same place did not answer: {e}") from None
            continue  # it let go meanwhile: meet again
        if answer[0] == "welcome":
            node = NodeClient(rank, sock, answer)
            break
        rendezvous.close_socket(sock)
        if answer[0] == "refused":
            warn(f"PoolLoader(node_pool=True): local rank {rank}'s loader differs from the one "
                 f"built at the same place in the program on another local rank, in "
                 f"{answer[1]}; this rank runs its own workers for it (pass node_pool=False "
                 "to say so, or build the same loader there on every local rank to share the "
                 "node's processes)")
            return None
        time.sleep(rendezvous.CONNECT_RETRY_S)  # "closing": it lets go now; meet again
    node.local_world = size
    node.acquire()
    weakref.finalize(loader, node.release)
    return node
