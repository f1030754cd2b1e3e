"""Loose JPEG files vs tar shards, through torch's DataLoader and PoolLoader.

The four arms read the same synthetic COCO-like images (fixtures.synthetic,
640x480 JPEGs) and produce the same batches' structure, RF-DETR style:
`(images [B,3,R,R], padding mask [B,R,R], PackedTargets)` from
`DetectionCollate(pack=True)` at resolution R:

  loose  / DataLoader   CocoLikeDataset (map-style, one file per image, shuffled
                        sampler), batch_size=B, collate_fn=DetectionCollate()
  loose  / PoolLoader   the same, PoolLoader
  shards / DataLoader   webdataset.WebDataset(shard urls, split_by_worker,
                        shardshuffle with a seed).map(DecodeSample(R))
                        .batched(B, DetectionCollate()), batch_size=None
  shards / PoolLoader   the same, PoolLoader

Method: bench/common.py's `interleave` with one cell and the four arms: every
repetition runs the four arms back to back, in an order rotated from one
repetition to the next (so arms compared ran seconds apart on the same machine
state). Each measurement builds a fresh loader (the shuffle and the shard order
seeded with the repetition, the same for the four arms), pulls
`--warmup-batches` batches untimed (worker start-up, slot growth), then times
the rest of one pass over the data: img/s = images delivered after the warm-up
/ wall time. The table gives median [min–max] over the repetitions, and paired
ratios (per repetition, between arms measured side by side).

The images come from this user's verified cache (fixtures/synthetic.py,
`cached_coco_like(--images, seed 0)`), or `--data DIR/images`. Shards are written
once per run with fixtures.shards.write_shards into a private temporary folder
(or `--data DIR/shards`), sized so each worker gets `--shards-per-worker` shards
(a worker with no shard would be idle, and WebDataset's empty check would fail it).

    python bench/shards.py --quick          # ~1-2 min on 2 cores
    python bench/shards.py                  # longer, more images and repetitions
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import procs  # noqa: E402
import torch  # noqa: E402
import workload  # noqa: E402
import writers  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from fixtures.shards import DecodeSample, shard_urls, write_shards  # noqa: E402
from fixtures.synthetic import CocoLikeDataset  # noqa: E402
from poolloader import DetectionCollate, PoolLoader  # noqa: E402

NAME = "shards"
ARMS = [("loose", "DataLoader"), ("loose", "PoolLoader"),
        ("shards", "DataLoader"), ("shards", "PoolLoader")]
ARM_KEYS = [f"{source}/{cls}" for source, cls in ARMS]


def parse_args(argv=None):
    p = common.parser(NAME, __doc__, reps=(5, 3), warmup_reps=(0, 0))
    p.add_argument("--images", type=int, help="images in the data set (quick 192, default 384)")
    p.add_argument("--batch", type=int, help="batch size (quick 8, default 16)")
    p.add_argument("--resolution", type=int, default=576)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--warmup-batches", type=int, help="untimed batches per measurement "
                   "(default: 2 x workers)")
    p.add_argument("--shards-per-worker", type=int, default=4)
    p.add_argument("--data", help="directory for the images and shards (default: the per-user "
                   "image cache and a temporary folder for the shards)")
    args = common.parse(p, argv)
    args.images = args.images or (192 if args.quick else 384)
    args.batch = args.batch or (8 if args.quick else 16)
    args.warmup_batches = (args.warmup_batches if args.warmup_batches is not None
                           else 2 * args.workers)
    return args


def prepare(args, base):
    t0 = time.perf_counter()
    root, ann = workload.coco_like_data(args.images, 0,
                                        os.path.join(args.data, "images") if args.data else None)
    print(f"{args.images} JPEGs ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    total = sum(os.path.getsize(os.path.join(root, f)) for f in os.listdir(root)
                if f.endswith(".jpg"))
    nshards = args.workers * args.shards_per_worker
    out = os.path.join(base, "shards")
    shard_bytes = total // nshards + 1
    while True:  # the smallest size (in 2% steps) that gives at most nshards shards
        index = write_shards(root, ann, out, split="train", shard_bytes=shard_bytes)
        if len(index["shards"]) <= nshards:
            break
        shard_bytes = int(shard_bytes * 1.02) + 1
    counts = [s["num_samples"] for s in index["shards"]]
    print(f"{len(counts)} shards of {min(counts)}-{max(counts)} samples "
          f"({shard_bytes / 1e6:.2f} MB each at most)", file=sys.stderr)
    return root, ann, shard_urls(out), counts


def make_loader(args, arm, root, ann, urls, rep):
    """The loader of `arm`, its shuffle (loose) or shard order (shards) seeded by `rep`
    (warm-up repetitions, whose `rep` is negative, get seeds from 10000 up)."""
    source, cls_name = arm.split("/")
    rep = rep if rep >= 0 else 10_000 - rep
    cls = PoolLoader if cls_name == "PoolLoader" else DataLoader
    collate = DetectionCollate(pack=True)
    if source == "loose":
        dataset = CocoLikeDataset(root, ann, resolution=args.resolution)
        gen = torch.Generator().manual_seed(rep)
        return cls(dataset, batch_size=args.batch, shuffle=True, generator=gen,
                   num_workers=args.workers, collate_fn=collate)
    import webdataset as wds

    pipeline = (wds.WebDataset(urls, shardshuffle=len(urls), seed=rep,
                               nodesplitter=wds.single_node_only,
                               workersplitter=wds.split_by_worker)
                .map(DecodeSample(resolution=args.resolution))
                .batched(args.batch, collation_fn=collate))
    return cls(pipeline, batch_size=None, num_workers=args.workers)


def measure(args, arm, root, ann, urls, rep):
    loader = make_loader(args, arm, root, ann, urls, rep)
    it = iter(loader)
    procs.note_workers(it)
    images = batches = 0
    try:
        for _ in range(args.warmup_batches):
            batch = next(it)
            del batch
        t0 = time.perf_counter()
        for batch in it:
            images += batch[0].shape[0]
            batches += 1
            del batch
        elapsed = time.perf_counter() - t0
    finally:
        workload.shutdown_iterator(it)
        del it, loader
        left = procs.wait_clean()
        if left:
            raise RuntimeError(f"left behind after the measurement: {left}")
    return {"img_s": images / elapsed, "images": images, "batches": batches, "seconds": elapsed}


def render(raw, args, counts, load, wall) -> str:
    cell = raw.cells[0]
    rows = []
    for key in ARM_KEYS:
        source, cls_name = key.split("/")
        vs_dl = (common.ratio_text(raw, cell, key, f"{source}/DataLoader", "img_s")
                 if cls_name == "PoolLoader" else "—")
        vs_loose = (common.ratio_text(raw, cell, key, f"loose/{cls_name}", "img_s")
                    if source == "shards" else "—")
        rows.append([source, cls_name, common.cell_text(raw, cell, key, "img_s"), vs_dl, vs_loose])
    head = (f"Loose JPEGs vs tar shards, {args.images} synthetic 640x480 JPEGs -> "
            f"{args.resolution}², batch {args.batch}, {args.workers} workers, "
            f"DetectionCollate(pack=True); {len(counts)} shards ({min(counts)}-{max(counts)} "
            f"samples); {args.reps} interleaved repetitions, {args.warmup_batches} warm-up "
            f"batches excluded; median [min–max].")
    table = writers.markdown_table(
        ["input", "loader", "img/s", "PoolLoader / DataLoader", "shards / loose"], rows, "llrrr")
    tail = (f"{writers.env_line()}, load average {load[0]:.1f} -> {load[1]:.1f}; "
            f"total {wall:.0f} s.")
    return f"### {NAME}\n\n{head}\n\n{table}\n\n{tail}\n"


def main(argv=None):
    args = parse_args(argv)
    try:
        import webdataset  # noqa: F401
    except ImportError:
        sys.exit("bench/shards.py needs webdataset: pip install 'poolloader[webdataset]'")
    base = args.data or tempfile.mkdtemp(prefix="poolloader-shards-bench-")
    os.makedirs(base, exist_ok=True)
    t_start = time.perf_counter()
    load_start = os.getloadavg()[0]
    try:
        root, ann, urls, counts = prepare(args, base)
        raw = common.interleave(
            ["all"], ARM_KEYS, lambda cell, arm, rep: measure(args, arm, root, ann, urls, rep),
            reps=args.reps, warmup_reps=args.warmup_reps, label=NAME,
            show=lambda m: f"{m['img_s']:7.1f} img/s ({m['images']} images in {m['seconds']:.2f} s)")
    finally:
        if not args.data:
            shutil.rmtree(base, ignore_errors=True)
    text = render(raw, args, counts, (load_start, os.getloadavg()[0]),
                  time.perf_counter() - t_start)
    writers.write_outputs(args, text, {"shard_counts": counts, "raw": raw.as_json(),
                                       "summary": common.summaries(raw, ["img_s"])})


if __name__ == "__main__":
    main()
