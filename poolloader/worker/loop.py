"""The worker loop: pop a slot, fetch and collate into it, publish, repeat.

Runs in each worker process, which hosts one logical worker (LogicalWorker: what
makes one DataLoader worker's batches) or, with PoolLoader(node_workers=), several,
served round robin. Seeding, WorkerInfo, worker_init_fn and the fetchers are torch's
own, used as DataLoader's `_worker_loop` uses them, so a dataset sees exactly what it
sees under DataLoader. What differs is transport:
requests and replies are slot indices on this worker's two rings, the batch is
written into the slot, and errors travel through the slot as torch's
ExceptionWrapper.
"""
from __future__ import annotations

import collections
import copy
import gc
import os
import random
import sys
import sysconfig
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch._utils import ExceptionWrapper
from torch.utils.data import IterDataPipe
from torch.utils.data._utils import signal_handling
from torch.utils.data._utils import worker as torch_worker
from torch.utils.data._utils.collate import default_collate
from torch.utils.data._utils.worker import WorkerInfo, _generate_state
from torch.utils.data.graph_settings import apply_random_seed

from poolloader.errors import RingClosed, RingTimeout, SlotCorrupt
from poolloader.resume.keys import WorkerProgress
from poolloader.shm._ring import claim
from poolloader.shm.control import WORKER_LOADED
from poolloader.shm.pool import WorkerSlots
from poolloader.wire import codec, filling
from poolloader.wire import slot_format as fmt
from poolloader.worker import stall, startup
from poolloader.worker.popen import parent_process_through

# How often an idle worker checks that its parent is alive (seconds).
WORKER_TICK = 0.25
# What torchrun tells each rank about itself: a node pool's process (poolloader.worker.node)
# serves several ranks, so each logical worker carries its rank's values and sets them
# while it runs, as a DataLoader worker inherits them from its rank.
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "WORLD_SIZE",
                  "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "ROLE_NAME")
# pending[slot]'s payload for a request whose fetch waits for a bigger slot (serve)
_DEFERRED = object()
# serve()'s answer for a request held until the requests before it are fetched
PARKED = -1


@dataclass
class WorkerConfig:
    dataset_kind: int
    dataset: Any
    auto_collation: bool
    collate_fn: Any
    drop_last: bool
    base_seed: int
    init_fn: Any
    worker_id: int
    num_workers: int
    pool: tuple  # SlotPool.locator: how to attach; its control segment tells whether main lives
    resume: dict | None = None  # poolloader.resume.tracker.ResumePlan.worker(): where to continue from
    # startup.SharedStart.ticket: dataset, init_fn and collate_fn are loaded from there
    # (spawn / forkserver; None: they came with this config)
    shared: tuple | None = None
    shared_seed: int | None = None  # DataLoader's _shared_seed (IterDataPipe shuffles)
    capture: bool = True  # PoolLoader(stateful=): each reply carries its resume record
    # PoolLoader(node_workers=): the process hosting this logical worker (its request
    # doorbell in the control block); unused when the worker is its own process
    host: int = 0
    snapshot_every: int = 1  # PoolLoader(snapshot_every_n_steps=): see resume.keys.WorkerProgress
    # a node pool's: the rank's RANK_VARIABLES, set in os.environ while this worker runs
    environ: dict | None = None


def _parent_alive(slots: WorkerSlots) -> bool:
    """Whether main (the pool's owner) still lives: its owner lock on the control
    segment is still held (poolloader.shm.backend). Neither the worker's parent (under
    forkserver, the forkserver) nor main's pid (reusable, namespace-relative) is
    consulted, so this is exact under fork, spawn and forkserver; one fcntl."""
    return slots.owner_alive()


def sync_mappings(slots: WorkerSlots, writer: codec.SlotWriter, slot: int | None = None):
    """Map what main changed in the pool and drop every view of a segment that left it
    (only live memory stays mapped: docs/how-it-works.md, "Slot lifecycle"); with
    `slot`, return its mapping."""
    slots.sync()
    mapping = None if slot is None else slots.mapping(slot)
    if slots.dropped:
        slots.dropped = False
        writer.forget_stale(slots.current())
    return mapping


def _numpy():
    try:
        import numpy as np
    except ImportError:
        return None
    return np


