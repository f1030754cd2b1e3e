"""Train a small detector on synthetic COCO-like JPEGs, with DataLoader or PoolLoader.

The data path is RF-DETR's: workers decode real JPEG files with Pillow, flip
them at random, resize and normalise them (`fixtures.synthetic.CocoLikeDataset`, from this repository),
and `DetectionCollate` pads them into one batch: images [B,3,H,W], a padding mask
[B,H,W] (True = padding) and the targets (packed one tensor per field with
`--pack-targets`, else a tuple of per-image dicts).

The model is small but real, so the whole thing runs on a CPU in seconds:

* backbone: four stride-2 3×3 conv + BatchNorm + ReLU layers (stride 16);
* head: a fixed set of learned queries (DETR-style) that attend over the
  feature map plus a coordinate grid (padding positions masked out), then an
  MLP per query predicts a box (cx, cy, w, h in [0, 1]) and class logits
  (the dataset's categories plus "no object");
* loss: each ground-truth box is matched to one query by greedy matching on
  L1 box distance minus the class probability (no scipy, no Hungarian
  algorithm: repeatedly take the cheapest remaining (query, box) pair);
  cross-entropy on every query (unmatched ones learn "no object", weighted
  0.1) plus 5 × L1 on the matched boxes. Adam at a constant learning rate.

The two arms differ in one thing only, the loader class: same dataset, same
collate, same arguments, same sampler generator. DataLoader and PoolLoader
deliver identical batches (same sampler order, same per-worker seeding, so the
same random flips), the model is seeded before it is built, the main process
uses a fixed number of threads and deterministic algorithms, so with the same
seed and arguments both arms print the same loss curve, bit for bit.

Under torchrun (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT` in
the environment) every rank joins a process group (gloo on the CPU, nccl on
`cuda:LOCAL_RANK` for `--device cuda`), the model is wrapped in
DistributedDataParallel and each rank reads its share of the data through a
`DistributedSampler(shuffle=True, seed=--seed)` told the epoch (`set_epoch`)
before each epoch; the loader's generator, which seeds its workers, is seeded
with `--seed + RANK`, so ranks draw different augmentations. Each rank trains
on its own batches and records its own losses (gradients are averaged across
ranks by DDP); `--steps` counts each rank's steps. Local rank 0 generates the
data first, the other ranks then find it. Without torchrun it is one process,
as before: no process group, no sampler, the same losses.

Reported at the end: images per second (all steps, and after `--warmup-steps`),
the share of wall time the training loop spent inside `next()` waiting for
data, the final loss and a summary of the loss curve, and for PoolLoader
`loader.stats.as_dict()`. `--json PATH` writes all of it with the per-step losses and
the image ids of each step's batch. Under torchrun each rank prints its own
report (headed `rank R/W`) and writes its own file, `PATH` with `.rank<R>` before
the extension (`run.json` -> `run.rank0.json`, `run.rank1.json`), in the same
format (its `rank` and `world_size` fields say whose it is).

The synthetic data (`--images` JPEGs, 640×480) is generated once and cached in
`--data` (default: this user's private cache, `$XDG_CACHE_HOME/poolloader/
coco-like-seed<S>-n<N>`, checked against its manifest before each use; see
`fixtures/cache.py`).

Example:
    python examples/train_detector.py --loader pool --workers 2 --steps 60
    python examples/train_detector.py --loader torch --workers 2 --steps 60
    torchrun --standalone --nproc_per_node=2 examples/train_detector.py --loader pool --json run.json
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

# The data generator lives in the repository's fixtures/ (not installed with the package).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fixtures.synthetic import CATEGORIES, CocoLikeDataset, cached_coco_like  # noqa: E402
from poolloader import DetectionCollate, PackedTargets, PoolLoader  # noqa: E402

LOADERS = {"torch": DataLoader, "pool": PoolLoader}
NUM_CLASSES = len(CATEGORIES)
NO_OBJECT_WEIGHT = 0.1
BOX_WEIGHT = 5.0


# ---------------------------------------------------------------------------
# data

def label_lookup() -> torch.Tensor:
    """COCO-style category id -> contiguous class index (0..NUM_CLASSES-1)."""
    table = torch.full((max(cid for cid, _ in CATEGORIES) + 1,), -1, dtype=torch.int64)
    for i, (cid, _) in enumerate(CATEGORIES):
        table[cid] = i
    return table


# ---------------------------------------------------------------------------
# model

def conv_block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class TinyDetector(nn.Module):
    """Stride-16 conv backbone + learned queries attending over the feature map."""

    def __init__(self, num_classes: int = NUM_CLASSES, queries: int = 24, width: int = 64,
                 dim: int = 96):
        super().__init__()
        self.backbone = nn.Sequential(conv_block(3, 16), conv_block(16, 32),
                                      conv_block(32, width), conv_block(width, width))
        self.key = nn.Linear(width + 2, dim)
        self.value = nn.Linear(width + 2, dim)
        self.queries = nn.Parameter(torch.randn(queries, dim) * 0.1)
        self.mlp = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(inplace=True),
                                 nn.Linear(dim, dim), nn.ReLU(inplace=True))
        self.box = nn.Linear(dim, 4)
        self.cls = nn.Linear(dim, num_classes + 1)  # last: no object

    def forward(self, images: torch.Tensor, mask: torch.Tensor):
        feat = self.backbone(images)                                    # [B, C, h, w]
        b, _, h, w = feat.shape
        ys = (torch.arange(h, dtype=feat.dtype, device=feat.device) + 0.5) / h
        xs = (torch.arange(w, dtype=feat.dtype, device=feat.device) + 0.5) / w
        grid = torch.stack(torch.meshgrid(xs, ys, indexing="xy"), 0)    # [2, h, w]: x, y
        feat = torch.cat([feat, grid.expand(b, 2, h, w)], 1).flatten(2).transpose(1, 2)
        keys, values = self.key(feat), self.value(feat)                  # [B, hw, D]
        logits = torch.einsum("qd,bnd->bqn", self.queries, keys) / math.sqrt(keys.shape[-1])
        # Padding (mask True) at feature resolution: a cell is padding if all of it is.
        pad = F.adaptive_max_pool2d((~mask).unsqueeze(1).float(), (h, w)).flatten(1) == 0
        logits = logits.masked_fill(pad.unsqueeze(1), float("-inf"))
        hidden = torch.einsum("bqn,bnd->bqd", logits.softmax(-1), values) + self.queries
        hidden = self.mlp(hidden)
        return self.box(hidden).sigmoid(), self.cls(hidden)             # [B,Q,4], [B,Q,K+1]


# ---------------------------------------------------------------------------
# loss

@torch.no_grad()
def greedy_match(pred_boxes: torch.Tensor, pred_prob: torch.Tensor, boxes: torch.Tensor,
                 labels: torch.Tensor):
    """(query indices, target indices): cheapest pair first, each used once.

    Cost of (query, box): L1 distance of the boxes minus the query's
    probability of the box's class. At most min(queries, boxes) pairs.
    """
    n = boxes.shape[0]
    if n == 0:
        empty = torch.zeros(0, dtype=torch.int64, device=pred_boxes.device)
        return empty, empty
    cost = torch.cdist(pred_boxes, boxes, p=1) - pred_prob[:, labels]    # [Q, n]
    queries, targets = [], []
    for _ in range(min(cost.shape)):
        flat = int(torch.argmin(cost))
        q, t = divmod(flat, n)
        queries.append(q)
        targets.append(t)
        cost[q, :] = float("inf")
        cost[:, t] = float("inf")
    device = pred_boxes.device
    return torch.tensor(queries, device=device), torch.tensor(targets, device=device)


def detection_loss(pred_boxes, pred_logits, targets, lookup):
    """Cross-entropy over all queries + BOX_WEIGHT × L1 over matched boxes.

    `targets`: per-image dicts on the model's device; `lookup` maps category
    ids to class indices (same device)."""
    b, q, k1 = pred_logits.shape
    device = pred_logits.device
    class_weight = torch.ones(k1, device=device)
    class_weight[-1] = NO_OBJECT_WEIGHT
    target_classes = torch.full((b, q), k1 - 1, dtype=torch.int64, device=device)
    prob = pred_logits.detach().softmax(-1)
    matched_pred, matched_gt = [], []
    for i, target in enumerate(targets):
        boxes = target["boxes"]
        labels = lookup[target["labels"]]
        qi, ti = greedy_match(pred_boxes[i].detach(), prob[i], boxes, labels)
        target_classes[i, qi] = labels[ti]
        matched_pred.append(pred_boxes[i, qi])
        matched_gt.append(boxes[ti])
    ce = F.cross_entropy(pred_logits.reshape(b * q, k1), target_classes.reshape(-1),
                         weight=class_weight)
    pred = torch.cat(matched_pred)
    if pred.shape[0]:
        l1 = F.l1_loss(pred, torch.cat(matched_gt), reduction="sum") / pred.shape[0]
    else:
        l1 = pred_boxes.sum() * 0.0
    return ce + BOX_WEIGHT * l1


def targets_on(targets, device, non_blocking: bool) -> list[dict]:
    """Per-image target dicts on `device` (views of the packed fields on CPU)."""
    if isinstance(targets, PackedTargets):
        if device.type != "cpu":
            targets = targets.to(device, non_blocking=non_blocking)  # one copy per field
        return targets.as_list()
    if device.type == "cpu":
        return list(targets)
    return [{k: v.to(device, non_blocking=non_blocking) for k, v in t.items()} for t in targets]


def image_ids(targets) -> list[int]:
    """The batch's image ids, read on the CPU before any copy: which images a rank read."""
    if isinstance(targets, PackedTargets):
        return targets.fields["image_id"].flatten().tolist()
    return [int(t["image_id"]) for t in targets]


