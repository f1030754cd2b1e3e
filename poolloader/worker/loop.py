"""The worker loop: pop a slot, fetch and collate into it, publish, repeat.

Runs in each worker process. Seeding, WorkerInfo, worker_init_fn and the
fetchers are torch's own, used as DataLoader's `_worker_loop` uses them, so a
dataset sees exactly what it sees under DataLoader. What differs is transport:
requests and replies are slot indices on this worker's two rings, the batch is
written into the slot, and errors travel through the slot as torch's
ExceptionWrapper.
"""
from __future__ import annotations

import random
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

from poolloader.errors import RingClosed, RingTimeout
from poolloader.resume.keys import WorkerProgress
from poolloader.shm.pool import WorkerSlots
from poolloader.wire import codec, filling
from poolloader.wire import slot_format as fmt
from poolloader.worker import stall, startup
from poolloader.worker.popen import parent_process_through

# How often an idle worker checks that its parent is alive (seconds).
WORKER_TICK = 0.25


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
    snapshot_every: int = 1  # PoolLoader(snapshot_every_n_steps=): see resume.keys.WorkerProgress


def _parent_alive(slots: WorkerSlots) -> bool:
    """Whether main (the pool's owner) still lives: its owner lock on the control
    segment is still held (poolloader.shm.backend). Neither the worker's parent (under
    forkserver, the forkserver) nor main's pid (reusable, namespace-relative) is
    consulted, so this is exact under fork, spawn and forkserver; one fcntl."""
    return slots.owner_alive()


def _sync(slots: WorkerSlots, writer: codec.SlotWriter, slot: int | None = None):
    """Map what main changed in the pool and drop every view of a segment that left it
    (only live memory stays mapped: docs/how-it-works.md, "Slot lifecycle"); with
    `slot`, return its mapping."""
    slots.sync()
    mapping = None if slot is None else slots.mapping(slot)
    if slots.dropped:
        slots.dropped = False
        writer.forget_stale(slots.current())
    return mapping