class LogicalWorker:
    """One DataLoader worker, as its batches see it: its id and seed, its RNG states
    (`random`, `torch`, `numpy`), its WorkerInfo, what worker_init_fn made of its own
    copy of the dataset, its fetcher (an IterableDataset's per-worker iterator), its
    epoch, its resume progress, the payloads it holds for a bigger slot, and its two
    rings. A process hosts one (the default) or several (PoolLoader(node_workers=)),
    and switches to the one a request belongs to: `enter()` makes its WorkerInfo and
    RNG states the process's, `leave()` keeps them until the next `enter()`.

    Built in its process, in worker id order: the seeding, worker_init_fn and first
    fetcher (iter() of an IterableDataset) run here, as in DataLoader's worker."""

    def __init__(self, cfg: WorkerConfig, control, copy_error: BaseException | None = None):
        from torch.utils.data import _DatasetKind

        self.cfg = cfg
        self.id = cfg.worker_id
        # its start arguments are loaded (it is built after every load of its process):
        # main may free them before this worker's first reply
        control.worker_stats[cfg.worker_id][WORKER_LOADED] = 1
        self.where = f"in DataLoader worker process {cfg.worker_id}"
        self._set_environ()
        seed = cfg.base_seed + cfg.worker_id
        random.seed(seed)
        torch.manual_seed(seed)
        np = _numpy()
        if np is not None:
            np.random.seed(_generate_state(cfg.base_seed, cfg.worker_id))
        dataset = cfg.dataset
        if isinstance(dataset, IterDataPipe):
            # as DataLoader's worker: the pipe's shuffles draw from the epoch's shared seed
            if cfg.shared_seed is None:
                raise RuntimeError("internal error: an IterDataPipe worker without a shared seed")
            dataset = apply_random_seed(dataset, torch.Generator().manual_seed(cfg.shared_seed))
        self.dataset = dataset
        self.info = WorkerInfo(id=cfg.worker_id, num_workers=cfg.num_workers, seed=seed,
                               dataset=dataset)
        torch_worker._worker_info = self.info
        self.rng: tuple | None = None  # its RNG states while another logical worker runs

        # torch's default collate gives the same result stacked into the slot.
        self.collate_fn = cfg.collate_fn
        if self.collate_fn is default_collate:
            self.collate_fn = filling.slot_collate
        self.iterable = cfg.dataset_kind == _DatasetKind.Iterable

        self.init_exception: ExceptionWrapper | None = None
        self.fetcher = None
        self.progress = WorkerProgress(cfg.resume, dataset, self.iterable, cfg.snapshot_every,
                                       cfg.num_workers)
        try:
            if copy_error is not None:
                raise copy_error
            if cfg.init_fn is not None:
                cfg.init_fn(cfg.worker_id)
            self.fetcher = self.progress.first_fetcher(self.new_fetcher)
        except Exception:
            self.init_exception = ExceptionWrapper(where=self.where)
        stall.check_handler()  # init_fn may have taken the stack signal for itself

        self.epoch = 0
        self.iteration_end = False
        # slot -> (payload, status, resume record) awaiting a bigger slot
        # (or (_DEFERRED, ST_READY, the request's indices): a request not yet fetched)
        self.pending: dict[int, tuple[Any, int, Any]] = {}
        self.grow_hint = 0  # the largest slot a batch of this worker needed
        # (slot, deferred) of requests popped and not yet fetched, in the order they
        # came: deferred ones wait for main to grow their slot, the others (parked)
        # for those before them (serve)
        self.waiting: collections.deque = collections.deque()
        self.last_ticket = 0  # of the last value popped from the request ring (claimed)
        self.request_ring = control.request_rings[cfg.worker_id]
        self.done_ring = control.done_rings[cfg.worker_id]
        self.stats = control.worker_stats[cfg.worker_id]

    def new_fetcher(self):
        from torch.utils.data import _DatasetKind

        cfg = self.cfg
        return _DatasetKind.create_fetcher(cfg.dataset_kind, self.dataset, cfg.auto_collation,
                                           self.collate_fn, cfg.drop_last)

    def leave(self) -> None:
        """Another logical worker of this process runs next: keep this one's RNG states."""
        np = _numpy()
        self.rng = (random.getstate(), torch.get_rng_state(),
                    np.random.get_state() if np is not None else None)

    def _set_environ(self) -> None:
        environ = self.cfg.environ
        if environ is not None:
            for name in RANK_VARIABLES:
                value = environ.get(name)
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value

    def enter(self) -> None:
        """Make this logical worker the process's: its WorkerInfo, its RNG states (and,
        in a node pool, its rank's RANK_VARIABLES)."""
        torch_worker._worker_info = self.info
        self._set_environ()
        if self.rng is not None:
            py_state, torch_state, np_state = self.rng
            self.rng = None
            random.setstate(py_state)
            torch.set_rng_state(torch_state)
            if np_state is not None:
                _numpy().random.set_state(np_state)

    def _enter_epoch(self, req_epoch: int, shared_seed) -> None:
        """The request about to be fetched belongs to epoch `req_epoch`: a new one
        starts the epoch's fetcher (an IterableDataset's __iter__ runs here)."""
        if req_epoch == self.epoch:
            return
        self.epoch = req_epoch
        self.iteration_end = False
        if isinstance(self.dataset, IterDataPipe):  # DataLoader's _ResumeIteration
            self.dataset = apply_random_seed(self.dataset,
                                             torch.Generator().manual_seed(shared_seed))
        if self.init_exception is None:
            try:
                self.fetcher = self.progress.epoch_fetcher(self.new_fetcher)
            except Exception:
                self.fetcher = None
                self.init_exception = ExceptionWrapper(where=self.where)

    def _defer(self, mapping, header, slot: int) -> int:
        """Ask main for `slot` grown to grow_hint before fetching its request; keep the
        request (indices, epoch, seed) for then. Returns ST_GROW."""
        request = (fmt.read_request(mapping, header), fmt.request_epoch(header),
                   fmt.request_shared_seed(header))
        self.pending[slot] = (_DEFERRED, fmt.ST_READY, request)
        self.waiting.append((slot, True))
        fmt.mark_grow(header, self.grow_hint)
        return fmt.ST_GROW

    def serve(self, slots: WorkerSlots, writer: codec.SlotWriter, slot: int,
              in_turn: bool = False) -> int:
        """Produce the reply to the request in `slot` (popped from this worker's request
        ring, or `in_turn`: the oldest of `waiting`, parked) into it; returns its
        status, or PARKED (no reply yet: do not push the slot).

        A request in a slot smaller than a batch of this worker already needed
        (`grow_hint`) is not fetched into it: the worker asks main for a slot that
        big first (`_defer`), keeping only the request, and fetches it when the slot
        comes back. A batch fetched into a slot too small is held in this process's
        memory until the slot grows, so without this every request sent before the
        first growth (all of them at start) held a batch's worth of private memory
        besides its slot (issue 45: the first epoch's peak charge). Requests are
        fetched in the order they came, as DataLoader's worker fetches them (RNG
        states, an IterableDataset's iterator): while a deferred request waits for
        its slot, every later one waits too (`waiting`: deferred if its slot is
        small as well, else parked here, owned by this worker, and served once
        everything before it was)."""
        cfg = self.cfg
        mapping = sync_mappings(slots, writer, slot)
        header = fmt.header_view(mapping)
        pending = self.pending
        fresh = slot in pending  # a payload waiting for this (now bigger) slot
        request = None
        if fresh:
            payload, status, state = pending.pop(slot)
            if payload is _DEFERRED:  # its request, not yet fetched: fetch it now
                fresh, request = False, state
                if self.waiting and self.waiting[0][0] == slot:
                    self.waiting.popleft()
                else:  # main returns grown slots in the order they were asked for
                    raise SlotCorrupt(f"internal error: worker {cfg.worker_id} got slot {slot} "
                                      f"back out of turn (waiting: {list(self.waiting)})")
        elif self.waiting and not in_turn:  # an earlier request is not fetched yet
            if self.grow_hint > mapping.size:
                return self._defer(mapping, header, slot)
            self.waiting.append((slot, False))
            return PARKED
        if not fresh:
            if request is None:
                self._enter_epoch(fmt.request_epoch(header), fmt.request_shared_seed(header))
                if (self.grow_hint > mapping.size and not in_turn and not self.iteration_end
                        and self.init_exception is None and self.fetcher is not None):
                    return self._defer(mapping, header, slot)
            else:
                self._enter_epoch(request[1], request[2])
            payload, status = None, fmt.ST_END
            if not self.iteration_end:
                writer.begin(mapping, slot)
                filling.set_writer(writer)
                try:
                    if self.init_exception is not None:
                        payload, status = self.init_exception, fmt.ST_ERROR
                        self.init_exception = None
                    elif self.fetcher is None:  # its epoch's __iter__ failed: nothing more
                        raise StopIteration
                    else:
                        index = (fmt.read_request(mapping, header) if request is None
                                 else request[0])
                        self.progress.fetched += 1
                        payload, status = self.fetcher.fetch(index), fmt.ST_READY
                except StopIteration:
                    if not self.iterable:
                        payload = ExceptionWrapper(where=self.where)
                        status = fmt.ST_ERROR
                    else:
                        self.iteration_end = True
                except Exception:
                    payload = ExceptionWrapper(where=self.where)
                    status = fmt.ST_ERROR
                finally:
                    filling.set_writer(None)
            try:
                state = (self.progress.capture(self.fetcher, fmt.request_seq(header))
                         if cfg.capture else b"")
            except Exception:  # e.g. the dataset's state_dict(): reported like a fetch error
                payload = ExceptionWrapper(where=self.where)
                status, state = fmt.ST_ERROR, b""
        if status == fmt.ST_END:
            _publish_end(mapping, header, slot, state, pending)
        else:
            _publish(writer, mapping, header, slot, payload, status, state, pending,
                     cfg.worker_id, fresh)
        if slot in pending:
            self.grow_hint = max(self.grow_hint, fmt.needed_bytes(header))
        elif status != fmt.ST_END and slots.returns_tail:
            try:
                fmt.return_tail(mapping, header)
            except OSError:  # MADV_REMOVE refused (gVisor): the pages stay, as before
                slots.returns_tail = False
            except BufferError:  # something of this process views the slot: this time
                pass
        del payload
        return status