# ---------------------------------------------------------------------------
# training

def curve_summary(losses: list[float]) -> dict:
    k = max(1, len(losses) // 10)
    marks = sorted({round(i * (len(losses) - 1) / 9) for i in range(10)}) if losses else []
    return {
        "first": losses[0], "last": losses[-1], "min": min(losses),
        f"mean_first_{k}": statistics.fmean(losses[:k]),
        f"mean_last_{k}": statistics.fmean(losses[-k:]),
        "at_steps": {str(i + 1): round(losses[i], 4) for i in marks},
    }


def progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="step", dynamic_ncols=True, file=sys.stderr)


class Ranks:
    """Where this process stands in a torchrun job: rank, world size, local rank.

    `Ranks.from_environment()` is one process (rank 0 of 1, not distributed)
    unless torchrun's variables are set."""

    def __init__(self, rank: int = 0, world_size: int = 1, local_rank: int = 0,
                 distributed: bool = False):
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.distributed = distributed

    @classmethod
    def from_environment(cls, environ=os.environ) -> Ranks:
        if "RANK" not in environ or "WORLD_SIZE" not in environ:
            return cls()
        return cls(int(environ["RANK"]), int(environ["WORLD_SIZE"]),
                   int(environ.get("LOCAL_RANK", "0")), distributed=True)

    def device(self, name: str) -> torch.device:
        """`--device`; under torchrun a bare `cuda` is this rank's GPU, cuda:LOCAL_RANK."""
        device = torch.device(name)
        if self.distributed and device.type == "cuda" and device.index is None:
            device = torch.device("cuda", self.local_rank)
        return device

    def join(self, device: torch.device) -> None:
        """Join the job's process group (env:// rendezvous: MASTER_ADDR, MASTER_PORT):
        nccl on this rank's GPU, gloo on the CPU. Blocks until every rank has joined."""
        if device.type == "cuda":
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")

    def json_path(self, path: str) -> str:
        """`path` for this rank: `.rank<R>` before the extension under torchrun."""
        if not self.distributed:
            return path
        stem, ext = os.path.splitext(path)
        return f"{stem}.rank{self.rank}{ext}"


