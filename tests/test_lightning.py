"""PyTorch Lightning: a LightningDataModule whose train_dataloader() returns a PoolLoader.

* `Trainer.fit` on CPU runs the steps, the loss is finite, and the loader the trainer
  used is a PoolLoader with the pool options it was given.
* Lightning's sampler injection: with `use_distributed_sampler=True` and a DDP
  strategy on one CPU process (a gloo group of one), Lightning re-instantiates the
  loader with a DistributedSampler; the new loader must still be a PoolLoader with
  the same pool options. The same re-instantiation from attributes alone, through
  `_update_dataloader(loader, sampler)`, is checked directly.
Skipped when lightning is not installed.
"""
from __future__ import annotations

import math
import os

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, DistributedSampler, RandomSampler, SequentialSampler

pl = pytest.importorskip("lightning.pytorch")

from poolloader import PoolLoader  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

N = 48
FEATURES = 8
POOL_OPTIONS = dict(slot_bytes=1 << 16, slots=6, shm_limit=64 << 20)


class Regression(Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(500 + i)
        x = torch.randn(FEATURES, generator=g)
        return torch.tensor(i), x, x[:2].sum(0, keepdim=True)


class DataModule(pl.LightningDataModule):
    def __init__(self, **loader_kw):
        super().__init__()
        self.loader_kw = loader_kw

    def train_dataloader(self):
        return PoolLoader(Regression(), batch_size=4, shuffle=True, num_workers=2,
                          **POOL_OPTIONS, **self.loader_kw)


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(FEATURES, 1)
        self.seen, self.losses = [], []

    def training_step(self, batch, batch_idx):
        index, x, y = batch
        self.seen.extend(index.tolist())
        loss = nn.functional.mse_loss(self.layer(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


@pytest.fixture
def clean_env():
    """Lightning's DDP sets MASTER_ADDR / MASTER_PORT / ranks in os.environ and leaves a
    process group behind: restore both."""
    saved = dict(os.environ)
    yield
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


def _trainer(tmp_path, max_steps=5, **kw):
    return pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, enable_progress_bar=False,
                      logger=False, enable_checkpointing=False, enable_model_summary=False,
                      default_root_dir=tmp_path, **kw)


def _assert_pool_options(loader):
    assert type(loader) is PoolLoader
    for name, value in POOL_OPTIONS.items():
        assert getattr(loader, name) == value, name
    assert loader.num_workers == 2 and loader.batch_size == 4


@pytest.mark.parametrize("persistent", [False, True])
def test_fit_with_a_poolloader_datamodule(tmp_path, persistent):
    model, dm = Model(), DataModule(persistent_workers=persistent)
    trainer = _trainer(tmp_path)
    trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 5
    assert len(model.losses) == 5 and all(math.isfinite(v) for v in model.losses)
    assert len(model.seen) == 20 and len(set(model.seen)) == 20
    _assert_pool_options(trainer.train_dataloader)
    assert isinstance(trainer.train_dataloader.sampler, RandomSampler)
    assert trainer.train_dataloader.stats.batches >= 5  # batches really came through the pool


def test_fit_with_ddp_injects_a_distributed_sampler_into_a_poolloader(tmp_path, clean_env):
    from lightning.pytorch.strategies import DDPStrategy

    model, dm = Model(), DataModule()
    trainer = _trainer(tmp_path, strategy=DDPStrategy(process_group_backend="gloo"),
                       use_distributed_sampler=True, max_steps=14)  # > one epoch of 12 batches
    trainer.fit(model, datamodule=dm)
    loader = trainer.train_dataloader
    _assert_pool_options(loader)
    assert isinstance(loader.sampler, DistributedSampler)  # re-instantiated by Lightning
    assert loader.sampler.num_replicas == 1 and loader.sampler.shuffle
    assert trainer.global_step == 14 and all(math.isfinite(v) for v in model.losses)
    assert sorted(model.seen[:N]) == list(range(N))  # one epoch: every sample once


class StreamModel(pl.LightningModule):
    """Regresses each image's instance count from its channel means (anything finite)."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(3, 1)
        self.ids, self.losses = [], []

    def training_step(self, batch, batch_idx):
        images, _mask, targets = batch
        self.ids.extend(targets.fields["image_id"].reshape(-1).tolist())
        counts = targets.counts.to(torch.float32).unsqueeze(1)
        loss = nn.functional.mse_loss(self.layer(images.mean(dim=(2, 3))), counts)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_fit_on_a_sized_webdataset_stream(tmp_path):
    # RF-DETR PR 1396's shape: WebDataset(...).map(...).batched(B) with a known length,
    # batch_size=None on the loader; Lightning reads len() for its epoch length.
    wds = pytest.importorskip("webdataset")
    from fixtures.shards import DecodeSample, shard_urls, write_shards
    from fixtures.synthetic import make_coco_like
    from poolloader import DetectionCollate

    ann = make_coco_like(tmp_path / "coco", 16, seed=2, size=(96, 72))
    index = write_shards(tmp_path / "coco", ann, tmp_path / "shards", shard_bytes=40_960)
    urls = shard_urls(tmp_path / "shards")
    assert len(urls) >= 2
    per_worker = [sum(s["num_samples"] for s in index["shards"][w::2]) for w in range(2)]
    batches = sum(math.ceil(n / 4) for n in per_worker)

    class StreamData(pl.LightningDataModule):
        def train_dataloader(self):
            pipeline = (wds.WebDataset(urls, shardshuffle=False, nodesplitter=wds.split_by_node,
                                       workersplitter=wds.split_by_worker)
                        .map(DecodeSample(resolution=32))
                        .batched(4, collation_fn=DetectionCollate(pack=True))
                        .with_length(batches))
            return PoolLoader(pipeline, batch_size=None, num_workers=2, **POOL_OPTIONS)

    model = StreamModel()
    trainer = _trainer(tmp_path, max_steps=-1, max_epochs=2)
    trainer.fit(model, datamodule=StreamData())
    assert trainer.num_training_batches == batches
    assert trainer.global_step == 2 * batches
    assert sorted(model.ids) == sorted(2 * list(range(1, 17)))
    assert all(math.isfinite(v) for v in model.losses)
    assert type(trainer.train_dataloader) is PoolLoader


@pytest.mark.parametrize("sampler_kind", ["sequential", "distributed"])
def test_update_dataloader_reinstantiates_a_poolloader(sampler_kind):
    from lightning.pytorch.utilities.data import _update_dataloader

    dataset = Regression()
    loader = PoolLoader(dataset, batch_size=4, shuffle=True, num_workers=2, drop_last=True,
                        persistent_workers=True, **POOL_OPTIONS)
    sampler = (SequentialSampler(dataset) if sampler_kind == "sequential"
               else DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=False))
    new = _update_dataloader(loader, sampler)
    assert new is not loader
    _assert_pool_options(new)
    assert new.sampler is sampler and new.drop_last and new.persistent_workers
    assert new.dataset is dataset
    first = [b[0].tolist() for b in new]
    expected = list(range(N)) if sampler_kind == "sequential" else list(range(1, N, 2))
    assert [i for b in first for i in b] == expected[:len(expected) // 4 * 4]
    it = new._iterator
    assert type(it).__name__ == "PoolLoaderIter"
    it._shutdown_workers()


def test_lightning_teardown_shuts_pool_workers_down():
    """Lightning stops workers only of iterators that are _MultiProcessingDataLoaderIter."""
    from lightning.pytorch.utilities.combined_loader import _shutdown_workers_and_reset_iterator
    from torch.utils.data import TensorDataset

    loader = PoolLoader(TensorDataset(torch.arange(64.0)), batch_size=4, num_workers=2,
                        persistent_workers=True)
    it = iter(loader)
    next(it)
    _shutdown_workers_and_reset_iterator(loader)
    assert not any(w.is_alive() for w in it._workers)
    assert not it._pool.live_names