def claimed(lw: LogicalWorker, slots: WorkerSlots, value: int) -> int | None:
    """The slot of `value`, popped from `lw`'s request ring, if this worker now has its
    request: it swaps the slot's claim word (in the control block, always mapped) from
    the value's ticket to 0. None if main moved the request to another slot before (the
    ring holds that one next: PoolLoaderIter._move_newest), which leaves nothing to do
    here; the slot may carry a later request by now, under another ticket. Main's
    tickets increase on every ring: one that does not was not written by main."""
    slot, ticket = fmt.ring_entry(value)
    control = slots.control
    if value < 0 or slot >= control.layout.max_slots:
        return slot  # not a value main writes: the slot's bounds check refuses it
    if ticket == 0:
        raise SlotCorrupt(
            f"the request ring of worker {lw.cfg.worker_id} gave slot {slot} without a ticket: "
            "main pushes none such, so a process that maps the control block wrote over the "
            "ring (a stray write in dataset, collate or extension code running in a worker)")
    if ticket <= lw.last_ticket:
        raise SlotCorrupt(
            f"the request ring of worker {lw.cfg.worker_id} gave ticket {ticket} (slot {slot}) "
            f"after ticket {lw.last_ticket}: main's tickets only increase, so a process that "
            "maps the control block wrote over the ring (a stray write in dataset, collate or "
            "extension code running in a worker)")
    lw.last_ticket = ticket
    if claim(control.mapping, control.layout.claim_offset(slot), ticket):
        return slot
    return None