def prepare_data(args, ranks: Ranks) -> tuple[str, str]:
    """The data set's (root, annotations); under torchrun local rank 0 generates it
    (or checks the cached copy) while the others wait, then they check it too."""
    if ranks.distributed and ranks.local_rank != 0:
        dist.barrier()
    found = cached_coco_like(args.images, args.seed, args.data)
    if ranks.distributed and ranks.local_rank == 0:
        dist.barrier()
    return found


def train(args, ranks: Ranks | None = None) -> dict:
    ranks = Ranks() if ranks is None else ranks
    device = ranks.device(args.device)
    torch.set_num_threads(args.threads)
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    # On the CPU every op used here has a deterministic kernel; elsewhere warn only.
    torch.use_deterministic_algorithms(True, warn_only=device.type != "cpu")

    root, ann = prepare_data(args, ranks)
    multiscale = [int(s) for s in args.multiscale.split(",")] if args.multiscale else None
    dataset = CocoLikeDataset(root, ann, resolution=args.resolution, multiscale=multiscale,
                              augment=True)

    # Under torchrun each rank reads its share, reshuffled each epoch (set_epoch below).
    sampler = (DistributedSampler(dataset, num_replicas=ranks.world_size, rank=ranks.rank,
                                  shuffle=True, seed=args.seed)
               if ranks.distributed else None)
    # The only difference between the arms: the class.
    loader_cls = LOADERS[args.loader]
    loader = loader_cls(
        dataset, batch_size=args.batch_size, shuffle=sampler is None, sampler=sampler,
        num_workers=args.workers,
        collate_fn=DetectionCollate(pack=args.pack_targets), pin_memory=args.pin_memory,
        drop_last=True, persistent_workers=args.persistent_workers and args.workers > 0,
        generator=torch.Generator().manual_seed(args.seed + ranks.rank),
        prefetch_factor=args.prefetch_factor if args.workers > 0 else None)
    if len(loader) == 0:
        raise SystemExit(f"--images {args.images} gives no full batch of --batch-size {args.batch_size}")
    steps = args.steps if args.steps else args.epochs * len(loader)

    torch.manual_seed(args.seed)
    model = TinyDetector(queries=args.queries).to(device)
    model.train()
    if ranks.distributed:  # averages gradients across ranks in backward()
        model = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    lookup = label_lookup().to(device)

    losses, next_s, step_end, seen = [], [], [], []
    stats = None
    worker_pids: set[int] = set()
    bar = progress(steps, args.progress and ranks.rank == 0)
    start = time.perf_counter()
    epoch = 0
    try:
        while len(losses) < steps:
            if sampler is not None:
                sampler.set_epoch(epoch)
            it = iter(loader)
            # a PoolLoader's worker processes (with --node-pool, the node's: the same on
            # every local rank); none for DataLoader
            worker_pids.update(getattr(it, "worker_pids", ()))
            while len(losses) < steps:
                t0 = time.perf_counter()
                try:
                    images, mask, targets = next(it)
                except StopIteration:
                    break
                next_s.append(time.perf_counter() - t0)
                seen.append(image_ids(targets))
                images = images.to(device, non_blocking=args.pin_memory)
                mask = mask.to(device, non_blocking=args.pin_memory)
                targets = targets_on(targets, device, args.pin_memory)

                pred_boxes, pred_logits = model(images, mask)
                loss = detection_loss(pred_boxes, pred_logits, targets, lookup)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                losses.append(loss.detach().item())
                step_end.append(time.perf_counter())
                # Drop the batch before the next next(): PoolLoader reuses its slot.
                del images, mask, targets, pred_boxes, pred_logits, loss
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{losses[-1]:.3f}", epoch=epoch)
            epoch += 1
            if len(losses) >= steps and isinstance(loader, PoolLoader):
                stats = loader.stats.as_dict()  # before shutdown: pool fields read 0 after
            del it
    finally:
        if bar is not None:
            bar.close()
        wall = time.perf_counter() - start
        del loader  # shuts down workers (persistent ones too)
        gc.collect()

    warm = min(args.warmup_steps, len(losses) - 1)
    steady_wall = step_end[-1] - step_end[warm - 1] if warm > 0 else wall
    steady_wait = sum(next_s[warm:])
    result = {
        "loader": args.loader,
        "rank": ranks.rank,
        "world_size": ranks.world_size,
        "config": {k: v for k, v in vars(args).items() if k not in ("json",)},
        "data": root,
        "steps": len(losses),
        "epochs_started": epoch,
        "images_per_step": args.batch_size,
        "wall_s": wall,
        "img_per_s": len(losses) * args.batch_size / wall,
        "data_wait_s": sum(next_s),
        "data_wait_share": sum(next_s) / wall,
        "warmup_steps": warm,
        "steady_img_per_s": (len(losses) - warm) * args.batch_size / steady_wall,
        "steady_data_wait_share": steady_wait / steady_wall,
        "next_ms_median": statistics.median(next_s) * 1e3,
        "final_loss": losses[-1],
        "loss_curve": curve_summary(losses),
        "losses": losses,
        "image_ids": seen,
        "loader_stats": stats,
        "pid": os.getpid(),
        "worker_pids": sorted(worker_pids),
        "torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
    }
    return result


