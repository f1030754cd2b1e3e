"""A share_batches follower's CUDA side (poolloader.main.share_cuda), on its own: the
CPU stand-in of the CUDA runtime (tests/cuda_standin.py) under a real SlotGate, over
real memfd mappings. The two-rank runs are in test_share_batches.py."""
import os

import torch
from cuda_standin import SimCuda

from poolloader.cuda.gate import SlotGate
from poolloader.main.share_cuda import FollowerCuda
from poolloader.shm._shm import Mapping

SIZE = 3 * 4096 + 512  # not a whole number of pages


def _mapping(size=SIZE) -> Mapping:
    fd = os.memfd_create("pltest-share-cuda")
    try:
        os.ftruncate(fd, size)
        return Mapping(fd, size, True)
    finally:
        os.close(fd)


def _slot_tensor(mapping: Mapping) -> torch.Tensor:
    return torch.frombuffer(memoryview(mapping), dtype=torch.uint8)


def _a_queued_copy(slot: int):
    """(sim, the follower's CUDA side, a registered mapping for `slot`, the side stream,
    the device tensor of a copy from the mapping still queued on that stream)."""
    sim = SimCuda()
    cuda = FollowerCuda(SlotGate(sim), None)
    mapping = _mapping()
    cuda.register(mapping, slot)
    stream = sim.stream(0, "side")
    return sim, cuda, mapping, stream, sim.copy(_slot_tensor(mapping), stream)


def test_each_mapping_is_registered_once_and_unregistered_after_its_copies():
    sim = SimCuda()
    cuda = FollowerCuda(SlotGate(sim), None)
    first, second = _mapping(), _mapping()
    for _ in range(3):  # a batch in it each time: registered the first time only
        cuda.register(first, 0)
    cuda.register(second, 1)
    assert sim.register_calls == 2 and cuda.registrations == 2
    assert set(sim.registered) == {first.address, second.address}
    # a copy queued from `first`, then the link drops the mapping (a new segment came):
    # it stays registered until that copy ran
    stream = sim.stream(0, "side")
    _slot_tensor(first)[:] = 7
    out = sim.copy(_slot_tensor(first), stream)
    cuda.drop(first)
    cuda.drop(first)  # dropped once: the gate is not asked twice
    assert cuda.ready() == [] and first.address in sim.registered
    sim.run(stream)
    assert cuda.ready() == [] and first.address not in sim.registered
    assert bool((out == 7).all()) and sim.violations == []
    # a mapping given again after it was dropped is registered again (a new registration)
    cuda.register(first, 0)
    assert sim.register_calls == 3
    cuda.drop(first)
    cuda.drop(second)
    assert cuda.ready() == [] and sim.registered == {}  # nothing queued: unregistered at once
    assert sim.unregister_calls == 3


def test_a_release_waits_for_the_copies_queued_before_it():
    sim, cuda, mapping, stream, out = _a_queued_copy(2)
    assert cuda.release((1, 2, 0), False) == []  # the batch died, its copy has not run
    assert cuda.release((1, 3, 0), True) == []  # behind the first (release order)
    assert cuda.pending == 2
    for _ in range(3):
        assert cuda.ready() == []  # polled at each next(): still queued
    sim.run(stream)
    assert cuda.ready() == [((1, 2, 0), False), ((1, 3, 0), True)]
    assert cuda.pending == 0 and out.numel() == SIZE
    # no gate (pin_memory off, or no CUDA): straight to the leader
    plain = FollowerCuda(None, None)
    plain.register(mapping, 2)
    assert plain.release((1, 2, 1), False) == [((1, 2, 1), False)] and plain.ready() == []
    cuda.drop(mapping)
    assert cuda.ready() == [] and sim.registered == {}


def test_close_makes_no_cuda_call_and_the_next_gate_finishes_it():
    from poolloader.cuda import gate
    sim, cuda, mapping, _stream, _out = _a_queued_copy(0)
    cuda.release((1, 0, 0), False)
    before = len(sim.calls)
    cuda.close()  # as from a finaliser
    assert sim.calls[before:] == [] and mapping.address in sim.registered
    del mapping
    gate.finish_deferred()  # what this process's next gate does first: waits for the copy
    assert sim.registered == {} and sim.unregister_calls == 1 and sim.violations == []