def forget_worker_info() -> None:
    """get_worker_info() says None again (no logical worker of this process runs: the
    one that ran is gone, and its WorkerInfo would keep its dataset alive)."""
    torch_worker._worker_info = None


# CPython 3.14's incremental collector marks every frozen object's space in its header,
# and a free-threaded build sets a bit in each: there gc.freeze() is O(objects) and
# writes to every inherited page (not measured here: this project's machines have
# neither; both read from CPython's gcmodule sources)
FREEZE_WRITES_HEADERS = (sys.version_info >= (3, 14)
                         or bool(sysconfig.get_config_var("Py_GIL_DISABLED")))


def freeze_inherited() -> None:
    """First thing in a worker process: every object it has now (what a fork of main,
    of the node pool's host rank or of the zygote inherited) leaves its garbage
    collections. A full collection writes into the header of every object it visits
    (and restores it), so each page of objects the process shared with its parent
    became its own copy: the first full collection (unpickling a rank's dataset
    triggers it) cost the node pool 33 MiB of its cgroup's charge at RF-DETR's shape,
    4 ranks, 2 processes (docs/benchmarks.md). O(1); what the process makes itself is
    collected as before, and a parent's garbage is never finalized here. CPython's
    gc.freeze documentation gives the same remedy for pre-fork servers. Not where the
    freeze itself writes every object's header (FREEZE_WRITES_HEADERS): it would copy
    every inherited page at once, collection or not."""
    if not FREEZE_WRITES_HEADERS:
        gc.freeze()