def worker_loop(cfg: WorkerConfig) -> None:
    from torch.utils.data import _DatasetKind

    slots = None
    try:
        if cfg.shared is not None:  # before attaching: main frees it once all have replied
            cfg.dataset, cfg.init_fn, cfg.collate_fn = startup.load(cfg.shared)
        signal_handling._set_worker_signal_handlers()
        stall.install_dumper(cfg.worker_id)  # before anything that may block: init_fn, imports
        torch.multiprocessing._set_thread_name("pt_data_worker")
        torch.set_num_threads(1)
        seed = cfg.base_seed + cfg.worker_id
        random.seed(seed)
        torch.manual_seed(seed)
        try:
            import numpy as np
            np.random.seed(_generate_state(cfg.base_seed, cfg.worker_id))
        except ImportError:
            pass
        dataset = cfg.dataset
        if isinstance(dataset, IterDataPipe):
            # as DataLoader's worker: the pipe's shuffles draw from the epoch's shared seed
            if cfg.shared_seed is None:
                raise RuntimeError("internal error: an IterDataPipe worker without a shared seed")
            dataset = apply_random_seed(dataset, torch.Generator().manual_seed(cfg.shared_seed))
        torch_worker._worker_info = WorkerInfo(
            id=cfg.worker_id, num_workers=cfg.num_workers, seed=seed, dataset=dataset)

        slots = WorkerSlots(cfg.pool, cfg.worker_id)
        parent_process_through(slots)  # parent_process().is_alive(), as DataLoader's
        control = slots.control
        request_ring = control.request_rings[cfg.worker_id]
        done_ring = control.done_rings[cfg.worker_id]
        doorbell = control.doorbell

        # torch's default collate gives the same result stacked into the slot.
        collate_fn = cfg.collate_fn
        if collate_fn is default_collate:
            collate_fn = filling.slot_collate

        def new_fetcher():
            return _DatasetKind.create_fetcher(
                cfg.dataset_kind, dataset, cfg.auto_collation, collate_fn, cfg.drop_last)

        init_exception = None
        fetcher = None
        progress = WorkerProgress(cfg.resume, dataset, cfg.dataset_kind == _DatasetKind.Iterable,
                                  cfg.snapshot_every, cfg.num_workers)
        try:
            if cfg.init_fn is not None:
                cfg.init_fn(cfg.worker_id)
            fetcher = progress.first_fetcher(new_fetcher)
        except Exception:
            init_exception = ExceptionWrapper(where=f"in DataLoader worker process {cfg.worker_id}")
        stall.check_handler()  # init_fn may have taken the stack signal for itself

        writer = codec.SlotWriter()
        epoch = 0
        iteration_end = False
        # slot -> (payload, status, resume record) awaiting a bigger slot
        pending: dict[int, tuple[Any, int, bytes]] = {}

        my_stats = control.worker_stats[cfg.worker_id]
        idle_since = time.perf_counter_ns()
        while True:
            try:
                slot = request_ring.pop(timeout=WORKER_TICK)
            except RingTimeout:
                if not _parent_alive(slots):
                    slots.unlink_all()
                    return
                _sync(slots, writer)
                stall.check_handler()
                continue
            except RingClosed:
                return
            busy_since = time.perf_counter_ns()
            my_stats[2] += busy_since - idle_since
            my_stats[3] = stall.busy_stamp(slot, busy_since)  # for a stall report, read only then
            mapping = _sync(slots, writer, slot)
            header = fmt.header_view(mapping)
            fresh = slot in pending  # a payload waiting for this (now bigger) slot
            if fresh:
                payload, status, state = pending.pop(slot)
            else:
                req_epoch = fmt.request_epoch(header)
                if req_epoch != epoch:
                    epoch = req_epoch
                    iteration_end = False
                    if isinstance(dataset, IterDataPipe):  # DataLoader's _ResumeIteration
                        dataset = apply_random_seed(dataset, torch.Generator().manual_seed(
                            fmt.request_shared_seed(header)))
                    if init_exception is None:
                        try:  # an IterableDataset's __iter__ runs here
                            fetcher = progress.epoch_fetcher(new_fetcher)
                        except Exception:
                            fetcher = None
                            init_exception = ExceptionWrapper(
                                where=f"in DataLoader worker process {cfg.worker_id}")
                payload, status = None, fmt.ST_END
                if not iteration_end:
                    writer.begin(mapping, slot)
                    filling.set_writer(writer)
                    try:
                        if init_exception is not None:
                            payload, status = init_exception, fmt.ST_ERROR
                            init_exception = None
                        elif fetcher is None:  # its epoch's __iter__ failed: nothing more
                            raise StopIteration
                        else:
                            index = fmt.read_request(mapping, header)
                            progress.fetched += 1
                            payload, status = fetcher.fetch(index), fmt.ST_READY
                    except StopIteration:
                        if cfg.dataset_kind != _DatasetKind.Iterable:
                            payload = ExceptionWrapper(where=f"in DataLoader worker process {cfg.worker_id}")
                            status = fmt.ST_ERROR
                        else:
                            iteration_end = True
                    except Exception:
                        payload = ExceptionWrapper(where=f"in DataLoader worker process {cfg.worker_id}")
                        status = fmt.ST_ERROR
                    finally:
                        filling.set_writer(None)
                try:
                    state = progress.capture(fetcher, fmt.request_seq(header)) if cfg.capture else b""
                except Exception:  # e.g. the dataset's state_dict(): reported like a fetch error
                    payload = ExceptionWrapper(where=f"in DataLoader worker process {cfg.worker_id}")
                    status, state = fmt.ST_ERROR, b""
            if status == fmt.ST_END:
                _publish_end(mapping, header, slot, state, pending)
            else:
                _publish(writer, mapping, header, slot, payload, status, state, pending,
                         cfg.worker_id, fresh)
            del payload
            idle_since = time.perf_counter_ns()
            if status != fmt.ST_END and slot not in pending:
                my_stats[0] += 1  # a batch (or error) published, not a request to grow
            my_stats[1] += idle_since - busy_since
            done_ring.push(slot, timeout=None)
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
