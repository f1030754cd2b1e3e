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

Method: every repetition runs the four arms back to back, in an order rotated
from one repetition to the next (interleaved, so arms compared ran seconds apart
on the same machine state). Each measurement builds a fresh loader, pulls
`--warmup-batches` batches untimed (worker start-up, slot growth), then times
the rest of one pass over the data: img/s = images delivered after the warm-up
/ wall time. The table gives median [min-max] over the repetitions, and paired
ratios (per repetition, between arms measured side by side).

Shards are written once per run with fixtures.shards.write_shards, sized so
each worker gets `--shards-per-worker` shards (a worker with no shard would be
idle, and WebDataset's empty check would fail it).

    python bench/shards.py --quick          # ~1-2 min on 2 cores
    python bench/shards.py                  # longer, more images and repetitions
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import torch
from torch.utils.data import DataLoader

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from poolloader import DetectionCollate, PoolLoader  # noqa: E402
from fixtures.shards import DecodeSample, shard_urls, write_shards  # noqa: E402
from fixtures.synthetic import CocoLikeDataset, make_coco_like  # noqa: E402

ARMS = [("loose", "DataLoader"), ("loose", "PoolLoader"),
        ("shards", "DataLoader"), ("shards", "PoolLoader")]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small run, about 1-2 minutes on 2 cores")
    p.add_argument("--images", type=int, help="images in the data set (quick 192, default 384)")
    p.add_argument("--batch", type=int, help="batch size (quick 8, default 16)")
    p.add_argument("--resolution", type=int, default=576)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--reps", type=int, help="timed repetitions (quick 3, default 5)")
    p.add_argument("--warmup-batches", type=int, help="untimed batches per measurement "
                   "(default: 2 x workers)")
    p.add_argument("--shards-per-worker", type=int, default=4)
    p.add_argument("--data", help="directory for the images and shards (default: a temporary one)")
    p.add_argument("--json", help="write the raw numbers here")
    p.add_argument("--markdown", help="write the table here")
    args = p.parse_args(argv)
    args.images = args.images or (192 if args.quick else 384)
    args.batch = args.batch or (8 if args.quick else 16)
    args.reps = args.reps or (3 if args.quick else 5)
    args.warmup_batches = (args.warmup_batches if args.warmup_batches is not None
                           else 2 * args.workers)
    return args


def prepare(args, base):
    root = os.path.join(base, "images")
    ann = os.path.join(root, "annotations.json")
    if not os.path.exists(ann):
        t0 = time.perf_counter()
        make_coco_like(root, args.images, seed=0, size=(640, 480))
        print(f"wrote {args.images} JPEGs in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
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
    source, cls_name = arm
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
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        del it, loader
        gc.collect()
    return {"img_s": images / elapsed, "images": images, "batches": batches, "seconds": elapsed}


def summary(values):
    return statistics.median(values), min(values), max(values)


def fmt(values, spec):
    med, lo, hi = summary(values)
    return f"{med:{spec}} [{lo:{spec}}–{hi:{spec}}]"


def main(argv=None):
    args = parse_args(argv)
    try:
        import webdataset  # noqa: F401
    except ImportError:
        sys.exit("bench/shards.py needs webdataset: pip install 'poolloader[webdataset]'")
    base = args.data or tempfile.mkdtemp(prefix="poolloader-shards-bench-")
    os.makedirs(base, exist_ok=True)
    t_start = time.perf_counter()
    load_start = os.getloadavg()
    try:
        root, ann, urls, counts = prepare(args, base)
        raw = {f"{s}/{c}": [] for s, c in ARMS}
        for rep in range(args.reps):
            order = ARMS[rep % len(ARMS):] + ARMS[:rep % len(ARMS)]
            for arm in order:
                m = measure(args, arm, root, ann, urls, rep)
                raw[f"{arm[0]}/{arm[1]}"].append(m)
                print(f"rep {rep} {arm[0]:6s} {arm[1]:10s} {m['img_s']:7.1f} img/s "
                      f"({m['images']} images in {m['seconds']:.2f} s)", file=sys.stderr)
    finally:
        if not args.data:
            shutil.rmtree(base, ignore_errors=True)
    load_end = os.getloadavg()

    def ips(key):
        return [m["img_s"] for m in raw[key]]

    def paired(num, den):
        return [a / b for a, b in zip(ips(num), ips(den))]

    lines = [
        f"Loose JPEGs vs tar shards, {args.images} synthetic 640x480 JPEGs -> {args.resolution}², "
        f"batch {args.batch}, {args.workers} workers, DetectionCollate(pack=True); "
        f"{len(counts)} shards ({min(counts)}-{max(counts)} samples); "
        f"{args.reps} interleaved repetitions, {args.warmup_batches} warm-up batches excluded; "
        f"median [min–max].",
        "",
        "| input | loader | img/s | PoolLoader / DataLoader | shards / loose |",
        "|---|---|---|---|---|",
    ]
    for source, cls_name in ARMS:
        key = f"{source}/{cls_name}"
        vs_dl = (fmt(paired(key, f"{source}/DataLoader"), ".2f") + "x"
                 if cls_name == "PoolLoader" else "—")
        vs_loose = (fmt(paired(key, f"loose/{cls_name}"), ".2f") + "x"
                    if source == "shards" else "—")
        lines.append(f"| {source} | {cls_name} | {fmt(ips(key), '.1f')} | {vs_dl} | {vs_loose} |")
    lines += ["", f"{platform.python_implementation()} {platform.python_version()}, torch "
              f"{torch.__version__}, {os.cpu_count()} CPUs, load average "
              f"{load_start[0]:.1f} -> {load_end[0]:.1f}; total {time.perf_counter() - t_start:.0f} s."]
    table = "\n".join(lines)
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "shard_counts": counts, "raw": raw,
                       "loadavg": [load_start, load_end]}, f, indent=1)


if __name__ == "__main__":
    main()
