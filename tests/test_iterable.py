"""IterableDataset parity with torch's DataLoader: the same dataset, the same seed, the
same samples in the same order, bit for bit, through DataLoader and PoolLoader.

Two kinds of stream over the same tar shards (fixtures.shards):
  * `ShardStream`, a plain IterableDataset splitting shards by get_worker_info()
    (no WebDataset needed), and
  * `webdataset.WebDataset(urls, ...)` pipelines: decode, map, `.batched(n)` with
    `batch_size=None` on the loader, split_by_worker, split_by_node, shard and
    sample shuffles with seeds, per-epoch reshuffling (detshuffle).
Shard counts are chosen against worker counts so workers get uneven shares and,
with 3 shards over 4 workers, one worker gets nothing at all.
"""
from __future__ import annotations

import math
import re
import warnings

import numpy as np
import pytest
import torch
from compare import both_loaders, pool_only
from torch.utils.data import IterableDataset, get_worker_info

from fixtures.shards import DecodeSample, read_samples, shard_urls, write_shards
from fixtures.synthetic import make_coco_like
from poolloader import DetectionCollate, PackedTargets

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

SHARD_BYTES = 20_480  # two tar records: 1-3 of the 96x72 samples per shard
RESOLUTION = 32


@pytest.fixture(scope="module")
def urls(tmp_path_factory):
    """Paths of >= 6 small shards with uneven sample counts."""
    root = tmp_path_factory.mktemp("coco")
    ann = make_coco_like(root, 20, seed=5, size=(96, 72))
    out = tmp_path_factory.mktemp("shards")
    index = write_shards(root, ann, out, shard_bytes=SHARD_BYTES)
    counts = [s["num_samples"] for s in index["shards"]]
    assert len(counts) >= 6 and len(set(counts[:5])) > 1, counts
    return shard_urls(out)


def _samples_in(urls):
    return sum(1 for url in urls for _ in read_samples(url))