def report(result: dict) -> str:
    curve = result["loss_curve"]
    rank = f"rank {result['rank']}/{result['world_size']}: " if result["world_size"] > 1 else ""
    lines = [
        f"{rank}loader {result['loader']}: {result['steps']} steps × {result['images_per_step']} images "
        f"in {result['wall_s']:.2f} s",
        f"  img/s                 {result['img_per_s']:.1f} (after {result['warmup_steps']} warm-up "
        f"steps: {result['steady_img_per_s']:.1f})",
        f"  waiting for data      {100 * result['data_wait_share']:.1f}% of wall time "
        f"(after warm-up: {100 * result['steady_data_wait_share']:.1f}%), "
        f"median next() {result['next_ms_median']:.2f} ms",
        f"  final loss            {result['final_loss']:.6f}",
        "  loss curve            " + ", ".join(f"{k} {v:.4f}" for k, v in curve.items()
                                               if k != "at_steps"),
        "  loss by step          " + "  ".join(f"{s}:{v:.3f}" for s, v in curve["at_steps"].items()),
    ]
    if result["loader_stats"] is not None:
        lines.append(f"  loader.stats          {result['loader_stats']}")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loader", choices=sorted(LOADERS), default="pool")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--pin-memory", action="store_true")
    p.add_argument("--pack-targets", action="store_true",
                   help="DetectionCollate(pack=True): one tensor per target field")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 60 "
                   "unless --epochs is given); runs as many epochs as it takes")
    p.add_argument("--epochs", type=int, default=None, help="full epochs (when --steps is not given)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--resolution", type=int, default=256, help="square training size")
    p.add_argument("--multiscale", default=None,
                   help="comma-separated sizes chosen per image (padding + mask in play)")
    p.add_argument("--images", type=int, default=64, help="synthetic images to generate")
    p.add_argument("--data", default=None,
                   help="data folder (generated if missing or empty; default: the per-user cache)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--queries", type=int, default=24)
    p.add_argument("--threads", type=int, default=1, help="torch threads in the main process")
    p.add_argument("--prefetch-factor", type=int, default=2)
    p.add_argument("--persistent-workers", action="store_true")
    p.add_argument("--warmup-steps", type=int, default=3,
                   help="steps left out of the steady-state img/s (worker start, slot growth)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--json", metavar="PATH", help="write losses and numbers here")
    args = p.parse_args(argv)
    if args.steps is None and args.epochs is None:
        args.steps = 60
    if (args.steps or 0) < 0 or (args.epochs or 0) < 0 or (args.steps == 0 and not args.epochs):
        p.error("--steps / --epochs must be positive")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    ranks = Ranks.from_environment()
    if ranks.distributed:
        ranks.join(ranks.device(args.device))
    try:
        result = train(args, ranks)
    finally:
        if ranks.distributed:
            dist.destroy_process_group()
    # One write (torchrun's `python -u` would make print's text and newline two), so the
    # ranks' reports, on one terminal, do not cut into each other's lines.
    sys.stdout.write(report(result) + "\n")
    sys.stdout.flush()
    if args.json:
        with open(ranks.json_path(args.json), "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return result


if __name__ == "__main__":
    main()
