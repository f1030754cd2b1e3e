"""The main side of PoolLoader: DataLoader's scheduling, with slots as the vehicle.

It builds on torch's `_BaseDataLoaderIter`, so the sampler, base seed, length
and IterableDataset warnings are DataLoader's own; request scheduling mirrors
`_MultiProcessingDataLoaderIter` call for call (same round-robin, same
prefetch, same in-order and `in_order=False` rules), so batches are assigned to
the same workers and delivered in the same order. A request never waits for a
slot (poolloader.main.ledger detaches a held one instead), so requests go out exactly
when DataLoader's would.

Parts it uses: `ledger.SlotLedger` (slot states, sizing, growth, detach),
`supervise` (worker processes and the teardown ladder), `slot_format` (the
header and the batch codec), `cuda` (registration, reuse gate, device staging).
"""
from __future__ import annotations

import collections
import functools
import itertools
import math
import os
import time
import warnings
import weakref

import torch
from torch._utils import ExceptionWrapper
from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    IterDataPipe,
    MapDataPipe,
    RandomSampler,
    SequentialSampler,
)
from torch.utils.data.dataloader import (
    _BaseDataLoaderIter,
    _DatasetKind,
    _MultiProcessingDataLoaderIter,
    _sharding_worker_init_fn,
)

from poolloader.cuda import gate
from poolloader.errors import ControlCorrupt, SlotCorrupt, WorkerDied
from poolloader.main import stall, startup, supervise
from poolloader.main.ledger import SlotLedger, check_addressable, plan_sizes
from poolloader.main.requests import RequestScheduling
from poolloader.main.share import SHARE_SLACK
from poolloader.main.stats import LoaderStats
from poolloader.main.teardown import IteratorTeardown
from poolloader.main.tracked import TrackedNext
from poolloader.resume.tracker import IteratorSetup, ResumePlan, ResumeTracker
from poolloader.shm.control import WORKER_LOADED, hosted_by
from poolloader.shm.pool import SlotPool
from poolloader.wire import codec
from poolloader.wire import slot_format as fmt
from poolloader.worker.loop import RANK_VARIABLES, WorkerConfig, worker_loop
from poolloader.worker.popen import start_without_pipes

# torch's samplers whose every index is a Python int (exact types: a subclass may differ)
_INT_SAMPLERS = (SequentialSampler, RandomSampler, DistributedSampler)


def _yields_int_lists(index_sampler) -> bool:
    """Whether every request is a list of Python ints: torch's BatchSampler over one of
    torch's int samplers (DataLoader's default for shuffle=False/True, and the
    distributed one). Such requests are written raw (slot_format.encode_request)."""
    return type(index_sampler) is BatchSampler and type(index_sampler.sampler) in _INT_SAMPLERS


def _stall_reporter(workers, pool: SlotPool, ledger: SlotLedger, sent: dict):
    """What Replies calls for a stall report (poolloader.main.stall): which worker owes which
    batch, since when, and its stack. A closure over the iterator's parts, not over the
    iterator, so that no cycle delays the iterator's shutdown when it is dropped."""
    def report() -> str:
        control = pool.control
        return stall.report(workers, None if control is None else control.worker_stats,
                            ledger.inflight, sent)
    return report


