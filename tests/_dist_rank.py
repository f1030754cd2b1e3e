"""One rank of test_distributed.py: `python _dist_rank.py OUT_JSON [SHARD_URL ...]`.

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (what torchrun sets).
Joins a gloo process group, then
  1. trains a tiny DDP model for two epochs on a 2-worker PoolLoader over a
     DistributedSampler (persistent workers, set_epoch each epoch), recording the
     sample indices, the losses, the pool's name prefix and the final parameters;
  2. with shard URLs, streams a WebDataset pipeline split with split_by_node and
     split_by_worker through a 2-worker PoolLoader (batch_size=None, .batched()),
     recording the image ids it got.
Writes everything to OUT_JSON and exits 0; an exception exits 1 with its traceback
on stderr. Every collective is bounded by the process group's timeout.
"""
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler

from poolloader import DetectionCollate, PoolLoader

N_SAMPLES = 40
FEATURES = 8
BATCH = 4
EPOCHS = 2


class Regression(Dataset):
    """Item i: (i, x_i [FEATURES], y_i [1]), a function of i only."""

    def __len__(self):
        return N_SAMPLES

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(1000 + i)
        x = torch.randn(FEATURES, generator=g)
        y = x[:3].sum(0, keepdim=True) - 0.5 * x[3:4]
        return torch.tensor(i), x, y


def train(rank, world):
    sampler = DistributedSampler(Regression(), num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = PoolLoader(Regression(), batch_size=BATCH, sampler=sampler, num_workers=2,
                        persistent_workers=True, slot_bytes=1 << 16)
    torch.manual_seed(0)
    model = nn.Linear(FEATURES, 1)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    epochs, losses, prefixes = [], [], []
    try:
        for epoch in range(EPOCHS):
            sampler.set_epoch(epoch)
            it = iter(loader)
            prefixes.append(it.shm_prefix)
            seen = []
            for index, x, y in it:
                seen.extend(index.tolist())
                opt.zero_grad()
                loss = nn.functional.mse_loss(ddp(x), y)
                loss.backward()
                opt.step()
                losses.append(loss.item())
                del index, x, y
            epochs.append(seen)
    finally:
        it = loader._iterator
        if it is not None:
            it._shutdown_workers()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(params) for _ in range(world)]
    dist.all_gather(gathered, params)
    in_sync = all(torch.equal(gathered[0], g) for g in gathered)
    return {"epochs": epochs, "losses": losses, "prefixes": prefixes,
            "params": [float(v).hex() for v in params.tolist()], "in_sync": in_sync}


def stream(urls):
    import webdataset as wds

    from fixtures.shards import DecodeSample

    pipeline = (wds.WebDataset(urls, shardshuffle=False, nodesplitter=wds.split_by_node,
                               workersplitter=wds.split_by_worker, empty_check=False)
                .map(DecodeSample(resolution=32))
                .batched(2, collation_fn=DetectionCollate(pack=True)))
    loader = PoolLoader(pipeline, batch_size=None, num_workers=2)
    ids = []
    for _images, _mask, targets in loader:
        ids.extend(targets.fields["image_id"].reshape(-1).tolist())
        del targets
    return ids


def main():
    out_path, urls = sys.argv[1], sys.argv[2:]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        result = {"rank": rank, "pid": os.getpid()}
        result.update(train(rank, world))
        if urls:
            result["stream_ids"] = stream(urls)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    with open(out_path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(out_path + ".tmp", out_path)


if __name__ == "__main__":
    main()
