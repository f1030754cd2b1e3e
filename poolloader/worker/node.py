"""A physical process of a node pool (PoolLoader(node_pool=True)).

The host (local rank 0) starts P of them once per node-pool loader; they serve the
logical workers of every rank's iterators: logical worker i of local rank r is hosted
by process (r × num_workers + (i + r) % num_workers) % P (poolloader.main.node). A
rank's iterator attaches a *group* (its pool and its logical workers' configs, which
the host forwards through this process's command pipe) and detaches it by closing its
request rings, or by dying (its pool's owner lock goes). A process the host retired
(node_workers="auto" moved the count) exits once its last group is gone. Each logical worker is the
LogicalWorker of poolloader.worker.loop, built here from the rank's own pickled start
payload (startup.load: its own copy of the rank's dataset, worker_init_fn and
collate_fn), so its batches are its rank's DataLoader worker's.

Serving: one request at a time, round robin over every hosted logical worker of
every group (a rank with more requests pending gets no more turns than its logical
workers have), waiting on this process's doorbell in the node segment. Every
WORKER_TICK (busy or idle) it checks the host's lock (gone: exit) and each group's
owner (gone: drop the group and its mappings).
"""
from __future__ import annotations

import time
import traceback

from poolloader.errors import PoolGone, RingClosed
from poolloader.shm.node import NodeSegment
from poolloader.shm.pool import WorkerSlots, attach
from poolloader.wire import codec
from poolloader.worker import stall, startup
from poolloader.worker.loop import (
    WORKER_TICK,
    LogicalWorker,
    WorkerConfig,
    claimed,
    first_request,
    forget_worker_info,
    freeze_inherited,
    prepare_process,
    serve_request,
    sync_mappings,
)
from poolloader.worker.popen import parent_process_through


class _Group:
    """One rank iterator's logical workers in this process, and its pool."""

    def __init__(self, key, cfgs: tuple[WorkerConfig, ...], current: LogicalWorker | None):
        self.key = key
        self.slots = WorkerSlots(cfgs[0].pool, cfgs[0].worker_id, tuple(c.worker_id for c in cfgs))
        self.writer = codec.SlotWriter()
        self.doorbell = self.slots.control.doorbell
        self.workers: list[LogicalWorker] = []
        try:
            self._build(cfgs, current)
        except BaseException:
            self.close()  # a process that goes on must not keep the pool's descriptor
            raise

    def _build(self, cfgs: tuple[WorkerConfig, ...], current: LogicalWorker | None) -> None:
        if current is not None:
            current.leave()  # unpickling and building a logical worker may draw and seed
        errors: list[BaseException | None] = []
        found: dict = {}  # where the payload's arrays were found: compared once
        for cfg in cfgs:  # each its own copy, as each DataLoader worker has
            try:
                cfg.dataset, cfg.init_fn, cfg.collate_fn = startup.load(
                    cfg.shared, across_ranks=found)  # type: ignore[arg-type]
                errors.append(None)
            except Exception as e:  # reported as that worker's first reply
                errors.append(e)
        for cfg, error in zip(cfgs, errors):
            if self.workers:
                self.workers[-1].leave()
            self.workers.append(LogicalWorker(cfg, self.slots.control, error))

    def sync(self) -> None:
        sync_mappings(self.slots, self.writer)

    def close(self) -> None:
        self.workers = []
        self.doorbell = None  # type: ignore[assignment]
        self.writer = codec.SlotWriter()  # the old one may keep a mapping of the pool
        self.slots.close()


class _HostProbe:
    """parent_process().is_alive() in a physical process: whether the host lives."""

    def __init__(self, node: NodeSegment):
        self._node = node

    def is_alive(self) -> bool:
        return self._node.host_alive()


def _entry_ring(entry):
    return entry[1].request_ring


def _rank_gone(cfg: WorkerConfig) -> bool:
    """Whether the rank of `cfg` closed its pool or died: its control segment is gone
    (the rank holds it, and its owner lock, for the pool's whole life) or its owner lock
    is. Anything else that keeps this process from opening it (EACCES, EMFILE) says
    nothing of the rank, which waits for this process: False, and the caller fails
    loudly."""
    try:
        attachment = attach(cfg.pool)
    except PoolGone:
        return True
    except Exception:
        return False
    try:
        return not attachment.owner_alive()
    finally:
        attachment.close()