class PoolLoaderIter(TrackedNext, RequestScheduling, IteratorTeardown,
                     _MultiProcessingDataLoaderIter):
    """Frameworks recognise DataLoader's multi-process iterator by class (Lightning
    shuts its workers down only if isinstance(it, _MultiProcessingDataLoaderIter)),
    so this is one; its queue-based __init__ is skipped and every method that
    touches queues, pin threads or workers is replaced below."""

    def __init__(self, loader, resume_plan=None, process_count: int | None = None,
                 main_rng: torch.Tensor | None = None) -> None:
        """`resume_plan`: a loaded state to continue from (poolloader.resume.tracker.ResumePlan);
        `process_count`: the worker processes to start (None: the loader's epoch_processes();
        a node_workers="auto" move within the epoch passes its count: _move_processes);
        `main_rng`: main's RNG state, set again once the base seed is drawn (a restart
        between epochs: persistent workers draw no base seed as an epoch begins)."""
        _BaseDataLoaderIter.__init__(self, loader)
        if main_rng is not None:
            torch.set_rng_state(main_rng)
        self._loader_ref = weakref.ref(loader)  # node_workers="auto": a move restarts from it
        self._shutdown = True  # until workers exist there is nothing to shut down
        self._shared_start: startup.SharedStart | None = None
        self._unheard: set[int] = set()  # workers that may not have loaded _shared_start yet
        self._teardown_left: tuple[str, ...] = ()  # _shutdown_workers' steps not yet done
        self._fatal: str | None = None
        self._owner_pid = os.getpid()
        self._workers: list = []  # logical worker i's process (node_workers: shared)
        self._request_bells: list | None = None
        # PoolLoader(node_pool=True) under torchrun: the node's processes host the
        # logical workers (poolloader.main.node); None: this iterator starts its own
        self._node = getattr(loader, "_node", None)
        self._node_gen = None  # the generation of the node's processes it attached to
        # PoolLoader(share_batches=) on the group's leader: every delivered slot is
        # handed to the followers too (poolloader.main.share)
        self._share = getattr(loader, "_share", None)
        self._share_epoch = 0  # the share's epoch this iterator is in (begin_epoch)
        # set below; None only while __init__ has not made them (a failed start)
        self._pool: SlotPool = None  # type: ignore[assignment]
        self._ledger: SlotLedger = None  # type: ignore[assignment]
        self._replies: supervise.Replies = None  # type: ignore[assignment]
        self._prefetch_factor = loader.prefetch_factor
        self._in_order = loader.in_order
        self._stats: LoaderStats = loader.stats
        self._epoch_started = time.perf_counter()  # start-up counts from here (stats)
        self._last_delivery: float | None = None
        # main_wait_s as this call began (_next_host), and how long main waited for its
        # workers of late: the call before's wait, or half the figure before, if more
        # (RequestScheduling._clean_top)
        self._wait_mark = float("inf")
        self._recent_wait = 0.0
        # slot -> the sample indices sent in its request (a reference): stall reports
        self._sent_indices: dict[int, object] = {}
        self._int_list_requests = _yields_int_lists(self._index_sampler)
        # gate: registers slots and gates their reuse on CUDA copies; stager: what
        # _next_data hands each host batch to (pinning, or device= copies one ahead)
        self._gate = self._stager = None
        self._gate, self._stager = gate.setup(loader, self._pin_memory,
                                              getattr(self, "_pin_memory_device", None))
        self._small_buffer = self._gate.small_buffer if self._gate is not None else None
        n = self._num_workers
        # node_workers=P < n: P processes host the n logical workers (worker i in
        # process hosted_by(i, P)); 0: one process per worker. "auto": this epoch's P
        hosting = loader.epoch_processes() if process_count is None else process_count
        hosts = hosting if hosting < n else 0
        if self._node is not None:
            hosts = 0  # the node's processes wait on the node segment's doorbells
        # requests sent and not yet delivered (each holds a slot): DataLoader's
        # prefetch_factor × num_workers; in order, a node pool's rank its share of the
        # node's (poolloader.main.node), the others drawn as DataLoader draws them and
        # held until one is delivered
        self._max_in_flight = self._prefetch_factor * n
        self._cap: int | None = None
        most = None  # the most the cap may become (the pool's capacity): the share's
        if self._node is not None and self._in_order:
            # the share now; it moves with the ranks sharing the node (_send_held)
            self._cap_weight = self._share.weight if self._share is not None else 1
            self._cap = self._max_in_flight = self._node.in_flight(n, self._prefetch_factor,
                                                                   self._cap_weight)
            most = self._cap_most = self._node.most_in_flight(n, self._prefetch_factor,
                                                              self._cap_weight)
        size = plan_sizes(loader, self._gate is not None, self._max_in_flight, most)
        if self._share is not None and loader.max_slots is None:
            size = size._replace(capacity=size.capacity + SHARE_SLACK,
                                 max_slots=size.max_slots + SHARE_SLACK)
        check_addressable(size, loader, self._max_in_flight)
        self._epoch = 0
        # state_dict()/load_state_dict(): takes the base seed of a loaded state, if any
        setup = IteratorSetup(n, self._base_seed, self._in_order, self._persistent_workers,
                              self._dataset_kind, self._index_sampler, self._shared_seed,
                              self._IterableDataset_len_called)
        self._resume = ResumeTracker(setup, loader, resume_plan)
        self._base_seed = self._resume.base_seed  # a loaded state's, if any
        ctx = loader.multiprocessing_context or torch.multiprocessing
        self._pool = SlotPool(
            n, size.slots, size.max_slots, size.slot_bytes, loader.shm_limit,
            on_map=self._gate.register if self._gate else None,
            on_unmap=self._gate.unregister if self._gate else None, backend=loader.shm_backend,
            hosts=hosts, keep_handles=self._share is not None,
            private_views=self._share is not None)
        self._ledger = SlotLedger(self._pool, self._stats, self._gate, size.capacity)
        self._shutdown = False
        if self._node is not None:
            self._node.acquire()  # released by the teardown's last step (_leave_node)
        if self._share is not None:
            self._share.acquire()  # released by the teardown's step _end_share
        self._teardown_left = self._TEARDOWN
        try:
            self._request_rings = self._pool.control.request_rings
            # per logical worker, the doorbell its host waits on (node_workers), else None
            bells = self._pool.control.request_doorbells
            self._request_bells = [bells[hosted_by(i, hosts)] for i in range(n)] if hosts else None
            inflight = self._ledger.inflight
            self._replies = supervise.Replies(self._pool.control, self._workers, self._timeout,
                                              self._stats, on_tick=self._pool.unlink_mapped,
                                              stall_warning=loader.stall_warning,
                                              stall_report=_stall_reporter(
                                                  self._workers, self._pool, self._ledger,
                                                  self._sent_indices),
                                              returned=self._ledger.returned,
                                              owed=lambda: [w for _, w in inflight.values()])
            init_fn = loader.worker_init_fn
            if isinstance(self._dataset, (IterDataPipe, MapDataPipe)):
                # DataLoader's workers shard a datapipe first (by worker and rank)
                init_fn = functools.partial(_sharding_worker_init_fn, init_fn,
                                            self._world_size, self._rank)
            # spawn / forkserver: the dataset, init_fn and collate_fn are pickled once
            # into shared memory, not once per worker (poolloader.main.startup)
            # (always with a node pool: the node's processes load every rank's from there)
            pickled = self._node is not None or startup.shares(ctx, self._pool.backend)
            # fork with node_workers: logical worker h < hosts (the first of its process)
            # keeps what its process inherited, the others load their own copies from
            # the segment, its arrays shared (startup.shares)
            first = 0 if pickled else hosts
            shared = startup.share((self._dataset, init_fn, self._collate_fn)) \
                if n and (pickled or (hosts and startup.shares(ctx, self._pool.backend, True))) \
                else None
            self._shared_start = shared
            # spawn / forkserver: workers are forks of this process's zygote
            zygote = None if self._node is not None else startup.zygote_for(
                ctx, getattr(loader, "zygote", None), self._dataset, self._collate_fn, init_fn)
            self._unheard = set(range(first, n)) if shared is not None else set()
            if self._unheard and self._pool.control is not None:
                # a new block is zeroed; this start's workers must each mark it anew
                self._pool.control.worker_stats[:, WORKER_LOADED] = 0
            cfgs = []
            for i in range(n):
                ticket = shared.ticket if shared is not None and i >= first else None
                cfgs.append(WorkerConfig(
                    dataset_kind=self._dataset_kind,
                    dataset=None if ticket else self._dataset,
                    auto_collation=self._auto_collation,
                    collate_fn=None if ticket else self._collate_fn,
                    drop_last=self._drop_last, base_seed=int(self._base_seed),
                    init_fn=None if ticket else init_fn, worker_id=i, num_workers=n,
                    pool=self._pool.locator, resume=self._resume.worker_plan(i),
                    shared=ticket, shared_seed=self._shared_seed,
                    capture=loader.stateful, snapshot_every=self._resume.snapshot_every,
                    host=hosted_by(i, hosts) if hosts else 0,
                    environ=None if self._node is None else {
                        name: os.environ[name] for name in RANK_VARIABLES if name in os.environ}))
                if not hosts and self._node is None:
                    self._workers.append(start_without_pipes(ctx, worker_loop, (cfgs[i],), zygote))
            if self._node is not None:
                # the generation attached to (node_workers="auto" may have replaced the
                # processes since `hosting` was read): its doorbells, its processes
                gen = self._node_gen = self._node.attach(cfgs)
                self._request_bells = self._node.bells(n, gen)  # in the node segment
                self._workers.extend(self._node.processes(n, gen))
                auto = loader.auto_workers()
                if (len(gen.pids) != hosting and auto is not None  # moved as it attached
                        and self._node.host_rank != self._node.local_rank):
                    auto.follow(self._stats, len(gen.pids), self._node.host_rank, attached=True)
                hosting = len(gen.pids)
            elif hosts:
                # self._workers[i] is logical worker i's process, one object per process
                processes = [start_without_pipes(ctx, worker_loop, tuple(cfgs[h::hosts]), zygote)
                             for h in range(hosts)]
                self._workers.extend(processes[hosted_by(i, hosts)] for i in range(n))
            supervise.track(self)
            self._stats.attach_pool(self._pool, self._ledger, self._workers)
            self._stats.num_workers = n
            self._stats.processes = hosting
            # node_workers="auto": the steady time (stats.iter_s) of the next review of
            # the process count within the epoch; never where a move could not be exact
            self._review_at = (loader.auto_workers().review_at(self._stats)
                               if self._moves_in_epoch(loader) else math.inf)
            self._reset(loader, first_iter=True)
        except BaseException:
            self._shutdown_workers()
            raise

    # -- what a user (or a test) may look at ----------------------------------
    @property
    def shm_prefix(self) -> str | None:
        """The /dev/shm name prefix of this iterator's pool (every name starts with it);
        None with the memfd backend, which names nothing."""
        return None if self._pool is None else self._pool.prefix

    @property
    def worker_pids(self) -> list[int]:
        """The worker processes' pids, each once (with node_workers=P, P of them)."""
        return [w.pid for w in supervise.unique(self._workers) if w.pid is not None]

    @property
    def prefetched(self) -> tuple[int, int]:
        """(replies waiting for main, requests in flight): a benchmark waits until the
        first equals the second before it times a next() that only hands off."""
        return self._replies.waiting(), len(self._ledger.inflight)

    @property
    def resume_tracker(self) -> ResumeTracker:
        """This iterator's progress (poolloader.resume.tracker): the loader's state_dict()
        reads it, also after the iterator is gone (plain data: it keeps no worker alive)."""
        return self._resume

    # -- epochs --------------------------------------------------------------
    def _reset(self, loader, first_iter=False) -> None:
        if self._shutdown and not first_iter:
            raise RuntimeError(self._dead_message())
        if not first_iter and self._node is not None and self._restarts_exactly(loader) \
                and self._follow_node(loader):  # node_workers="auto": may restart
            return  # the restart began this epoch
        self._resume.begin_epoch()  # before the sampler's iterator draws anything
        if self._share is not None:
            self._share.end_epoch(self._share_epoch)  # the previous one, if left early
            self._share_epoch = self._share.begin_epoch(self._ledger)
        _BaseDataLoaderIter._reset(self, loader, first_iter)
        if self._stager is not None:
            self._stager.reset()  # a staged batch's slot cools behind its copy event
        self._refill_error: Exception | None = None
        self._ended = False
        self._last_delivery = None
        if not first_iter:
            self._epoch_started = time.perf_counter()
            self._reclaim_all()
            self._epoch += 1
        self._send_idx = 0
        self._rcvd_idx = 0
        # (reorder-buffer index, slot) of the batch _process_data delivers, until settled
        self._delivering: tuple[int, int] | None = None
        self._task_info = {}
        self._tasks_outstanding = 0
        self._workers_status = [True] * self._num_workers
        self._workers_num_tasks = [0] * self._num_workers
        self._worker_queue_idx_cycle = itertools.cycle(range(self._num_workers))
        # (send index, workers the round robin gave its draw): kept across an interrupt
        self._picking: tuple[int, list[int]] = (-1, [])
        self._sampler_exhausted = False
        self._puts_owed = 0  # _try_put_index calls not yet drawn (their draw raised)
        self._held: collections.deque = collections.deque()  # (index, worker, seed) not sent
        # after _reclaim_all; a loaded state moves the sampler, the counters and the round robin
        resumed = self._resume.position_epoch(self._sampler_iter, first_iter)
        if resumed is not None:
            self._sampler_iter = resumed.sampler_iter
            self._num_yielded = resumed.yielded
            self._IterableDataset_len_called = resumed.len_called
            for _ in range(resumed.round_robin_done):
                next(self._worker_queue_idx_cycle)
        for _ in range(self._prefetch_factor * self._num_workers):
            self._try_put_index()

    def _reclaim_all(self) -> None:
        """Take back every slot of the previous epoch (persistent workers)."""
        ledger = self._ledger
        self._settle_delivery()
        ledger.settle()
        if ledger.moving is not None:
            self._settle_move()
        self._resume.settle_handing()  # a staged batch's reply came before these
        told = []  # what the resume state learned: a share_batches group's followers too
        for info in self._task_info.values():  # taken, never delivered: their workers moved on
            if len(info) == 2:
                told.append(self._resume.seen(info[0], fmt.reply_seq(ledger.header(info[1])),
                                              self._reply_record(info[1])))
        self._task_info = {}
        ledger.reset_free()  # the undelivered replies' slots, for the held requests
        # the held requests go too, as many at once as the cap lets (the requests still
        # out count): DataLoader's workers fetch every request drawn before the next
        # epoch, and their RNG states move with it. Popped replies (ledger.returned)
        # first, then the workers'
        while ledger.inflight or self._held:
            self._send_held()
            if not ledger.inflight:
                continue  # the held ones left were for workers that ended
            slot, _worker = self._wait_returned()
            seq, worker = ledger.inflight[slot]
            if fmt.reply_status(ledger.header(slot), slot, seq, worker) == fmt.ST_GROW:
                self._grow_and_resend(slot)
                continue
            told.append(self._resume.seen(worker, seq, self._reply_record(slot)))
            del ledger.inflight[slot]
            ledger.returned.popleft()
            self._task_info.pop(seq, None)
            ledger.give_back(slot)
        ledger.reset_free()
        told = [t for t in told if t is not None]
        if self._share is not None and told:
            self._share.tell_seen(self._share_epoch, told)

    def _dead_message(self) -> str:
        what = f" ({self._fatal})" if self._fatal else " (or by interpreter exit)"
        return (f"this PoolLoader iterator was shut down by the error raised before{what}; "
                "its workers are gone. "
                "Iterate a new PoolLoader (with persistent_workers=True the loader keeps "
                "this iterator, so build the loader again), or fix the error above.")

    # -- resume: poolloader.resume.keys ---------------------------------------------
    def _next_index(self):
        # the send index it will go with: the requests held before it go first
        return self._resume.next_index(self._sampler_iter, self._send_idx + len(self._held))

    def _entering(self) -> tuple[float, float]:  # TrackedNext
        return time.perf_counter(), self._stats.main_wait_s

    def _delivered(self, mark: tuple[float, float]) -> None:  # TrackedNext
        self._last_delivery = self._stats.count_delivery(*mark, self._last_delivery,
                                                         self._epoch_started)

    def _reply_record(self, slot: int, header=None) -> bytes | None:
        """The resume record a returned slot carries (copied out); `header`: the slot's,
        if the caller has it."""
        ledger = self._ledger
        if header is None:
            header = ledger.header(slot)
        try:
            return fmt.reply_state(ledger.mapping(slot), header) or None
        except SlotCorrupt as e:
            self._fail(e)
            raise

    # -- waiting -------------------------------------------------------------------
    def _wait_returned(self) -> tuple[int, int]:
        """(slot, worker) of the oldest reply popped and not yet handled
        (ledger.returned[0], where it stays until its handler takes it off), after
        blocking, if there is none, until some worker returns a slot (supervise.Replies:
        bounded by `timeout=` and worker liveness). A dead worker, a corrupt control
        block or a slot main did not give stops everything before the error reaches
        the caller."""
        try:
            slot, worker = self._replies.wait()
        except (ControlCorrupt, WorkerDied) as e:
            self._fail(e)
            raise
        if self._unheard:
            self._heard(worker)
        expected = self._ledger.inflight.get(slot)
        if expected is None or expected[1] != worker:
            error = SlotCorrupt(f"worker {worker} returned slot {slot}, which main did not give it")
            self._fail(error)
            raise error
        self._pool.unlink_mapped()
        return slot, worker

    def _heard(self, worker: int) -> None:
        """A worker replied, so it loaded its start arguments, as has any worker that
        marked them loaded (WORKER_LOADED: a node pool's process loads every logical
        worker's at once, before any has a request): once all have, main's copy of them
        is released (poolloader.main.startup)."""
        self._unheard.discard(worker)
        control = self._pool.control
        if self._unheard and control is not None:
            loaded = control.worker_stats[:, WORKER_LOADED]
            self._unheard = {w for w in self._unheard if not loaded[w]}
        if not self._unheard and self._shared_start is not None:
            self._shared_start.close()
            self._shared_start = None

    # -- delivery -------------------------------------------------------------------
    def _next_data(self):
        if self._stager is None:
            return self._next_host()
        return self._stager.next(self._next_host)  # pinning, or device= one batch ahead

    def _refill(self, keep_error: bool = False) -> None:
        """Send the request a delivered batch owes (DataLoader's _try_put_index after
        each batch): _settle_delivery counted it owed, so an interrupt before it is
        sent leaves it to the next call, never one request short for the epoch."""
        try:
            self._send_owed()
        except Exception as error:
            if not keep_error:
                raise
            self._refill_error = error

    def _next_host(self):
        if self._refill_error is not None:  # first: it may be what shut the iterator down
            error, self._refill_error = self._refill_error, None
            try:
                raise error
            finally:
                # no cycle through this frame: the error's traceback reaches the frame
                # that decoded the previous batch, which must die with the caller's copy
                del error
        if self._shutdown:
            if self._ended:
                raise StopIteration
            raise RuntimeError(self._dead_message())
        ledger = self._ledger
        # an interrupted call's delivery and replies are settled before any slot is reused
        # (each is a no-op without its condition: checked here, no call per batch)
        if self._delivering is not None:
            self._settle_delivery()
        if ledger.returned:
            ledger.settle()
        if ledger.moving is not None:
            self._settle_move()
        waited = self._stats.main_wait_s
        self._recent_wait = max(waited - self._wait_mark, self._recent_wait / 2)
        self._wait_mark = waited
        if ledger.newest is not None:
            # now, not at the refill after the wait: the batch the consumer dropped since
            # the last call freed a slot, and the newest request's worker may start on
            # it any moment
            self._move_newest()
        if self._stats.iter_s >= self._review_at and not self._sampler_exhausted:
            self._review_processes()  # node_workers="auto": may restart the workers
            ledger = self._ledger
        if self._puts_owed or self._held:  # requests an earlier call could not send go first
            self._send_owed()
        while True:
            while self._rcvd_idx < self._send_idx:
                info = self._task_info.get(self._rcvd_idx, None)
                if info:
                    worker_id = info[0]
                    if len(info) == 2 or self._workers_status[worker_id]:
                        break
                    del self._task_info[self._rcvd_idx]
                self._rcvd_idx += 1
            else:
                if self._puts_owed or self._held:  # past the cap (or failed): now
                    self._send_owed()
                    if self._rcvd_idx < self._send_idx:
                        continue
                if self._share is not None:
                    self._share.end_epoch(self._share_epoch)
                if not self._persistent_workers:
                    self._ended = True
                    self._shutdown_workers()
                raise StopIteration

            if len(self._task_info[self._rcvd_idx]) == 2:
                # READY: it leaves the reorder buffer once its decode holds the slot
                return self._process_data(self._rcvd_idx)

            # Handling a popped reply (ledger.returned[0]): every step before the slot
            # leaves `inflight` can be redone by the next call after an interrupt;
            # after it, ledger.settle() drops the handled entry.
            slot, worker = self._wait_returned()
            idx, worker = ledger.inflight[slot]
            try:
                status = fmt.reply_status(ledger.header(slot), slot, idx, worker)
            except SlotCorrupt as e:
                self._fail(e)
                raise
            if status == fmt.ST_GROW:
                self._grow_and_resend(slot)
                continue
            if status == fmt.ST_END:
                self._resume.seen(worker, idx, self._reply_record(slot))
                del ledger.inflight[slot]
                self._tasks_outstanding -= 1
                ledger.give_back(slot)  # ledger.settle() drops the reply if an interrupt
                ledger.returned.popleft()  # comes between these two
                if self._workers_status[worker]:
                    self._workers_status[worker] = False
                    self._try_put_index()
                continue
            if idx not in self._task_info:
                # its worker ended before this task (iterable): nothing to deliver
                del ledger.inflight[slot]
                self._tasks_outstanding -= 1
                ledger.give_back(slot)  # ledger.settle() drops the reply if an interrupt
                ledger.returned.popleft()  # comes between these two
                continue
            self._task_info[idx] = (worker, slot)  # READY: in the reorder buffer
            del ledger.inflight[slot]
            self._tasks_outstanding -= 1
            ledger.returned.popleft()
            if idx != self._rcvd_idx and not self._in_order:
                return self._process_data(idx)
            # in order: delivered at the top of the loop once it is the next one

    # torch's name, another signature: only this class's _next_host calls it
    def _process_data(self, idx: int):  # type: ignore[override]
        """Deliver batch `idx`, READY in the reorder buffer. Its entry stays there until
        the decode's lease holds the slot (_settle_delivery), and every step before the
        decode may run twice: an interrupt (KeyboardInterrupt, or any exception a signal
        handler raises) before the decode leaves the batch to the next call, which
        delivers it; one after it loses that batch, as DataLoader's next() would, and
        the lease's death gives its slot back."""
        worker, slot = self._task_info[idx]
        self._delivering = (idx, slot)
        ledger = self._ledger
        header = ledger.header(slot)
        error = fmt.reply_is_error(header)
        # before the decode, which may hand the slot back at once
        self._resume.received(worker, fmt.reply_seq(header), self._reply_record(slot, header),
                              error)
        if self._share is not None:
            try:  # the followers' holds are counted before the decode's lease can die
                self._share.publish(self._share_epoch, self._pool, slot,
                                    self._sent_indices.get(slot), idx)
            except BaseException as e:
                self._fail(e)
                raise
        try:  # renewed again, harmlessly, if the next call delivers it after all
            view = ledger.fresh_view(slot, header)  # share_batches: this rank's own
        except BaseException:
            self._settle_delivery()  # not decoded: still READY, the next call's
            raise
        try:
            # from the lease's registration inside decode, the slot is the lease's:
            # whatever happens next, its death gives the slot back
            payload, _lease = codec.decode(view, header, ledger.leases,
                                         ledger.on_release, slot,
                                         small_buffer=self._small_buffer)
            del _lease, view
        except BaseException:
            self._settle_delivery()
            self._refill()
            raise
        self._settle_delivery()
        # an error while refilling (the sampler, a request that cannot be pickled) must
        # not take this batch with it: it is raised by the next call instead
        self._refill(keep_error=True)
        self._stats.batches += 1
        if error:
            if not isinstance(payload, ExceptionWrapper):
                raise SlotCorrupt(f"slot {slot} reports an error but carries {type(payload).__name__}")
            payload.reraise()
        return payload

    def _settle_delivery(self) -> None:
        """The end of _process_data, also for a call an interrupt cut short: once the
        decode's lease holds the slot (it is in `ledger.leases` until a take() drains
        it, so this runs before any), the batch leaves the reorder buffer; before, it
        stays there and the next call delivers it. The lease, if any, is the newest
        (no other decode came since, and a slot has one lease at a time): O(1)."""
        delivering = self._delivering
        if delivering is None:
            return
        idx, slot = delivering
        leases = self._ledger.leases
        if not leases or next(reversed(leases.values())) != slot:
            self._delivering = None  # not decoded: still READY, delivered again
            return
        # no call from here on: no interrupt comes between these steps
        worker = self._task_info[idx][0]
        self._delivering = None
        del self._task_info[idx]
        if idx == self._rcvd_idx:
            self._rcvd_idx = idx + 1
        self._workers_num_tasks[worker] -= 1
        self._puts_owed += 1  # its refill (_refill), as DataLoader's _try_put_index

    # -- node_workers="auto" within an epoch (poolloader.main.autotune) ------------------
    def _restarts_exactly(self, loader) -> bool:
        """Whether this iterator may restart in place with another process count at a
        batch boundary, every batch still DataLoader's: it resumes from its own state
        (a stateful loader), O(num_workers) main-side work for a map-style dataset (an
        IterableDataset without state_dict() would replay its epoch; a datapipe's
        restart would draw its shared seed again, collectively under torch.distributed),
        no batch taken ahead of the caller (a device=/pin_memory stager holds one the
        state does not count yet), no other rank reading this pool (share_batches)."""
        return (loader.auto_workers() is not None and loader.stateful
                and self._share is None and self._stager is None
                and self._dataset_kind == _DatasetKind.Map
                and not isinstance(self._dataset, (IterDataPipe, MapDataPipe)))

    def _moves_in_epoch(self, loader) -> bool:
        """Whether the count may move within an epoch (_restarts_exactly): not under
        node_pool, whose processes every rank's iterator would have to leave at once."""
        return self._node is None and self._restarts_exactly(loader)

    def _follow_node(self, loader) -> bool:
        """node_pool, persistent workers, node_workers="auto", as a new epoch begins:
        the count for it (the host decides and moves the node's processes; another rank
        reads the host's), and where the node's processes are no longer the ones this
        iterator attached to, a restart in place onto them, from this iterator's own
        state at the end of the last epoch (as a move within an epoch restarts). True
        where that restart began the new epoch itself (_move_processes)."""
        count = loader.epoch_processes()
        return (self._node.gen is not self._node_gen
                and self._move_processes(loader, count, between_epochs=True))

    def _review_processes(self) -> None:
        """A window of steady delivery has passed: the rule (autotune.AutoWorkers.review)
        reads it, and a move restarts the workers here."""
        loader = self._loader_ref()
        auto = None if loader is None else loader.auto_workers()
        if auto is None:  # the loader is gone, or "auto" was taken back
            self._review_at = math.inf
            return
        to = auto.review(self._stats, self._epoch)
        if to is None:
            self._review_at = auto.review_at(self._stats)
            return
        self._move_processes(loader, to)

    def _move_processes(self, loader, processes: int, between_epochs: bool = False) -> bool:
        """Restart this iterator in place with `processes` worker processes, from its own
        resume state: the workers stop, and new ones start with each logical worker's
        state after its last delivered batch; the requests in flight are drawn again
        and fetched by them (as after load_state_dict()), so no batch is lost, repeated
        or changed. Main's RNG is left as it was (the restart draws a base seed, which
        the state replaces, as loader._get_iterator does for a resumed epoch). A batch
        the caller holds keeps its slot (its lease outlives the old pool's close).

        `between_epochs` (_follow_node, as a persistent iterator's next epoch begins):
        where the last epoch ran to its end, the restart begins the next one, as a
        loader loaded from a state saved then does (each worker where its last reply
        left it), and main's RNG goes on from the draws the new epoch makes (its
        sampler's), not from the base seed the restart draws. Returns True then."""
        began = time.perf_counter()
        plan = ResumePlan(self._resume.state_dict(), loader)
        begins = between_epochs and plan.finished
        epoch = self._epoch  # persistent workers: the epochs this iterator has run
        caller_rng = torch.get_rng_state()
        self._shutdown_workers()
        loader.auto_workers().workers_stopped(self._stats.last_memory)
        try:
            with warnings.catch_warnings():
                # what the first start warned of (pin_memory without an accelerator)
                # was said then; a restart says it again on every move
                warnings.simplefilter("ignore")
                PoolLoaderIter.__init__(self, loader, plan, processes,
                                        main_rng=caller_rng if begins else None)
        finally:
            if not begins:
                torch.set_rng_state(caller_rng)
        self._epoch = epoch + 1 if begins else epoch
        # the move's start-up counts from its start (stats.startup_s: autotune's window
        # grows with what a restart costs)
        self._epoch_started = began
        loader.iterator_restarted(self)
        return begins

    # -- teardown ---------------------------------------------------------------------
    def _fail(self, error: BaseException) -> None:
        self._fatal = f"{type(error).__name__}: {error}"
        if self._share is not None:
            self._share.fail(self._share_epoch, self._fatal)
        self._shutdown_workers()