def canon(obj):
    """A comparable, copy-only form of a batch: no view of a slot survives it."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().contiguous()
        return ("tensor", str(t.dtype), tuple(t.shape), t.numpy().tobytes())
    if isinstance(obj, PackedTargets):
        return ("packed", canon(obj.fields), canon(obj.counts), sorted(obj.stacked))
    if isinstance(obj, np.ndarray):
        return ("ndarray", str(obj.dtype), obj.shape, obj.tobytes())
    if isinstance(obj, dict):
        return ("dict", [(k, canon(v)) for k, v in obj.items()])
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, [canon(x) for x in obj])
    return (type(obj).__name__, repr(obj))


def image_ids(batch_canon):
    """image ids found in a canon()ed batch (for readable assertions)."""
    out = []

    def walk(c, key=None):
        kind = c[0]
        if kind == "tensor" and key == "image_id":
            out.extend(np.frombuffer(c[3], dtype=np.int64).tolist())
        elif kind == "dict":
            for k, v in c[1]:
                walk(v, k)
        elif kind == "packed":
            walk(c[1])
        elif kind in ("list", "tuple"):
            for x in c[1]:
                walk(x, key)

    walk(batch_canon)
    return out


def run_both(make_dataset, epochs=1, pool_kw=None, **loader_kw):
    """(DataLoader's epochs, PoolLoader's), each a list of canon()ed batches, through
    compare.both_loaders. `pool_kw`: PoolLoader-only options (slot_bytes=...)."""
    return both_loaders(
        lambda cls: cls(make_dataset(), **loader_kw, **pool_only(cls, **(pool_kw or {}))),
        run=lambda loader: [[canon(b) for b in loader] for _ in range(epochs)], seed=0)


class ShardStream(IterableDataset):
    """Shards split over workers by get_worker_info() (shard i -> worker i % n), each
    sample decoded with fixtures.shards.decode_sample (a random flip per sample)."""

    def __init__(self, urls, decode, batch=None, collate=None):
        self.urls = list(urls)
        self.decode = decode
        self.batch = batch
        self.collate = collate

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (0, 1) if info is None else (info.id, info.num_workers)
        samples = (self.decode(s) for url in self.urls[wid::nw] for s in read_samples(url))
        if self.batch is None:
            yield from samples
            return
        buf = []
        for s in samples:
            buf.append(s)
            if len(buf) == self.batch:
                yield self.collate(buf)
                buf = []
        if buf:
            yield self.collate(buf)


# -- a plain IterableDataset ------------------------------------------------------------------

@pytest.mark.parametrize("workers,nshards", [(1, 3), (2, 3), (2, 5), (4, 3), (4, 5)])
@pytest.mark.parametrize("mode", ["loader_batches", "dataset_batches"])
def test_shard_stream_parity(urls, workers, nshards, mode):
    subset = urls[:nshards]
    decode = DecodeSample(resolution=RESOLUTION)
    if mode == "loader_batches":
        make = lambda: ShardStream(subset, decode)  # noqa: E731
        kw = dict(batch_size=3, collate_fn=DetectionCollate(pack=True))
    else:
        make = lambda: ShardStream(subset, decode, batch=3, collate=DetectionCollate())  # noqa: E731
        kw = dict(batch_size=None)
    dl, pl = run_both(make, num_workers=workers, **kw)
    assert pl == dl
    ids = [i for b in dl[0] for i in image_ids(b)]
    assert len(ids) == len(set(ids)) == _samples_in(subset)


# -- WebDataset pipelines ---------------------------------------------------------------------

def _wds():
    return pytest.importorskip("webdataset")


def wds_pipeline(urls, *, decode="raw", batch=3, collation="detection", shardshuffle=False,
                 seed=None, sample_shuffle=None, detshuffle=False, multiscale=None,
                 empty_check=False, length=None, nodesplit=True):
    wds = _wds()
    pipe = wds.WebDataset(urls, shardshuffle=shardshuffle, seed=seed, detshuffle=detshuffle,
                          nodesplitter=wds.split_by_node if nodesplit else wds.single_node_only,
                          workersplitter=wds.split_by_worker, empty_check=empty_check)
    if sample_shuffle:
        pipe = pipe.shuffle(sample_shuffle, seed=seed)
    if decode != "raw":
        pipe = pipe.decode(decode)
    pipe = pipe.map(DecodeSample(resolution=RESOLUTION, multiscale=multiscale))
    if batch:
        if collation == "detection":
            pipe = pipe.batched(batch, collation_fn=DetectionCollate(pack=True))
        else:
            pipe = pipe.batched(batch)  # webdataset's default_collation_fn
    if length is not None:
        pipe = pipe.with_length(length)
    return pipe


@pytest.mark.parametrize("workers,nshards", [(1, 3), (1, 5), (2, 3), (2, 5), (4, 3), (4, 5)])
def test_webdataset_batched_parity(urls, workers, nshards):
    subset = urls[:nshards]
    dl, pl = run_both(lambda: wds_pipeline(subset, multiscale=(24, 32)),
                      batch_size=None, num_workers=workers)
    assert pl == dl
    ids = [i for b in dl[0] for i in image_ids(b)]
    assert sorted(ids) == sorted(set(ids)) and len(ids) == _samples_in(subset)
    if workers == 4 and nshards == 3:
        # worker 3 had no shard: the stream still ends, with every sample of the other three
        assert len(dl[0]) >= 3


@pytest.mark.parametrize("variant", [
    dict(decode="pil", collation="default"),
    dict(decode="rgb8", collation="detection"),
    dict(shardshuffle=4, seed=7),
    dict(shardshuffle=4, seed=7, sample_shuffle=5),
])
def test_webdataset_pipeline_variants_parity(urls, variant):
    subset = urls[:5]
    dl, pl = run_both(lambda: wds_pipeline(subset, **variant), batch_size=None, num_workers=2)
    assert pl == dl
    assert sum(len(image_ids(b)) for b in dl[0]) == _samples_in(subset)


def test_webdataset_samples_batched_by_the_loader_parity(urls):
    subset = urls[:5]
    dl, pl = run_both(lambda: wds_pipeline(subset, batch=None), batch_size=4, num_workers=2,
                      collate_fn=DetectionCollate(pack=True), drop_last=True)
    assert pl == dl
    n = _samples_in(subset)
    assert len(dl[0]) <= n // 4  # drop_last, per worker


@pytest.mark.parametrize("rank", [0, 1])
def test_webdataset_split_by_node_parity(urls, monkeypatch, rank):
    # split_by_node reads RANK / WORLD_SIZE first (what torchrun sets); workers inherit them
    subset = urls[:5]
    nodes = []
    for r in (0, 1):
        monkeypatch.setenv("RANK", str(r))
        monkeypatch.setenv("WORLD_SIZE", "2")
        dl, pl = run_both(lambda: wds_pipeline(subset), batch_size=None, num_workers=2)
        assert pl == dl
        nodes.append([i for b in pl[0] for i in image_ids(b)])
    assert not set(nodes[0]) & set(nodes[1])
    assert len(nodes[0]) + len(nodes[1]) == _samples_in(subset)
    assert nodes[rank]


@pytest.mark.parametrize("persistent", [True, False])
def test_webdataset_two_epochs_parity(urls, persistent):
    # detshuffle keeps an epoch counter on the dataset instance: with persistent workers
    # it survives in each worker, so epoch 2 reshuffles; without, each epoch replays.
    subset = urls[:5]
    dl, pl = run_both(lambda: wds_pipeline(subset, shardshuffle=5, seed=3, detshuffle=True),
                      epochs=2, batch_size=None, num_workers=2, persistent_workers=persistent)
    assert pl == dl
    order = [[i for b in epoch for i in image_ids(b)] for epoch in pl]
    assert sorted(order[0]) == sorted(order[1])
    if persistent:
        assert order[0] != order[1]
    else:
        assert order[0] == order[1]


def test_abandoned_epoch_and_slot_growth_parity(urls):
    # persistent workers: epoch 1 stopped after one batch (max_steps), then two full
    # epochs; tiny slots so batches of mixed sizes (multiscale) grow them mid-stream
    subset = urls[:5]

    def run(loader):
        it = iter(loader)
        epochs = [[canon(next(it))]]
        del it
        epochs += [[canon(b) for b in loader] for _ in range(2)]
        return epochs, getattr(loader, "stats", None)

    (ref, _), (got, stats) = both_loaders(
        lambda cls: cls(wds_pipeline(subset, multiscale=(24, 96)), batch_size=None, num_workers=2,
                        persistent_workers=True, **pool_only(cls, slot_bytes=4096)),
        run, seed=0)
    assert stats.slot_growths > 0
    assert got == ref
    assert len(ref[1]) == len(ref[2]) > 1


def test_persistent_plain_stream_two_epochs_parity(urls):
    # the random flips continue from each worker's RNG state in epoch 2
    subset = urls[:5]
    dl, pl = run_both(lambda: ShardStream(subset, DecodeSample(resolution=RESOLUTION)), epochs=2,
                      batch_size=2, collate_fn=DetectionCollate(), num_workers=2,
                      persistent_workers=True)
    assert pl == dl
    assert pl[0] != pl[1]  # same samples, other flips


def test_empty_worker_error_parity(urls):
    # empty_check=True (WebDataset's default): the worker without shards raises; both
    # loaders deliver the same batches first, then the same error.
    subset = urls[:3]

    def run(loader):
        got, error = [], None
        try:
            for b in loader:
                got.append(canon(b))
        except ValueError as exc:
            lines = str(exc).strip().splitlines()
            error = (lines[0], lines[-1])  # "Caught ValueError in ... worker process 3.", the message
        return got, error

    ref, pool = both_loaders(
        lambda cls: cls(wds_pipeline(subset, empty_check=True), batch_size=None, num_workers=4),
        run, seed=0)
    assert pool == ref
    got, error = ref
    assert got and error is not None
    assert error[0] == "Caught ValueError in DataLoader worker process 3."
    assert "Turn off using empty_check=False" in error[1]


# -- len() ---------------------------------------------------------------------------------------

class SizedStream(IterableDataset):
    """Yields `actual` items split over workers but reports `reported` as its length."""

    def __init__(self, actual, reported):
        self.actual, self.reported = actual, reported

    def __len__(self):
        return self.reported

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(wid, self.actual, nw):
            yield torch.tensor([i, wid])


def len_batches_warnings(loader):
    """run= for both_loaders: len(loader) (or its TypeError), the canon()ed batches, and
    the warnings both raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            length = len(loader)
        except TypeError as exc:
            length = f"TypeError: {exc}"
        batches = [canon(b) for b in loader]
    return length, batches, _messages(caught)