def prepare_process(worker_id: int) -> None:
    """What a DataLoader worker process sets up first: its signal handlers, its thread
    name, one intra-op thread; and the stack dumper of stall reports (before anything
    that may block: init_fn, imports)."""
    signal_handling._set_worker_signal_handlers()
    stall.install_dumper(worker_id)
    torch.multiprocessing._set_thread_name("pt_data_worker")
    torch.set_num_threads(1)


def serve_request(lw: LogicalWorker, slots: WorkerSlots, writer: codec.SlotWriter, slot: int,
                  idle_since: int, shared: bool) -> int:
    """Serve the request in `slot` (popped from `lw`'s ring; `lw` entered), count it in
    its worker stats and push the slot to its done ring (the caller rings the doorbell);
    then the requests parked behind it that may now be fetched (LogicalWorker.serve).
    `idle_since`: when the process last finished something; returns when it finished
    this one. `shared`: the process hosts other logical workers too."""
    idle_since = _serve_one(lw, slots, writer, slot, idle_since, shared, False)
    waiting = lw.waiting
    while waiting and not waiting[0][1]:  # parked, and everything before it fetched
        idle_since = _serve_one(lw, slots, writer, waiting.popleft()[0], idle_since, shared,
                                True)
    return idle_since


def _serve_one(lw: LogicalWorker, slots: WorkerSlots, writer: codec.SlotWriter, slot: int,
               idle_since: int, shared: bool, in_turn: bool) -> int:
    my_stats = lw.stats
    busy_since = time.perf_counter_ns()
    my_stats[2] += busy_since - idle_since  # the process's wait, for the worker it served
    my_stats[3] = stall.busy_stamp(slot, busy_since)  # for a stall report, read only then
    status = lw.serve(slots, writer, slot, in_turn)
    idle_since = time.perf_counter_ns()
    if status not in (fmt.ST_END, PARKED) and slot not in lw.pending:
        my_stats[0] += 1  # a batch (or error) published, not a request to grow
    my_stats[1] += idle_since - busy_since
    if shared:
        my_stats[3] = 0  # off it: the process moves on to another logical worker
    if status != PARKED:
        lw.done_ring.push(slot, timeout=None)
    return idle_since


def _own_copies(cfgs: tuple[WorkerConfig, ...]) -> list[BaseException | None]:
    """Give every logical worker after the first its own dataset, worker_init_fn and
    collate_fn, as each DataLoader worker has: unpickled once more from the shared start
    payload (spawn / forkserver; under fork too, where main could share them: its
    arrays then view the payload's pages copy-on-write, one copy for every process, as
    DataLoader's forked workers share main's), else deep-copied from what this process
    inherited or received (arrays included), before any worker_init_fn runs.
    Per worker: None, or why its copy could not be made (reported as its init error)."""
    first = cfgs[0]
    errors: list[BaseException | None] = [None]
    for cfg in cfgs[1:]:
        errors.append(None)
        if cfg.shared is not None:
            cfg.dataset, cfg.init_fn, cfg.collate_fn = startup.load(cfg.shared)
            continue
        try:
            cfg.dataset, cfg.init_fn, cfg.collate_fn = copy.deepcopy(
                (first.dataset, first.init_fn, first.collate_fn))
        except Exception as e:
            errors[-1] = TypeError(
                f"PoolLoader(node_workers=...): logical worker {cfg.worker_id} shares a process "
                f"with worker {first.worker_id} and needs its own copy of the dataset "
                f"({type(first.dataset).__module__}.{type(first.dataset).__qualname__}), its "
                f"worker_init_fn and collate_fn, as every DataLoader worker has one, but "
                f"copy.deepcopy failed: {type(e).__name__}: {e}. Make them copyable (e.g. open "
                "files or connections lazily, in worker_init_fn or on first use), or pass "
                "node_workers=None (one process per worker).")
            cfg.dataset, cfg.init_fn, cfg.collate_fn = first.dataset, None, first.collate_fn
    return errors


def first_request(entries: list, start: int, ring_of=lambda lw: lw.request_ring,
                  closed_ok: bool = False) -> tuple[int, int | None] | None:
    """(position in `entries`, slot) of the first pending request on their request
    rings (`ring_of(entry)`), looking from `start` round robin; None if none is pending.
    A closed ring raises RingClosed (shutdown), or with `closed_ok` gives (its
    position, None). The one round robin of a process serving several logical workers
    (here, and a node pool's process: poolloader.worker.node)."""
    n = len(entries)
    for k in range(n):
        i = (start + k) % n
        try:
            slot = ring_of(entries[i]).try_pop()
        except RingClosed:
            if not closed_ok:
                raise
            return i, None
        if slot is not None:
            return i, slot
    return None


