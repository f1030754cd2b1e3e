"""The main side of PoolLoader: requests, reorder buffer, leases, growth, liveness.

It builds on torch's `_BaseDataLoaderIter`, so the sampler, base seed, length
and IterableDataset warnings are DataLoader's own; request scheduling mirrors
`_MultiProcessingDataLoaderIter` call for call (same round-robin, same
prefetch, same in-order and `in_order=False` rules), so batches are assigned to
the same workers and delivered in the same order.

Slot states, all owned by main except IN_WORKER (invariant 1):
    FREE       in self._free (or cooling behind a CUDA event)
    IN_WORKER  in self._inflight: pushed on the worker's request ring
    READY      in self._task_info[seq] = (worker, slot): back, not yet delivered
    LEASED     in self._leases: delivered; its weakref callback queues it on
               self._released when the last view dies, and the next call here
               makes it FREE
"""
from __future__ import annotations

import atexit
import collections
import functools
import gc
import itertools
import os
import signal
import threading
import time
import warnings
import weakref

import torch
from torch._utils import ExceptionWrapper
from torch.utils.data.dataloader import _BaseDataLoaderIter, _MultiProcessingDataLoaderIter

from poolloader import slot_format as fmt
from poolloader.errors import PoolExhausted, SlotCorrupt, WorkerDied
from poolloader.pool import SlotPool, page_round
from poolloader.stats import LoaderStats
from poolloader.worker import WorkerConfig, worker_loop

# How long main sleeps between liveness checks while waiting (seconds).
MAIN_TICK = 0.1
# How long shutdown waits for workers to leave by themselves before terminating them.
JOIN_TIMEOUT = 1.0
# Headroom when a slot grows.
GROWTH_FACTOR = 1.25
# Slots beyond num_workers * prefetch_factor for batches the consumer holds.
SPARE_SLOTS = 2

_live_iterators: "weakref.WeakSet[PoolLoaderIter]" = weakref.WeakSet()
_live_lock = threading.Lock()


@atexit.register
def _shutdown_live_iterators() -> None:
    # Runs before multiprocessing's own exit handler (registered earlier, runs
    # later), so names are unlinked before daemon workers are terminated.
    with _live_lock:
        iterators = list(_live_iterators)
    for it in iterators:
        it._shutdown_workers()


def _release(queue: collections.deque, slot: int, _ref) -> None:
    # Weakref callback: runs wherever the last view died (any thread). deque.append
    # is atomic under the GIL: no lock, no CUDA, nothing else here (invariant 3).
    queue.append(slot)


# Start methods whose Popen.poll() uses waitpid, not the sentinel pipe.
_WAITPID_POPENS = ("multiprocessing.popen_fork", "multiprocessing.popen_spawn_posix")


def _release_pipes(process) -> None:
    """Close the two pipe ends multiprocessing keeps in the parent for each fork or
    spawn child. They serve only Process.join(timeout) and the child's
    parent_process(), neither of which poolloader uses (liveness is waitpid,
    parent death is getppid), and they would make main's descriptors grow with
    num_workers: 32 workers would need 64 (invariant 2). Forkserver children
    keep theirs: their exit code arrives through it."""
    popen = process._popen
    if type(popen).__module__ in _WAITPID_POPENS and getattr(popen, "finalizer", None):
        popen.finalizer()
        popen.sentinel = None
        process._sentinel = None


def _join_all(processes, timeout: float) -> None:
    """Wait up to `timeout` s in all for the processes to exit (waitpid polling,
    since their sentinel pipes may be closed)."""
    deadline = time.monotonic() + timeout
    pause = 0.001
    while any(p.is_alive() for p in processes) and time.monotonic() < deadline:
        time.sleep(pause)
        pause = min(pause * 2, 0.02)


def _describe_exit(code) -> str:
    if code is None:
        return "no exit code"
    if code < 0:
        try:
            return f"signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


