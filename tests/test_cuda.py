"""CUDA paths: registered slots, async copies gated by events, device= delivery.

Skipped on machines without CUDA (the CPU paths of pin_memory and device= are in
test_loader.py). bench/gpu.py runs the heavier checks on a GPU machine.
"""
import loader_datasets as ds
import pytest
import torch

from poolloader import PoolLoader

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_slots_are_pinned_and_copies_are_exact():
    loader = PoolLoader(ds.AugmentDataset(n=20), batch_size=4, num_workers=2, pin_memory=True)
    for batch in loader:
        assert batch["image"].is_pinned()
        dev = batch["image"].to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(dev.cpu(), batch["image"])


def test_reuse_waits_for_inflight_copies():
    # a tiny pool and a slow consumer stream: every slot is reused while copies are queued
    data = ds.RFDETRShaped(n=48, hw=256)
    ref = [b for b in torch.utils.data.DataLoader(data, batch_size=4, collate_fn=ds.rfdetr_collate)]
    loader = PoolLoader(data, batch_size=4, collate_fn=ds.rfdetr_collate, num_workers=2,
                        pin_memory=True, slots=2, prefetch_factor=1)
    stream = torch.cuda.Stream()
    outs = []
    with torch.cuda.stream(stream):
        for batch in loader:
            torch.cuda._sleep(2_000_000)  # keep the stream busy so copies lag behind
            outs.append(batch[0].to("cuda", non_blocking=True))
            del batch
    torch.cuda.synchronize()
    for got, want in zip(outs, ref):
        assert torch.equal(got.cpu(), want[0])


def test_device_delivery():
    data = ds.RFDETRShaped(n=16, hw=128)
    ref = [b for b in torch.utils.data.DataLoader(data, batch_size=4, collate_fn=ds.rfdetr_collate)]
    loader = PoolLoader(data, batch_size=4, collate_fn=ds.rfdetr_collate, num_workers=2,
                        device="cuda")
    for got, want in zip(loader, ref):
        assert got[0].is_cuda and got[2][0]["boxes"].is_cuda
        assert torch.equal(got[0].cpu(), want[0])
        assert torch.equal(got[2][3]["labels"].cpu(), want[2][3]["labels"])


def test_side_stream_copy_with_next_outside_it():
    # issue 14's check: the copy is queued on a side stream behind a long kernel while
    # next() runs on the default stream; the slot must not be reused before it ran
    class Full(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            return torch.full((4, 1 << 18), float(i))

    it = iter(PoolLoader(Full(), batch_size=2, num_workers=2, pin_memory=True, slots=2,
                         prefetch_factor=1))
    side, outs = torch.cuda.Stream(), []
    for _ in range(32):
        b = next(it)
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)
            outs.append(b.to("cuda", non_blocking=True))
        del b
    torch.cuda.synchronize()
    assert [o[:, 0, 0].tolist() for o in outs] == [[2.0 * k, 2.0 * k + 1] for k in range(32)]
    it._shutdown_workers()


def test_marker_lists_only_the_pool_streams_handed_out():
    # torch's pool has 32 streams per priority level; the gate queries only the ones
    # some code took (before or after the loader started), the default and the current
    from poolloader.cuda.runtime import torch_runtime
    before = torch.cuda.Stream()  # a prefetcher's stream (taken before the first look if run alone)
    rt = torch_runtime()
    device = torch.cuda.current_device()
    first = {s.cuda_stream for s in rt.streams(device)}
    assert before.cuda_stream in first and torch.cuda.default_stream().cuda_stream in first
    after = torch.cuda.Stream(priority=-1)
    listed = {s.cuda_stream for s in rt.streams(device)}
    assert after.cuda_stream in listed and first <= listed
    assert len(listed) < 16  # not the whole pool (1 + 32 per priority level)