def worker_loop(cfg: WorkerConfig, *hosted: WorkerConfig) -> None:
    """One worker process: logical worker `cfg` alone (the default), or with the
    logical workers `hosted` too (PoolLoader(node_workers=): this process then waits on
    its request doorbell and serves their requests round robin)."""
    freeze_inherited()
    cfgs = (cfg, *hosted)
    slots = None
    try:
        if cfg.shared is not None:  # before attaching: main frees it once all have replied
            cfg.dataset, cfg.init_fn, cfg.collate_fn = startup.load(cfg.shared)
        prepare_process(cfg.worker_id)
        copy_errors = _own_copies(cfgs) if hosted else [None]

        slots = WorkerSlots(cfg.pool, cfg.worker_id, tuple(c.worker_id for c in cfgs))
        parent_process_through(slots)  # parent_process().is_alive(), as DataLoader's
        control = slots.control
        doorbell = control.doorbell
        bell = control.request_doorbells[cfg.host] if hosted else None

        workers: list[LogicalWorker] = []
        for c, copy_error in zip(cfgs, copy_errors):
            if workers:
                workers[-1].leave()
            workers.append(LogicalWorker(c, control, copy_error))
        current = workers[-1]
        only = workers[0] if not hosted else None
        writer = codec.SlotWriter()
        start = 0  # where the round robin over `workers` looks first

        idle_since = time.perf_counter_ns()
        while True:
            try:
                if only is not None:
                    lw, value = only, only.request_ring.pop(timeout=WORKER_TICK)
                else:
                    got = first_request(workers, start)
                    if got is None:
                        bell.drain()  # type: ignore[union-attr]
                        got = first_request(workers, start)
                    if got is None:
                        if not bell.wait(WORKER_TICK):  # type: ignore[union-attr]
                            raise RingTimeout("no request within the tick")
                        continue
                    i, value = got
                    lw, start = workers[i], (i + 1) % len(workers)
            except RingTimeout:
                if not _parent_alive(slots):
                    slots.unlink_all()
                    return
                sync_mappings(slots, writer)
                stall.check_handler()
                continue
            except RingClosed:
                return
            slot = claimed(lw, slots, value)
            if slot is None:  # moved: its new slot is further down the ring
                continue
            if lw is not current:
                current.leave()
                lw.enter()
                current = lw
            idle_since = serve_request(lw, slots, writer, slot, idle_since, shared=only is None)
            doorbell.ring()
    except KeyboardInterrupt:
        pass
    except RingClosed:
        pass
    finally:
        if slots is not None and not _parent_alive(slots):
            slots.unlink_all()


def _publish(writer, mapping, header, slot, payload, status, state, pending, worker_id,
             fresh) -> None:
    """Encode into the slot, with the resume record `state`; on overflow ask main
    for a bigger one and keep the payload.

    `fresh`: the writer has not begun this mapping yet (a payload from before a
    growth, or an error); otherwise the collate already allocated in it.
    """
    if fresh or writer.mapping is not mapping:
        writer.begin(mapping, slot, check_kept=False)
    try:
        codec.encode(writer, header, payload, status)
        fmt.write_state(mapping, header, state)
    except codec.NeedsGrow as grow:
        pending[slot] = (payload, status, state)
        fmt.mark_grow(header, grow.needed)
    except Exception:
        # The batch cannot be carried (e.g. an unpicklable element): report why.
        error = ExceptionWrapper(where=f"in DataLoader worker process {worker_id}")
        writer.begin(mapping, slot, check_kept=False)
        try:
            codec.encode(writer, header, error, fmt.ST_ERROR)
            fmt.write_state(mapping, header, state)
        except codec.NeedsGrow as grow:
            pending[slot] = (error, fmt.ST_ERROR, state)
            fmt.mark_grow(header, grow.needed)
    finally:
        writer.end()


def _publish_end(mapping, header, slot, state, pending) -> None:
    """An END reply (the worker's IterableDataset is exhausted), with its resume record."""
    try:
        fmt.write_state(mapping, header, state)
    except codec.NeedsGrow as grow:
        pending[slot] = (None, fmt.ST_END, state)
        fmt.mark_grow(header, grow.needed)
        return
    fmt.mark_end(header)