class PoolLoaderIter(_MultiProcessingDataLoaderIter):
    """Frameworks recognise DataLoader's multi-process iterator by class (Lightning
    shuts its workers down only if isinstance(it, _MultiProcessingDataLoaderIter)),
    so this is one; its queue-based __init__ is skipped and every method that
    touches queues, pin threads or workers is replaced below."""

    def __init__(self, loader) -> None:
        _BaseDataLoaderIter.__init__(self, loader)
        self._shutdown = True  # until workers exist there is nothing to shut down
        self._owner_pid = os.getpid()
        self._workers = []
        self._pool = None
        self._prefetch_factor = loader.prefetch_factor
        self._in_order = loader.in_order
        self._stats: LoaderStats = loader.stats
        self._gate = None
        self._stager = None
        self._staged = None
        self._host_done = False
        self._deferred_error = None
        device = getattr(loader, "device", None)
        if device is not None and torch.device(device).type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device={device!r} needs CUDA, which this machine does not have; "
                                 "pass device=None (or 'cpu')")
            self._pin_memory = True  # copies go straight from the registered slots
        if self._pin_memory and torch.cuda.is_available():
            from poolloader.cuda import SlotGate
            self._gate = SlotGate(device)
        if device is not None:
            from poolloader.cuda import DeviceStager
            self._stager = DeviceStager(device)
        n = self._num_workers
        slots = loader.slots if loader.slots is not None else n * self._prefetch_factor + SPARE_SLOTS
        max_slots = loader.max_slots if loader.max_slots is not None else max(2 * slots, slots + 8)
        if slots < 1 or max_slots < slots:
            raise ValueError(f"need 1 <= slots <= max_slots, got slots={slots}, max_slots={max_slots}")
        # a previous pool of this loader already learned how big batches are
        slot_bytes = max(loader.slot_bytes, loader.stats.learned_slot_bytes, fmt.MIN_SLOT_BYTES)
        self._released: collections.deque = collections.deque()
        self._leases: dict[int, weakref.ref] = {}
        self._inflight: dict[int, tuple[int, int]] = {}  # slot -> (seq, worker)
        self._headers: dict[int, tuple[object, object]] = {}  # slot -> (mapping, header view)
        self._epoch = 0
        self._warned_growth = False
        ctx = loader.multiprocessing_context or torch.multiprocessing
        self._pool = SlotPool(
            n, slots, max_slots, slot_bytes, loader.shm_limit,
            on_map=self._gate.register if self._gate else None,
            on_unmap=self._gate.unregister if self._gate else None)
        self._shutdown = False
        try:
            self._free = list(range(slots - 1, -1, -1))
            control = self._pool.control
            self._request_rings = control.request_rings
            self._done_rings = control.done_rings
            self._doorbell = control.doorbell
            self._poll_start = 0
            for i in range(n):
                cfg = WorkerConfig(
                    dataset_kind=self._dataset_kind, dataset=self._dataset,
                    auto_collation=self._auto_collation, collate_fn=self._collate_fn,
                    drop_last=self._drop_last, base_seed=self._base_seed,
                    init_fn=loader.worker_init_fn, worker_id=i, num_workers=n,
                    prefix=self._pool.prefix)
                w = ctx.Process(target=worker_loop, args=(cfg,), daemon=True)
                w.start()
                self._workers.append(w)
                _release_pipes(w)
            with _live_lock:
                _live_iterators.add(self)
            self._stats._attach(self._pool)
            self._reset(loader, first_iter=True)
        except BaseException:
            self._shutdown_workers()
            raise

    # -- epochs --------------------------------------------------------------
    def _reset(self, loader, first_iter=False) -> None:
        _BaseDataLoaderIter._reset(self, loader, first_iter)
        if self._staged is not None:
            self._stager.wait(self._staged)  # its copy reads a slot about to be reused
        self._staged = None
        self._host_done = False
        self._deferred_error = None
        self._ended = False
        if not first_iter:
            self._reclaim_all()
            self._epoch += 1
        self._send_idx = 0
        self._rcvd_idx = 0
        self._task_info = {}
        self._tasks_outstanding = 0
        self._workers_status = [True] * self._num_workers
        self._workers_num_tasks = [0] * self._num_workers
        self._worker_queue_idx_cycle = itertools.cycle(range(self._num_workers))
        self._put_debt = 0
        self._sampler_exhausted = False
        for _ in range(self._prefetch_factor * self._num_workers):
            self._try_put_index()

    def _reclaim_all(self) -> None:
        """Take back every slot of the previous epoch (persistent workers)."""
        for info in self._task_info.values():
            if len(info) == 2:
                self._free_slot(info[1])
        self._task_info = {}
        while self._inflight:
            slot, _worker = self._wait_returned()
            status = int(self._header(slot)[fmt.F_STATUS])
            if status == fmt.ST_GROW:
                self._grow_and_resend(slot)
                continue
            self._inflight.pop(slot)
            self._free_slot(slot)

    # -- requests --------------------------------------------------------------
    def _try_put_index(self) -> None:
        slot = self._take_free_slot()
        if slot is None:
            self._put_debt += 1  # paid as soon as the consumer drops a batch
            return
        self._put_index(slot)

    def _put_index(self, slot: int) -> None:
        # DataLoader's _try_put_index, with a slot as the vehicle.
        max_tasks = self._prefetch_factor * self._num_workers
        try:
            index = self._next_index()
        except StopIteration:
            self._sampler_exhausted = True
            self._put_debt = 0
            self._free_slot(slot)
            return
        for _ in range(self._num_workers):
            worker = next(self._worker_queue_idx_cycle)
            if self._workers_status[worker]:
                if self._in_order:
                    break
                if self._workers_num_tasks[worker] < max_tasks // sum(self._workers_status):
                    break
        else:
            self._put_debt = 0
            self._free_slot(slot)
            return
        fmt.write_request(self._pool.mappings[slot], self._header(slot), self._send_idx,
                          self._epoch, index)
        self._inflight[slot] = (self._send_idx, worker)
        self._request_rings[worker].push(slot, timeout=None)  # capacity max_slots: never full
        self._task_info[self._send_idx] = (worker,)
        self._workers_num_tasks[worker] += 1
        self._tasks_outstanding += 1
        self._send_idx += 1

    def _pay_debt(self, force: bool) -> None:
        """Send the requests that waited for a free slot.

        With `force` (nothing else in flight: without a request now the epoch
        would end early) collect garbage once, then grow the pool, then raise.
        No state changes before an error, so the caller can drop batches and retry.
        """
        while self._put_debt > 0:
            slot = self._take_free_slot()
            if slot is None:
                if not force:
                    return
                gc.collect()
                slot = self._take_free_slot(wait_gate=True)
                if slot is None:
                    slot = self._add_slot()
                force = False
            self._put_debt -= 1
            self._put_index(slot)

    def _add_slot(self) -> int:
        pool = self._pool
        if pool.num_slots >= pool.max_slots:
            raise PoolExhausted(
                f"the consumer holds all {pool.num_slots} slots of the pool (max_slots="
                f"{pool.max_slots}): every batch PoolLoader delivered is still alive. Drop "
                "batches you no longer need (or copy what you keep, e.g. tensor.clone()), "
                "or raise max_slots=.")
        if not self._warned_growth:
            self._warned_growth = True
            warnings.warn(
                f"PoolLoader: the consumer holds all {pool.num_slots} slots (delivered batches "
                f"are still alive); growing the pool, up to max_slots={pool.max_slots}. Pass a "
                "larger slots= to start with more, or release batches sooner.", stacklevel=4)
        slot = pool.add_slot()
        self._stats.pool_growths += 1
        return slot

    # -- slots -------------------------------------------------------------------
    def _header(self, slot: int):
        mapping = self._pool.mappings[slot]
        cached = self._headers.get(slot)
        if cached is None or cached[0] is not mapping:
            cached = self._headers[slot] = (mapping, fmt.header_view(mapping))
        return cached[1]

    def _drain_released(self) -> None:
        released = self._released
        while released:
            slot = released.popleft()
            del self._leases[slot]
            self._free_slot(slot)

    def _free_slot(self, slot: int) -> None:
        if self._gate is not None:
            self._gate.cool(slot)
        else:
            self._free.append(slot)

    def _take_free_slot(self, wait_gate: bool = False) -> int | None:
        if self._released:
            self._drain_released()
        if self._gate is not None:
            self._free.extend(self._gate.ready(wait=wait_gate and not self._free))
        if not self._free:
            return None
        slot = self._free.pop()
        if self._pool.needs_resize(slot):
            self._replace(slot, self._pool.target_bytes)
        return slot

    def _replace(self, slot: int, nbytes: int) -> None:
        self._headers.pop(slot, None)
        self._pool.replace(slot, nbytes)
        self._stats.slot_growths += 1

    def _grow_and_resend(self, slot: int) -> None:
        needed = int(self._header(slot)[fmt.F_NEEDED])
        _seq, worker = self._inflight[slot]
        try:
            if needed <= self._pool.size(slot):
                raise SlotCorrupt(f"worker {worker} asked for {needed} bytes for slot {slot}, "
                                  f"which already has {self._pool.size(slot)}")
            self._replace(slot, page_round(int(needed * GROWTH_FACTOR)))
        except BaseException:
            # the worker holds the batch and waits for this slot: nothing can
            # continue, so stop everything rather than wait for it forever
            self._shutdown_workers()
            raise
        self._request_rings[worker].push(slot, timeout=None)

    # -- waiting -------------------------------------------------------------------
    def _poll_done(self):
        rings = self._done_rings
        n = len(rings)
        start = self._poll_start
        for k in range(n):
            w = (start + k) % n
            slot = rings[w].try_pop()
            if slot is not None:
                self._poll_start = (w + 1) % n
                return slot, w
        return None

    def _wait_returned(self) -> tuple[int, int]:
        """Block until some worker returns a slot; (slot, worker). Bounded by
        `timeout=` and by worker liveness, checked every MAIN_TICK."""
        got = self._poll_done()
        if got is None:
            # Rings found on a poll leave their doorbell tokens behind; drop them,
            # then poll once more, so the wait below sleeps instead of spinning.
            while self._doorbell.wait(0.0):
                pass
            got = self._poll_done()
        if got is None:
            t0 = time.perf_counter()
            deadline = time.monotonic() + self._timeout if self._timeout > 0 else None
            while got is None:
                wait = MAIN_TICK
                if deadline is not None:
                    wait = min(wait, deadline - time.monotonic())
                    if wait <= 0:
                        raise RuntimeError(f"DataLoader timed out after {self._timeout} seconds")
                if not self._doorbell.wait(wait):
                    self._check_workers()
                    self._pool.unlink_mapped()
                got = self._poll_done()
            self._stats.main_wait_s += time.perf_counter() - t0
        slot, worker = got
        expected = self._inflight.get(slot)
        if expected is None or expected[1] != worker:
            raise SlotCorrupt(f"internal error: worker {worker} returned slot {slot}, "
                              f"which main did not give it")
        self._pool.unlink_mapped()
        return got

    def _check_workers(self) -> None:
        for i, w in enumerate(self._workers):
            if not w.is_alive():
                code = w.exitcode
                self._shutdown_workers()
                raise WorkerDied(
                    f"PoolLoader worker {i} (pid {w.pid}) exited unexpectedly with "
                    f"{_describe_exit(code)}. If it was killed for memory (signal 9), lower "
                    "num_workers or batch_size; run with num_workers=0 to see the error in "
                    "the main process.")

    # -- delivery -------------------------------------------------------------------
    def _next_data(self):
        if self._stager is None:
            return self._next_host()
        # device=: keep one batch copying on the side stream while the consumer
        # works on the previous one.
        if self._staged is None:
            if self._deferred_error is not None:
                error, self._deferred_error = self._deferred_error, None
                raise error
            if self._host_done:
                raise StopIteration
            self._staged = self._stager.stage(self._next_host())
        ticket = self._staged  # stays in self._staged, so a shutdown meanwhile waits for its copy
        following = None
        try:
            following = self._stager.stage(self._next_host())
        except StopIteration:
            self._host_done = True
        except Exception as error:  # delivered after the batch already copied
            self._deferred_error = error
        self._staged = following
        return self._stager.deliver(ticket)

    def _next_host(self):
        if self._shutdown:
            if self._ended:
                raise StopIteration
            raise RuntimeError(
                "this PoolLoader iterator was shut down by the error raised before "
                "(or by interpreter exit); iterate the loader again for a new one")
        while True:
            self._pay_debt(force=False)
            while self._rcvd_idx < self._send_idx:
                info = self._task_info.get(self._rcvd_idx, None)
                if info:
                    worker_id = info[0]
                    if len(info) == 2 or self._workers_status[worker_id]:
                        break
                    del self._task_info[self._rcvd_idx]
                self._rcvd_idx += 1
            else:
                if self._put_debt > 0 and not self._sampler_exhausted:
                    self._pay_debt(force=True)
                    continue
                if not self._persistent_workers:
                    self._ended = True
                    self._shutdown_workers()
                raise StopIteration

            if len(self._task_info[self._rcvd_idx]) == 2:
                worker_id, slot = self._task_info.pop(self._rcvd_idx)
                self._rcvd_idx += 1
                return self._process_data(slot, worker_id)

            slot, worker = self._wait_returned()
            header = self._header(slot)
            status = int(header[fmt.F_STATUS])
            if status == fmt.ST_GROW:
                self._grow_and_resend(slot)
                continue
            idx, worker = self._inflight.pop(slot)
            self._tasks_outstanding -= 1
            if status == fmt.ST_END:
                self._free_slot(slot)
                if self._workers_status[worker]:
                    self._workers_status[worker] = False
                    self._try_put_index()
                continue
            if status not in (fmt.ST_READY, fmt.ST_ERROR):
                self._shutdown_workers()
                raise SlotCorrupt(f"slot {slot} came back from worker {worker} with status {status}")
            if idx not in self._task_info:
                # its worker ended before this task (iterable): nothing to deliver
                self._free_slot(slot)
                continue
            if idx != self._rcvd_idx:
                if not self._in_order:
                    self._task_info.pop(idx)
                    return self._process_data(slot, worker)
                self._task_info[idx] += (slot,)
            else:
                del self._task_info[idx]
                self._rcvd_idx += 1
                return self._process_data(slot, worker)

    def _process_data(self, slot: int, worker: int):
        self._workers_num_tasks[worker] -= 1
        header = self._header(slot)
        status = int(header[fmt.F_STATUS])
        try:
            payload, lease = fmt.decode(self._pool.mappings[slot], header)
        except BaseException:
            self._free_slot(slot)
            self._try_put_index()
            raise
        if lease is None:
            self._free_slot(slot)
        else:
            self._leases[slot] = weakref.ref(lease, functools.partial(_release, self._released, slot))
            del lease
        self._try_put_index()
        self._stats.batches += 1
        if status == fmt.ST_ERROR:
            if not isinstance(payload, ExceptionWrapper):
                raise SlotCorrupt(f"slot {slot} reports an error but carries {type(payload).__name__}")
            payload.reraise()
        return payload

    # -- teardown ---------------------------------------------------------------------
    def _shutdown_workers(self) -> None:
        """The one place that stops everything, in order: close the request rings
        (wakes and ends every worker) → join with a deadline → terminate → kill →
        unlink every name and drop the mappings. Idempotent."""
        if self._shutdown or os.getpid() != self._owner_pid:
            return  # nothing to do, or an inherited copy in a forked child
        self._shutdown = True
        try:
            for ring in getattr(self, "_request_rings", ()):
                ring.close()
            _join_all(self._workers, JOIN_TIMEOUT)
        finally:
            for w in self._workers:
                if w.is_alive():
                    w.terminate()
            _join_all(self._workers, 1.0)
            for w in self._workers:
                if w.is_alive():
                    w.kill()
            _join_all(self._workers, 1.0)
            self._request_rings = self._done_rings = ()
            self._doorbell = None
            self._headers.clear()
            if self._staged is not None and self._stager is not None:
                self._stager.wait(self._staged)
            if self._gate is not None:
                self._gate.close()  # copies still reading cooling or leased slots finish first
            if self._pool is not None:
                self._stats._detach(self._pool)
                self._pool.close()
            with _live_lock:
                _live_iterators.discard(self)

    def __del__(self) -> None:
        try:
            self._shutdown_workers()
        except Exception:
            pass

