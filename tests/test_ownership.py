"""A delivered batch belongs to the user, as a DataLoader batch does (docs/guide.md,
"A delivered batch is yours"): keep it, keep part of it, save it, fork. Each case runs the stock
DataLoader in the same test as the reference, with real workers over real shared
memory."""
from __future__ import annotations

import copy
import copyreg
import gc
import io
import os
import pickle
import select
import signal
import time
import types
import warnings

import loader_datasets as ds
import proc
import pytest
import torch
import torch.multiprocessing as mp
from compare import assert_same
from torch.utils.data import DataLoader, TensorDataset

from poolloader import PoolLoader
from poolloader.shm.backends.posix import NAME_TAG
from poolloader.wire import slot_format as fmt

BOTH = (DataLoader, PoolLoader)


def rfdetr_loader(cls, batches, hw=96, batch_size=16, **kw):
    kw.setdefault("num_workers", 2)
    return cls(ds.RFDETRShaped(n=batches * batch_size, hw=hw), batch_size=batch_size,
               collate_fn=ds.rfdetr_collate, **kw)


def pool_shm_bytes() -> int:
    """Bytes of poolloader segments this process maps now (pool and held batches)."""
    return sum(hi - lo for lo, hi, path in proc.maps() if path.startswith(f"/dev/shm/{NAME_TAG}-"))