def _serve(entry: tuple[_Group, LogicalWorker], value: int, current: LogicalWorker | None,
           idle_since: int) -> LogicalWorker | None:
    """Serve one request of `entry`'s logical worker; returns the logical worker now
    entered, None if its rank closed its rings meanwhile. (A function of its own: no
    local name outlives the call to keep a dropped rank's pool mapped.)"""
    group, lw = entry
    if lw is not current:
        if current is not None:
            current.leave()
        lw.enter()
    try:
        request = claimed(lw, group.slots, value)
        if request is not None:  # else moved by its rank: its new slot is further down the ring
            serve_request(lw, group.slots, group.writer, request, idle_since, shared=True)
            group.doorbell.ring()
    except RingClosed:
        return None
    except Exception:
        if group.slots.owner_alive():
            raise  # loud: every rank's next wait says this process died
        return None  # its rank died while this process served it (a slot it cannot map)
    return lw


class _Served:
    """What one process serves: the groups attached, their logical workers in round-robin
    order, and the one entered now. Every reference to a group lives here, so dropping
    it here unmaps its rank's pool."""

    def __init__(self) -> None:
        self.groups: dict = {}
        self.entries: list[tuple[_Group, LogicalWorker]] = []
        self.current: LogicalWorker | None = None
        self.start = 0

    def attach(self, key, cfgs: tuple[WorkerConfig, ...]) -> None:
        try:
            group = _Group(key, cfgs, self.current)
        except Exception:
            # the current worker may have been left (its RNG states kept) before the
            # failure: the next one to run is entered, so that it gets its own back
            self.current = None
            if _rank_gone(cfgs[0]):
                return  # the rank left before this process could attach its pool
            raise  # loud: every rank's next wait says this process died
        self.groups[key] = group
        self.current = group.workers[-1]
        self.entries += [(group, lw) for lw in group.workers]

    def drop(self, key) -> None:
        group = self.groups.pop(key)
        if self.current is not None and any(self.current is lw for lw in group.workers):
            self.current = None  # its RNG states go with it
            forget_worker_info()
        self.entries = [(g, lw) for g, lw in self.entries if g is not group]
        self.start = 0
        group.close()

    def check(self) -> None:
        """Drop the groups whose rank died (its in-flight work with them); map what the
        others' pools changed."""
        for key in [k for k, g in self.groups.items() if not g.slots.owner_alive()]:
            self.drop(key)
        for key in list(self.groups):
            try:
                self.groups[key].sync()
            except Exception:
                if self.groups[key].slots.owner_alive():
                    raise  # a live rank's pool this process cannot follow: loud
                self.drop(key)  # it died meanwhile

    def close(self) -> None:
        for key in list(self.groups):
            self.drop(key)


def node_loop(p: int, node_locator: tuple, commands) -> None:
    """Physical process `p`: attach the node segment, hold this process's lock, then
    serve (module docstring). `commands`: the read end of a pipe from the host,
    carrying ("attach", key, configs); ("retire",): another generation of processes
    replaced this one's (node_workers="auto"), so exit once the groups attached have
    all ended; None or EOF: stop."""
    freeze_inherited()
    prepare_process(p)
    node = NodeSegment.attach(node_locator)
    node.hold_process_lock(p)
    parent_process_through(_HostProbe(node))
    bell = node.bells[p]
    served = _Served()
    checked = time.monotonic()
    idle_since = time.perf_counter_ns()
    retiring = False  # replaced (node_workers="auto"): exit once no group is attached
    try:
        while True:
            while (command := _command(commands)) is not False:
                if command is None:
                    return
                if command[0] == "retire":
                    retiring = True
                else:
                    served.attach(command[1], command[2])
            if retiring and not served.groups:
                return
            now = time.monotonic()
            if now - checked >= WORKER_TICK:
                checked = now
                if not node.host_alive():
                    return
                served.check()
                stall.check_handler()
            found = first_request(served.entries, served.start, _entry_ring, closed_ok=True)
            if found is None:
                if bell.drain():  # the tokens of requests earlier polls took: look again
                    continue
                bell.wait(WORKER_TICK)
                continue
            i, slot = found
            if slot is None:  # the rank's iterator ended (closed its rings)
                served.drop(served.entries[i][0].key)
                continue
            served.start = (i + 1) % len(served.entries)
            if not node.host_alive():
                return  # no request is served for a host that is gone
            served.current = _serve(served.entries[i], slot, served.current, idle_since)
            idle_since = time.perf_counter_ns()
            if served.current is None:
                served.drop(served.entries[i][0].key)
    except KeyboardInterrupt:
        pass
    except Exception:
        if node.host_alive():
            # loud: a traceback on stderr (as a worker's), and for every rank's WorkerDied
            node.record_error(p, traceback.format_exc())
            raise
    finally:
        served.close()
        node.close()


def _command(commands):
    """The host's next command: ("attach", key, configs) or ("retire",); None to stop
    (or the host's end is gone); False if none is waiting."""
    try:
        return commands.recv() if commands.poll(0) else False
    except (EOFError, OSError):
        return None