def _messages(caught):
    """(category, text) of the warnings, object addresses blanked (two datasets differ)."""
    return [(w.category.__name__, re.sub(r" at 0x[0-9a-f]+", " at 0x?", str(w.message)))
            for w in caught if "DataLoader will create" not in str(w.message)]


@pytest.mark.parametrize("actual,reported,kw", [
    (10, 10, dict(batch_size=None, num_workers=2)),
    (14, 10, dict(batch_size=None, num_workers=2)),                # more than reported: warns
    (14, 10, dict(batch_size=None, num_workers=1)),
    (14, 10, dict(batch_size=3, num_workers=2)),                   # len = ceil(10 / 3)
    (14, 10, dict(batch_size=3, num_workers=2, drop_last=True)),   # len = 10 // 3
    (7, 10, dict(batch_size=2, num_workers=4)),                    # fewer than reported
])
def test_len_and_its_warning_match_dataloader(actual, reported, kw):
    dl, pl = both_loaders(lambda cls: cls(SizedStream(actual, reported), **kw),
                          len_batches_warnings, seed=0)
    assert pl == dl
    bs = kw["batch_size"]
    expected = reported if bs is None else (
        reported // bs if kw.get("drop_last") else math.ceil(reported / bs))
    assert dl[0] == expected
    # torch compares batches yielded with the dataset's *sample* length, so only the
    # unbatched stream that outgrows its reported length warns
    warned = any("Length of IterableDataset" in m for _, m in dl[2])
    assert warned == (actual > reported and bs is None), dl[2]


def test_len_of_webdataset_with_length_and_without(urls):
    subset = urls[:5]
    n = _samples_in(subset)
    batches = math.ceil(n / 3)
    for length, expect in [(batches, batches), (None, "TypeError")]:
        dl, pl = both_loaders(
            lambda cls: cls(wds_pipeline(subset, length=length), batch_size=None, num_workers=2),  # noqa: B023
            len_batches_warnings, seed=0)
        assert pl == dl
        assert str(dl[0]).startswith(str(expect))


def test_webdataset_parity_with_forkserver_workers(urls):
    # the pipeline, DecodeSample and DetectionCollate cross a pickle boundary here
    subset = urls[:3]
    dl, pl = run_both(lambda: wds_pipeline(subset), batch_size=None, num_workers=2,
                      multiprocessing_context="forkserver")
    assert pl == dl
    assert sum(len(image_ids(b)) for b in dl[0]) == _samples_in(subset)


# -- IterDataPipe pipelines (torch.utils.data.datapipes) ----------------------------------------

@pytest.mark.parametrize("persistent", [False, True])
def test_datapipe_shuffle_and_sharding_parity(persistent):
    """`.shuffle().sharding_filter()` with 2 workers: DataLoader shards the pipe in each
    worker (every element once per epoch, not once per worker) and reseeds the shuffle
    from its shared seed every epoch, persistent workers included; same order here."""
    from torch.utils.data.datapipes.iter import IterableWrapper

    def make(cls):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch: datapipes are deprecated
            pipe = IterableWrapper(range(22)).shuffle().sharding_filter()
        return cls(pipe, batch_size=4, num_workers=2, persistent_workers=persistent)

    def run(loader):
        return [[b.tolist() for b in loader] for _ in range(3)]
    ref, got = both_loaders(make, run)
    assert got == ref
    for epoch in got:
        assert sorted(x for batch in epoch for x in batch) == list(range(22))
    assert got[0] != got[1] != got[2]  # reshuffled every epoch
