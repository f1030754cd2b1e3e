"""PoolLoader: torch.utils.data.DataLoader with batches moved through a slot pool."""
from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch.utils.data import DataLoader

from poolloader.errors import warn
from poolloader.main.stats import LoaderStats
from poolloader.shm import backends

T_co = TypeVar("T_co", covariant=True)

# The extension point for a library that rebuilds a PoolLoader as a plain DataLoader:
# HF Accelerate reads `_is_accelerate_prepared` of every loader given to
# Accelerator.prepare() and then does. Each callable here is called with the loader when
# that attribute is read; poolloader.adopt.rebuilds adds the warning that the pool is lost
# (and how to keep it). A list, not an import: adopt/ is above this module.
on_plain_rebuild: list[Callable[[DataLoader], None]] = []

DEFAULT_SLOT_BYTES = 1 << 20
# Seconds next() waits for a batch before it warns with a stall report (stall_warning=).
DEFAULT_STALL_WARNING_S = 300.0


class PoolLoader(DataLoader[T_co]):
    """A drop-in `DataLoader`. With `num_workers=0` it is DataLoader (its own
    single-process iterator, counted for `state_dict()`).

    With workers, each batch is written by a worker into a preallocated,
    reused shared-memory slot and the main process receives only the slot's
    index; the tensors you get are views over the slot, and the slot is reused
    once every view of the batch is gone.

    Pool options (keyword-only, beyond DataLoader's):
      slot_bytes  initial size of each slot (default 1 MiB); a batch that does
                  not fit grows its slot (×1.25 headroom) and the rest follow.
      slots       slots in the pool (default num_workers × prefetch_factor + 2;
                  with node_pool and in_order, the rank's share of the node's
                  requests + 2).
      max_slots   optional cap on the slots in the pool (default: slots, grown
                  to num_workers × prefetch_factor + 2 if smaller, plus as many
                  again on CUDA for slots cooling behind copies). At the cap a
                  request waits (bounded) for a cooling slot, or detaches the
                  oldest batch the consumer holds: it never fails.
      shm_limit   cap in bytes on the pool's shared memory (also the
                  POOLLOADER_SHM_LIMIT environment variable); None: the memory
                  available to the process (or /dev/shm's free space, for
                  shm_backend="posix") is the only limit.
      shm_backend where the slots live: "memfd" (default where it works: anonymous
                  shared memory outside /dev/shm, so a container's 64 MiB
                  /dev/shm does not limit it, and nothing is named: a crash
                  leaves nothing behind) or "posix" (named segments in /dev/shm).
                  Also the POOLLOADER_SHM_BACKEND environment variable.
      device      e.g. "cuda": the loader copies each batch to this device itself,
                  on a side stream one batch ahead, from the page-locked slots,
                  and yields device tensors safe to use on the current stream.
      stall_warning  seconds (default 300) a single wait for a batch may last before
                  a StallWarning names every worker that owes a batch: its pid,
                  the sample indices of the batch it is on, for how long, and its
                  Python stack; the loader goes on waiting, and warns again at the
                  next stall. None: never. With timeout=N, the RuntimeError
                  "DataLoader timed out after N seconds" carries the same report on
                  the lines after that first one.
      stateful    True (default): every batch carries its worker's resume record
                  (random state and fetch count: ~40 µs in the worker and ~10 KB
                  main copies; the dataset's state_dict() on snapshot batches),
                  so `state_dict()` is exact at any step. False: nothing is
                  captured (DataLoader's cost) and `state_dict()` returns {} (a
                  warning says so): an epoch restarts, as with DataLoader.
      snapshot_every_n_steps  StatefulDataLoader's option: a worker's dataset
                  (and IterableDataset iterator) state_dict() rides with the
                  batches of the num_workers steps before each multiple of it;
                  `state_dict()` holds each worker's last snapshot and the
                  indices it fetched since, which a resume replays (fetch and
                  drop: up to about n / num_workers batches per worker, in
                  parallel), so resume stays exact. None (default): 1, every
                  batch (no replay), or 256 when the dataset is a
                  torch.nn.Module, whose state_dict() is its parameters and
                  buffers. A record over 1 MiB warns once.
      node_workers  None (default; num_workers is the same): one process per
                  worker, as DataLoader. P (1 to num_workers): P processes
                  host the num_workers logical workers (worker i in process
                  i % P), and the batches are still
                  bit-identical to DataLoader(num_workers=...)'s: each logical
                  worker keeps its own seed and RNG states, get_worker_info(),
                  copy of the dataset (what worker_init_fn made of it), iterator
                  and resume state; a process serves its logical workers in turn.
                  Fewer processes, so at most P batches are produced at once.
                  Under fork the dataset is deep-copied once per extra logical
                  worker in its process (an error says so if it cannot be).
                  `worker_pids` lists the P processes. With node_pool, the
                  node's processes (1 to num_workers × local ranks).
                  "auto": P is chosen again before each epoch from what the last
                  one measured (main's wait, the workers' busy time), and within
                  an epoch every 2 s of steady delivery (the workers restart at a
                  batch boundary from the iterator's own resume state), within the
                  CPUs and half the memory available (poolloader.main.autotune;
                  `stats.auto_moves` lists each choice). Within an epoch only for
                  a stateful map-style dataset without device= staging or
                  share_batches. With node_pool, between the epochs of the rank
                  that hosts the node only (it decides for every local rank; a
                  persistent iterator restarts onto the new processes as its next
                  epoch begins, where such a restart is exact).
      node_pool   True: under torchrun with 2 or more local ranks, the loaders of
                  the local ranks (built in the same order, with the same dataset,
                  collate_fn, batch_size, drop_last, num_workers, node_workers)
                  share one set of node_workers processes (default num_workers),
                  hosted by local rank 0; each rank keeps its own sampler, order,
                  pool, resume state, and gets bit for bit its own DataLoader's
                  batches (docs/node.md). Without torchrun, the node is found
                  through an initialised torch.distributed (mp.spawn: every rank
                  must build the loader). Neither, or one rank on the node: an
                  ordinary loader. None (default): the POOLLOADER_NODE_POOL
                  environment variable (1 or 0; unset: False).
      share_batches  a list of global ranks (or a torch.distributed ProcessGroup)
                  whose loaders consume identical batches (same dataset and
                  sampler, seed and arguments: a tensor- or context-parallel
                  group). Under torchrun, each batch is made once per node, by
                  the group's lowest rank there (its workers, or its node
                  pool's), and the group's other ranks on the node map the same
                  slot: same pages, no copy, no worker of their own. Each rank
                  still draws its own sampler and checks it against the batch
                  (samplers that disagree: an error at the first batch that
                  differs). Needs a map-style dataset, in_order=True and memfd;
                  on CUDA each rank registers its own mapping of the slots,
                  and a slot is reused only after every rank's copies from it
                  finished (docs/node.md). Each rank resumes from its own
                  state_dict(); a follower's is tracked from the leader's
                  slots. A rank not in the list, or alone in it on its node,
                  loads as usual.
      zygote      under spawn and forkserver, workers are forked by a start-up
                  process of this process (one per start method, reused by every
                  loader and epoch) that imported torch, numpy and the modules of
                  the dataset, collate_fn and worker_init_fn once, instead of each
                  importing them again (seconds per worker). Each worker still gets
                  what the start method promises: nothing of main's memory, main's
                  os.environ, sys.path and working directory as of iter(),
                  __main__ run again as __mp_main__. It is started as the loader is
                  built, so it imports while the program goes on. False: every
                  worker is a fresh interpreter, as DataLoader's. None (default):
                  the POOLLOADER_ZYGOTE environment variable (0 turns it off;
                  unset: on). Under fork nothing changes (docs/differences.md).
    A copy (`copy.deepcopy`, `pickle`) of a node_pool or share_batches loader is an
    ordinary PoolLoader with the same arguments: it joins no node pool or group.
    Nothing is created until the loader is iterated (with node_pool under torchrun,
    local rank 0 starts the node's processes as the loader is built). `stats` holds counters;
    `stats.advice()` reads them: which side is the bottleneck, what to change.

    `state_dict()` / `load_state_dict()` resume mid-epoch, bit-identically,
    random augmentation in workers included, with torchdata StatefulDataLoader's
    layout and keys (Lightning saves and restores it by itself): see
    poolloader.resume.keys.
    """

    def __init__(self, dataset, batch_size=1, shuffle=None, sampler=None, batch_sampler=None,
                 num_workers=0, collate_fn=None, pin_memory=False, drop_last=False, timeout=0,
                 worker_init_fn=None, multiprocessing_context=None, generator=None, *,
                 prefetch_factor=None, persistent_workers=False, pin_memory_device="",
                 in_order=True, slot_bytes=DEFAULT_SLOT_BYTES, slots=None, max_slots=None,
                 shm_limit=None, device=None, shm_backend=None,
                 stall_warning=DEFAULT_STALL_WARNING_S, stateful=True,
                 snapshot_every_n_steps=None, node_workers=None, node_pool=None,
                 share_batches=None, zygote=None):
        self.node_workers = node_workers  # DataLoader's __init__ runs the rationality check
        super().__init__(
            dataset, batch_size=batch_size, shuffle=shuffle, sampler=sampler,
            batch_sampler=batch_sampler, num_workers=num_workers, collate_fn=collate_fn,
            pin_memory=pin_memory, drop_last=drop_last, timeout=timeout,
            worker_init_fn=worker_init_fn, multiprocessing_context=multiprocessing_context,
            generator=generator, prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers, pin_memory_device=pin_memory_device,
            in_order=in_order)
        if slot_bytes is None or slot_bytes < 1:
            raise ValueError(f"slot_bytes must be a positive number of bytes, got {slot_bytes!r}")
        if slots is not None and (not isinstance(slots, int) or slots < 1):
            raise ValueError(f"slots must be a positive number of slots, got {slots!r}")
        if shm_limit is not None and (not isinstance(shm_limit, int) or shm_limit < 1):
            raise ValueError(f"shm_limit must be a positive number of bytes, got {shm_limit!r}")
        if stall_warning is not None and (isinstance(stall_warning, bool)
                                          or not isinstance(stall_warning, (int, float))
                                          or not stall_warning > 0):
            raise ValueError(f"stall_warning must be a positive number of seconds or None, "
                             f"got {stall_warning!r}")
        in_flight = self.num_workers * (self.prefetch_factor or 0)
        if max_slots is not None and (not isinstance(max_slots, int)
                                      or max_slots < max(1, in_flight)):
            raise ValueError(
                f"max_slots={max_slots!r} is below the {self.num_workers} × "
                f"{self.prefetch_factor} requests DataLoader keeps in flight (num_workers × "
                "prefetch_factor); raise it, or leave it None")
        if not isinstance(stateful, bool):
            raise ValueError(f"stateful must be True or False, got {stateful!r}")
        if zygote is not None and not isinstance(zygote, bool):
            raise ValueError(f"zygote must be True, False or None (the POOLLOADER_ZYGOTE "
                             f"environment variable), got {zygote!r}")
        if snapshot_every_n_steps is not None and (
                isinstance(snapshot_every_n_steps, bool) or not isinstance(snapshot_every_n_steps, int)
                or snapshot_every_n_steps < 1):
            raise ValueError(f"snapshot_every_n_steps must be a positive number of steps or None, "
                             f"got {snapshot_every_n_steps!r}")
        from poolloader.main import node, rendezvous
        group = rendezvous.local_group() if node.wanted(node_pool) and self.num_workers else None
        # the node's processes host every local rank's num_workers logical workers
        most = self.num_workers * (group[1] if group else 1)
        from poolloader.main import autotune
        # "auto" with num_workers=0: no worker process to count, as None (a runner's
        # option reaches loaders a framework rebuilds without workers too)
        auto = node_workers == autotune.AUTO
        if node_workers is not None and not auto and (isinstance(node_workers, bool)
                                                      or not isinstance(node_workers, int)
                                                      or not 1 <= node_workers <= most):
            raise ValueError(
                f"node_workers={node_workers!r}: the number of processes hosting the "
                f"num_workers={self.num_workers} workers"
                + (f" of each of the {group[1]} local ranks" if group else "")
                + f" must be an int from 1 to {most}, "
                + f"{autotune.AUTO!r} (chosen as it runs), "
                + "or None (one process per worker)"
                + ("; with num_workers=0 no worker process runs at all: leave node_workers "
                   "None" if self.num_workers == 0 else ""))
        # node_workers="auto": the process count of each epoch, made by the first
        # iterator (epoch_processes; poolloader.main.autotune)
        self._auto = None
        if shm_backend is not None and shm_backend not in backends.kinds():
            raise ValueError(f"shm_backend must be one of {backends.kinds()}, got {shm_backend!r}")
        self.node_workers = node_workers
        self.shuffle = shuffle
        self.stateful = stateful
        self.snapshot_every_n_steps = snapshot_every_n_steps
        # the pool: its slots' size and count, and where and how much shared memory
        self.slot_bytes, self.slots, self.max_slots = slot_bytes, slots, max_slots
        self.shm_limit, self.shm_backend = shm_limit, shm_backend
        self.device = device
        self.stall_warning = stall_warning
        self.node_pool = node_pool
        self.zygote = zygote
        self.stats = LoaderStats()
        self._node = None  # poolloader.main.node: this loader's node pool, if it has one
        if group is not None:
            ctx = self.multiprocessing_context or torch.multiprocessing
            self._node = node.join(self, ctx, node_workers or self.num_workers, group)
        from poolloader.main import share
        self.share_batches = share_batches
        # poolloader.main.share: this rank's side of its group (None: it shares nothing)
        self._share = share.join(self, share_batches)
        self._resume_plan = None     # a loaded state for the next iterator
        self._resume_tracker = None  # the latest iterator's progress (state_dict())
        self._warned_stateless = False
        if self.num_workers and self._node is None:
            from poolloader.main import startup
            startup.warm(self.multiprocessing_context or torch.multiprocessing, zygote,
                         self.dataset, self.collate_fn, self.worker_init_fn)

    def _get_iterator(self):
        if self.num_workers == 0:
            from poolloader.resume.single import SingleProcessIter
            it = SingleProcessIter(self, self._take_resume_plan())
            self._resume_tracker = it
            return it
        from poolloader.main.follower_iter import FollowerIter
        from poolloader.main.iterator import PoolLoaderIter
        from poolloader.resume.tracker import continues_epoch
        follower = getattr(self._share, "role", None) == "follower"
        if not follower:
            self.check_worker_number_rationality()
        # An iterator draws its base seed from the global RNG; one that continues a
        # saved epoch must not: that draw was made when the epoch began.
        caller_rng = torch.get_rng_state() if continues_epoch(self._resume_plan) else None
        try:
            if follower:
                it = FollowerIter(self, self._share, self._take_resume_plan())
            else:
                it = PoolLoaderIter(self, self._take_resume_plan())
        finally:
            if caller_rng is not None:
                torch.set_rng_state(caller_rng)
        self._resume_tracker = it.resume_tracker  # plain data: keeps no worker alive
        return it

    def epoch_processes(self) -> int:
        """The worker processes of the iterator being built: node_workers, num_workers
        (None), or node_workers="auto"'s count for this epoch (poolloader.main.autotune).
        Called once per iterator, by its __init__."""
        from poolloader.main import autotune
        processes = self.node_workers
        node = self._node
        if processes == autotune.AUTO:
            if self._auto is None:  # the first iterator (or "auto" set after __init__)
                self._auto = autotune.AutoWorkers(
                    self.num_workers, node.local_world if node is not None else 1)
                # each epoch's workers' memory, read as they stop: USS per process
                self.stats.memory_at_shutdown = True
            if node is not None and node.host_rank != node.local_rank:
                # node_pool: the rank that hosts the node chooses; this one follows
                return self._auto.follow(self.stats, node.refresh(), node.host_rank)
            if node is not None and self._auto.current:
                # from the second epoch on, the ranks sharing the node now (a lone host's:
                # 1); the first counts every local rank, as the node was started for them
                # (a rank that builds late must not find it cut down to one rank's)
                self._auto.ranks = node.sharing_ranks()
            self._auto.workers_stopped(self.stats.last_memory)
            count = self._auto.processes(self.stats)
            if node is not None:  # the node's processes from this epoch on
                failed = node.resize(count)
                if failed is not None:  # the current ones go on serving
                    count = self._auto.kept(self.stats, len(node.pids),
                                            f"the new processes did not start: {failed}")
            return count
        if isinstance(processes, int) and not isinstance(processes, bool) and processes >= 1:
            return processes
        return self.num_workers

    def auto_workers(self):
        """node_workers="auto"'s rule (poolloader.main.autotune.AutoWorkers), made by the
        first iterator; None before, and without "auto". Its iterators review the count
        within an epoch through it."""
        return self._auto

    def iterator_restarted(self, it) -> None:
        """`it` (this loader's iterator) restarted in place with another process count
        (an auto move within the epoch): state_dict() reads its new progress."""
        self._resume_tracker = it.resume_tracker

    # -- mid-epoch resume (poolloader.resume.keys) -------------------------------------
    def check_worker_number_rationality(self) -> None:
        """DataLoader's warning when more worker processes run than CPUs are allowed,
        counting processes: with node_workers=P, P processes host the num_workers logical
        workers. torch's check reads self.num_workers (its message, cpuset rule and CPU
        count differ between torch versions), so it runs with the process count there."""
        processes = self.node_workers
        if processes == "auto":  # autotune.AUTO: never more processes than the CPUs
            from poolloader.main import autotune
            processes = min(self.num_workers, autotune.cpu_budget())
        if not isinstance(processes, int) or isinstance(processes, bool) or processes < 1:
            processes = self.num_workers  # None, or refused once __init__ checks it
        if processes == self.num_workers:
            super().check_worker_number_rationality()
            return
        logical = self.num_workers
        self.num_workers = processes
        try:
            super().check_worker_number_rationality()
        finally:
            self.num_workers = logical

    def state_dict(self) -> dict:
        """Where this loader stands in its epoch, to continue exactly there later.

        Same layout and keys as torchdata's StatefulDataLoader, plus each worker's
        random state: a new loader (same arguments, any process) given it by
        `load_state_dict()` yields the batches not yet delivered, bit-identical to
        an uninterrupted run. Plain Python and CPU tensors (`torch.save`,
        `torch.load(weights_only=True)`). Costs O(num_workers); never waits for a
        worker. `{}` before the first iteration, and with `stateful=False` (no
        worker captured anything to resume from).
        """
        if self._resume_plan is not None:  # loaded, not iterated yet
            return self._resume_plan if self.num_workers == 0 else self._resume_plan.state
        if self._resume_tracker is None:
            return {}
        if not self.stateful and self.num_workers > 0:
            if not self._warned_stateless:
                self._warned_stateless = True
                warn(
                    "PoolLoader(stateful=False): the workers capture no resume state, so "
                    "state_dict() returns {} and a resumed run starts the epoch again (as "
                    "DataLoader). Pass stateful=True to resume mid-epoch exactly.")
            return {}
        return self._resume_tracker.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Continue from `state_dict` (from `state_dict()`) at the next iteration.

        Checked now: a state from a loader with another `num_workers` is refused
        (a worker's state belongs to that worker). `{}` does nothing. A running
        persistent iterator is shut down first.
        """
        from poolloader.resume.single import check_single_process_state
        from poolloader.resume.tracker import ResumePlan
        if not state_dict:
            plan = None
        elif self.num_workers == 0:
            plan = check_single_process_state(state_dict)
        else:
            plan = ResumePlan(state_dict, self)  # type: ignore[assignment]
        if self._iterator is not None:
            self._iterator._shutdown_workers()  # type: ignore[attr-defined]
            self._iterator = None
        self._resume_tracker = None
        self._resume_plan = plan

    def _take_resume_plan(self):
        plan, self._resume_plan = self._resume_plan, None
        return plan

    def __getstate__(self) -> dict:
        """`copy.deepcopy` and `pickle` give an ordinary PoolLoader with the same
        arguments: the copy has no link to this loader's node pool or share_batches
        group (sockets and processes of this process, which no copy can own). Its
        `node_pool` and `share_batches` keep their values, so a framework that builds a
        new loader from the arguments (Lightning) joins as this one did."""
        state = self.__dict__.copy()
        state["_node"] = None
        state["_share"] = None
        return state

    # HF Accelerate reads this attribute of every loader given to Accelerator.prepare()
    # and then rebuilds the loader as a plain DataLoader: the hooks of on_plain_rebuild
    # say (once) that the pool is lost and how to keep it (poolloader.adopt.rebuilds;
    # poolloader.accelerate.prepare() keeps it and stays quiet).
    @property
    def _is_accelerate_prepared(self) -> bool:
        for hook in on_plain_rebuild:
            hook(self)
        return self.__dict__.get("_accelerate_prepared", False)

    @_is_accelerate_prepared.setter
    def _is_accelerate_prepared(self, value: bool) -> None:
        self.__dict__["_accelerate_prepared"] = value