def quietly(fn, *args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the detach notice and torch's core count
        return fn(*args, **kw)


# -- keep every batch ----------------------------------------------------------------

@pytest.mark.timeout(120)
def test_list_of_100_rfdetr_batches_equals_dataloader():
    ref = list(rfdetr_loader(DataLoader, 100))
    loader = rfdetr_loader(PoolLoader, 100)
    with pytest.warns(UserWarning, match="detached"):
        got = list(loader)
    assert len(got) == len(ref) == 100
    for i, (a, b) in enumerate(zip(ref, got)):
        assert_same(a, b, f"batch{i}")
    assert loader.stats.detaches > 0  # the held batches left the pool; nothing was exhausted
    del got
    gc.collect()


@pytest.mark.timeout(120)
def test_keeping_small_fields_of_1000_batches_pins_no_slot():
    """An evaluator that keeps labels/boxes: the image of each batch lives in the slot,
    the targets are small and copied out, so keeping them keeps no shared memory."""
    kept = {}
    for cls in BOTH:
        loader = rfdetr_loader(cls, 1000, hw=64, batch_size=2, persistent_workers=True)
        it = iter(loader)
        kept[cls] = [next(it)[2] for _ in range(1000)]
        if cls is PoolLoader:
            held = pool_shm_bytes()  # the pool itself plus anything the kept fields pin
            assert held <= 64 << 20, f"{held} bytes of /dev/shm held for 1,000 batches' targets"
            assert loader.stats.detaches == 0 and loader.stats.pool_growths == 0
        del it, loader
    assert_same(kept[DataLoader], kept[PoolLoader], "targets")


# -- save, copy, share one field -----------------------------------------------------------

def saved_bytes(t: torch.Tensor) -> int:
    buf = io.BytesIO()
    torch.save(t, buf)
    return len(buf.getvalue())


def test_an_in_place_write_into_one_field_leaves_a_field_autograd_saved_alone():
    """A batch's small tensors share one private buffer but, as DataLoader's tensors,
    not a version counter, and none is a view of another: autograd saved one sample's
    labels, and writing other int64 fields, the boxes and the images in place does not
    make backward() fail."""
    for cls in BOTH:
        images, masks, (first, second) = next(iter(rfdetr_loader(cls, 1, hw=64, batch_size=2)))
        saved = second["labels"]
        assert saved.numel() == 5
        if cls is PoolLoader:  # the case: one storage (the batch's small buffer)
            assert saved.untyped_storage().data_ptr() == \
                first["image_id"].untyped_storage().data_ptr()
        w = torch.ones(saved.shape, requires_grad=True)
        loss = (w * saved).sum()  # keeps `saved` for backward
        first["image_id"].add_(1)
        second["iscrowd"].add_(1)
        second["boxes"].mul_(2)
        images.add_(1)
        loss.backward()
        assert torch.equal(w.grad, saved.float()), cls
        fields = [images, masks, *first.values(), *second.values()]
        assert all(t._base is None and not t._is_view() for t in fields), cls


def test_a_tensor_the_batch_holds_twice_arrives_as_one_object():
    """As DataLoader's: images (in the slot) and one target's labels (in the small
    block), each in two places of the batch, arrive as one object each, so autograd
    sees an in-place write through either place."""
    for cls in BOTH:
        loader = cls(ds.RFDETRShaped(n=4, hw=32), batch_size=2, num_workers=1,
                     collate_fn=ds.repeating_collate, multiprocessing_context="fork")
        for batch in loader:
            assert batch["images"] is batch["again"], cls
            assert batch["labels"] is batch["targets"][0]["labels"], cls
        w = torch.ones(batch["labels"].shape, requires_grad=True)
        loss = (w * batch["labels"]).sum()
        batch["targets"][0]["labels"].add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
        del batch, loss


@pytest.mark.parametrize("named_by", ["name", "copyreg extension code"])
def test_a_batch_object_s_reduce_function_computes_with_autograd(named_by):
    """Tensor views are made outside autograd's view tracking only while nothing else is
    built: a batch naming its own reduce function (by its name, or by the code
    copyreg.add_extension gave it) is unpickled with autograd as usual."""
    code = 0x7FFF_FF01
    if named_by != "name":  # before the workers fork: theirs pickle it by the code
        copyreg.add_extension("loader_datasets", "_graph_probe", code)
    try:
        for cls in BOTH:
            loader = cls(ds.RFDETRShaped(n=2, hw=32), batch_size=2, num_workers=1,
                         collate_fn=ds.probed_collate, multiprocessing_context="fork")
            *_, probe = next(iter(loader))
            assert probe.recorded is True, cls
    finally:
        if named_by != "name":
            copyreg.remove_extension("loader_datasets", "_graph_probe", code)


def test_save_deepcopy_and_share_act_on_one_tensor():
    batches = {cls: next(iter(rfdetr_loader(cls, 1, hw=160, batch_size=4))) for cls in BOTH}
    ref, got = batches[DataLoader], batches[PoolLoader]
    label, image = got[2][0]["labels"], got[0]
    assert_same(ref[2][0]["labels"], label)
    # a large field: exactly its own bytes, as DataLoader's
    assert image.untyped_storage().nbytes() == image.nbytes
    assert abs(saved_bytes(image) - saved_bytes(ref[0])) < 1024
    twin = copy.deepcopy(image)
    assert twin.untyped_storage().nbytes() == image.nbytes and torch.equal(twin, ref[0])
    # a small field: at most the batch's small buffer, never the batch
    small_buffer = label.untyped_storage().nbytes()
    assert small_buffer < 16 << 10
    assert saved_bytes(label) <= saved_bytes(ref[2][0]["labels"]) + small_buffer + 1024  # zip padding
    assert copy.deepcopy(label).untyped_storage().nbytes() <= small_buffer
    # share_memory_() moves that tensor alone into shared memory, values intact
    mask = got[1]
    assert mask.nbytes > fmt.SMALL_TENSOR_BYTES
    mask.share_memory_()
    assert mask.is_shared() and mask.untyped_storage().nbytes() == mask.nbytes
    assert torch.equal(mask, ref[1])


def _sum_in_child(queue, out):
    t = queue.get(timeout=30)
    out.put(float(t.double().sum()))


def test_a_field_sent_to_another_process_is_that_tensor():
    ctx = mp.get_context("spawn")
    sums = {}
    for cls in BOTH:
        image = next(iter(rfdetr_loader(cls, 1, batch_size=2)))[0]
        queue, out = ctx.Queue(), ctx.Queue()
        child = ctx.Process(target=_sum_in_child, args=(queue, out))
        child.start()
        try:
            queue.put(image)
            sums[cls] = out.get(timeout=60)
        finally:
            child.join(30)
            if child.is_alive():
                child.kill()
                child.join(5)
        assert sums[cls] == float(image.double().sum())
    assert sums[DataLoader] == sums[PoolLoader]


# -- fork ---------------------------------------------------------------------------------

def _fork_and_check(held, expected, then):
    """Fork a child that reads `held` after `then()` ran in the parent; its verdict."""
    r, w = os.pipe()
    go_r, go_w = os.pipe()  # the parent writes one byte once `then()` ran
    pid = os.fork()
    if pid == 0:  # child: wait until the parent reused what it could, then read
        os.close(r)
        os.close(go_w)
        verdict = b"bad"
        try:
            ready, _, _ = select.select([go_r], [], [], 60)
            if not ready or os.read(go_r, 1) != b"g":
                verdict = b"parent never said go"
                raise RuntimeError(verdict)
            # numpy: torch's thread pool is not usable in a child forked from a threaded parent
            if all((h[0].numpy() == e.numpy()).all() for h, e in zip(held, expected)):
                verdict = b"ok"
        finally:
            os.write(w, verdict)
            os._exit(0)
    os.close(w)
    os.close(go_r)
    try:
        then()
        os.write(go_w, b"g")
        deadline = time.monotonic() + 60
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            assert time.monotonic() < deadline, "forked child did not finish"
            time.sleep(0.01)
        assert os.WIFEXITED(status), f"forked child died: status {status:#x}"
        return os.read(r, 16)
    finally:
        os.close(r)
        os.close(go_w)
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


@pytest.mark.timeout(120)
def test_forked_child_reads_held_batches_while_the_parent_reuses_slots():
    data = TensorDataset(torch.arange(60 * 40_000, dtype=torch.float32).view(60, 40_000))
    for cls in BOTH:
        it = iter(cls(data, batch_size=2, num_workers=2))
        held = [next(it) for _ in range(3)]
        expected = [h[0].clone() for h in held]

        def then(held=held, it=it):
            held.clear()  # the parent drops them and iterates on: their slots come back
            gc.collect()
            for _ in it:
                pass
        assert _fork_and_check(list(held), expected, then) == b"ok", cls.__name__


@pytest.mark.timeout(120)
def test_fork_started_dataloader_serves_cached_batches():
    data = TensorDataset(torch.arange(60 * 40_000, dtype=torch.float32).view(60, 40_000))
    for cls in BOTH:
        it = iter(cls(data, batch_size=2, num_workers=2))
        cache = [next(it)[0] for _ in range(4)]
        expected = [c.clone() for c in cache]
        serve = DataLoader(ds.ListDataset(cache, delay=0.2), batch_size=None, num_workers=2,
                           multiprocessing_context="fork", timeout=60)
        served = iter(serve)  # workers forked now, with the cached batches
        del cache
        gc.collect()
        for _ in it:  # the source loader reuses what it can meanwhile
            pass
        got = list(served)
        assert len(got) == 4
        for a, b in zip(got, expected):
            assert torch.equal(a, b), cls.__name__


# -- scheduling while the consumer holds batches --------------------------------------------

@pytest.mark.parametrize("in_order", [True, False])
def test_requests_go_out_as_dataloaders_while_batches_are_held(in_order):
    """With every batch held, a request never waits for the consumer: after each next()
    exactly as many requests have gone out as DataLoader sent (one per batch delivered,
    after num_workers × prefetch_factor), to the workers its rules pick."""
    data = TensorDataset(torch.arange(40 * 20_000, dtype=torch.float32).view(40, 20_000))
    sent, delivered = {}, {}
    for cls in BOTH:
        it = iter(cls(data, batch_size=2, num_workers=2, in_order=in_order, prefetch_factor=2))
        held, counts = [], []
        for batch in quietly(lambda it=it, counts=counts: list(_drive(it, counts))):
            held.append(batch)
        sent[cls] = counts
        delivered[cls] = sorted(int(b[0][0, 0]) for b in held)
        del it, held
    assert sent[PoolLoader] == sent[DataLoader]
    assert delivered[PoolLoader] == delivered[DataLoader]


def _drive(it, counts):
    for batch in it:
        counts.append(it._send_idx)
        yield batch


# -- worker side, release path ------------------------------------------------------------------

def test_worker_that_keeps_a_slot_tensor_is_warned(capfd):
    data = TensorDataset(torch.arange(40 * 100, dtype=torch.float32).view(40, 100))
    # spawn: a fork-started worker would inherit pytest's warning recorder and print nothing
    kw = dict(batch_size=2, num_workers=1, collate_fn=ds.keeping_collate,
              multiprocessing_context="spawn")
    ref = [b[0] for b in DataLoader(data, **kw)]
    got = [b[0].clone() for b in PoolLoader(data, **kw)]
    assert_same(ref, got)
    err = capfd.readouterr().err
    assert "still alive after its batch was sent" in err and "clone()" in err, err[-2000:]


def test_release_callback_runs_no_python_bytecode():
    """A signal handler can only run between bytecodes: the callback that gives a slot
    back when a batch dies is a C-level bound method, so no KeyboardInterrupt or
    SystemExit can land in it (and be swallowed as 'Exception ignored in')."""
    data = TensorDataset(torch.zeros(8, 20_000))
    it = iter(PoolLoader(data, batch_size=2, num_workers=1))
    batch = next(it)
    refs = list(it._ledger.leases)
    assert refs, "the batch's tensor stays in the slot, so its lease is registered"
    assert all(type(r.__callback__) is types.BuiltinMethodType for r in refs)
    del batch
    assert it._ledger.released, "the dead lease was queued"
    list(it)


def test_pickled_batch_round_trips_like_dataloaders():
    for cls in BOTH:
        batch = next(iter(rfdetr_loader(cls, 1, batch_size=2)))
        assert_same(pickle.loads(pickle.dumps(batch)), batch)


# -- dropped batches leave at once (issue 33, item 5) ------------------------------------------

@pytest.mark.timeout(120)
def test_dropped_detached_batches_are_unmapped_when_dropped():
    """A persistent loader whose consumer kept every batch of an epoch (so most were
    detached from the pool), idle between epochs: stats.detached_bytes is exactly the
    shared memory this process maps beyond the pool, i.e. what the consumer still holds;
    once the batches are dropped the process maps the pool and nothing else, with no
    take() in between. The next epoch is DataLoader's."""
    data = TensorDataset(torch.arange(40 * 20_000, dtype=torch.float32).view(40, 20_000))
    # what earlier tests of this process left mapped (under xdist, a loader a failed
    # test's traceback keeps, or a cycle not yet collected): not this loader's
    gc.collect()
    before = sum(proc.memfd_segments("self").values())
    loader = PoolLoader(data, batch_size=2, num_workers=2, persistent_workers=True,
                        shm_backend="memfd")
    with pytest.warns(UserWarning, match="detached"):
        held = list(loader)
    pool = loader._iterator._pool

    def beyond_pool() -> int:  # memfd bytes mapped here that are not the pool's
        mapped = sum(proc.memfd_segments("self").values()) - before
        return mapped - pool.total_bytes - pool.control.mapping.size
    assert loader.stats.detaches > 0
    assert loader.stats.detached_bytes == beyond_pool() > 0
    del held[: len(held) // 2]  # the oldest ones: detached
    assert loader.stats.detached_bytes == beyond_pool() > 0
    del held
    assert beyond_pool() == 0 and loader.stats.detached_bytes == 0
    ref = [b[0] for b in DataLoader(data, batch_size=2)]
    got = [b[0].clone() for b in loader]
    assert_same(ref, got)


def test_a_held_batch_keeps_its_pages_while_idle_slots_give_theirs_back(monkeypatch):
    """Batches 0 and 1 are kept for a whole epoch while the pool (slots=10, deeper than
    needed) gives the pages of its idle slots back (MADV_REMOVE) after 2 idle takes:
    the kept batches never change (a returned page would read as zeros), and pages did
    go back. A pool's return_pages refuses a slot a batch still views."""
    from poolloader.main import ledger
    monkeypatch.setattr(ledger, "IDLE_TAKES", 2)
    loader = PoolLoader(ds.AugmentDataset(n=40 * 4, shape=(3, 128, 128)), batch_size=4,
                        num_workers=2, slots=10)
    it = iter(loader)
    kept = [next(it), next(it)]
    copies = copy.deepcopy(kept)
    refused = []
    for k, batch in enumerate(it):
        del batch
        if k == 20:  # mid-epoch: the slots the kept batches view are refused
            pool = loader.stats._live_pool()
            slots = {s for s in range(pool.num_slots)
                     if pool.mappings[s] is not None and pool.mappings[s].leases}
            refused = [pool.return_pages(s, fmt.DATA_OFF) for s in slots]
    assert len(refused) >= 2 and not any(refused), refused
    assert loader.stats.pages_returned >= 2
    for batch, reference in zip(kept, copies):
        assert_same(batch, reference)
        assert batch["image"].abs().sum() > 0
    del it, kept, copies
    gc.collect()
