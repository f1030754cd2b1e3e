"""End-to-end training speed: examples/train_detector.py with DataLoader vs PoolLoader.

Each measurement is one run of `examples/train_detector.py` as a subprocess
(a fresh interpreter, so no arm inherits another's warm state or leaks), with
identical arguments except `--loader torch|pool`: real JPEG decoding and
augmentation in the workers, DetectionCollate batches, a small conv detector
trained on the CPU in the main process (`--threads 1`, deterministic). Data:
`--images` synthetic COCO-like JPEGs, generated once before anything is timed.

Reported per cell (targets as dicts or packed × arm), from the script's JSON:
  img/s          images per second of wall time after the script's warm-up
                 steps (worker start and slot growth excluded);
  data wait      share of that wall time spent inside `next()`;
  same losses    whether every run of the cell, both arms, produced the
                 identical per-step loss list (they must: same batches).
Method: bench/common.py's interleave: arms alternate in rotated order per
repetition, medians [min–max] over repetitions, PoolLoader / DataLoader ratios
paired per repetition. On a 2-core machine the workers and the training step
compete for the same cores, so the main-process cost a loader saves goes to
the workers or to the model: that is what this measures.

Usage:
    python bench/train.py [--quick] [--targets dicts,packed] [--steps 40]
                          [--out results/] [--json P] [--markdown P] [--plot P]
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import workload  # noqa: E402
import writers  # noqa: E402

NAME = "train"
SCRIPT = os.path.join(common.REPO, "examples", "train_detector.py")
ARMS = ("DataLoader", "PoolLoader")
LOADER_FLAG = {"DataLoader": "torch", "PoolLoader": "pool"}
METRICS = ("steady_img_per_s", "steady_data_wait_share", "img_per_s", "final_loss")
RUN_TIMEOUT_S = 300


def script_args(args, targets: str) -> list[str]:
    out = ["--steps", str(args.steps), "--images", str(args.images),
           "--resolution", str(args.resolution), "--workers", str(args.workers),
           "--batch-size", str(args.batch_size), "--seed", str(args.seed),
           "--data", args.data, "--persistent-workers", "--no-progress"]
    if targets == "packed":
        out.append("--pack-targets")
    return out


def measure(targets, arm, args, losses) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        out = os.path.join(tmp, "run.json")
        cmd = [sys.executable, SCRIPT, "--loader", LOADER_FLAG[arm], "--json", out,
               *script_args(args, targets)]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=RUN_TIMEOUT_S, cwd=common.REPO)
        if proc.returncode != 0:
            raise RuntimeError(f"exit {proc.returncode}: {proc.stdout.strip()[-500:]}")
        with open(out) as f:
            result = json.load(f)
    losses.setdefault(targets, []).append((arm, result["losses"]))
    return {m: result[m] for m in METRICS}


def same_losses(losses, targets) -> str:
    runs = losses.get(targets, [])
    if len({arm for arm, _ in runs}) < 2:
        return "–"
    return "yes" if all(l == runs[0][1] for _, l in runs) else "NO"


def render(raw, args, losses) -> str:
    rows = []
    for targets in raw.cells:
        rows.append([
            targets,
            common.cell_text(raw, targets, "DataLoader", "steady_img_per_s"),
            common.cell_text(raw, targets, "PoolLoader", "steady_img_per_s"),
            common.ratio_text(raw, targets, "PoolLoader", "DataLoader", "steady_img_per_s"),
            common.cell_text(raw, targets, "DataLoader", "steady_data_wait_share", ".1%"),
            common.cell_text(raw, targets, "PoolLoader", "steady_data_wait_share", ".1%"),
            common.cell_text(raw, targets, "PoolLoader", "final_loss", ".4f"),
            same_losses(losses, targets),
        ])
    head = (f"examples/train_detector.py end to end: {args.steps} steps, batch {args.batch_size}, "
            f"{args.resolution}² JPEG pipeline, {args.workers} workers, persistent workers, "
            f"main process 1 thread; img/s after the script's 3 warm-up steps; {args.reps} "
            f"repetitions (+{args.warmup_reps} warm-up), median [min–max]; ratios paired per "
            f"repetition. {writers.env_line()}.")
    table = writers.markdown_table(
        ["targets", "DataLoader img/s", "PoolLoader img/s", "Pool/DL img/s",
         "DataLoader data wait", "PoolLoader data wait", "final loss", "same losses"], rows)
    return f"### {NAME}\n\n{head}\n\n{table}\n"


def plot(raw, args, losses):
    curves = {}
    for targets, runs in losses.items():
        for arm, values in runs:
            curves.setdefault(f"{arm} ({targets})", values)
    return writers.plot_bars(
        args.plot, list(raw.cells),
        {arm: [common.summarize(raw.series(t, arm, "steady_img_per_s")) for t in raw.cells]
         for arm in ARMS},
        ylabel="training img/s (after warm-up)",
        title=f"train_detector.py, {args.workers} workers, batch {args.batch_size}, "
              f"{args.resolution}²",
        curves=curves, curves_label="loss (first run of each arm: the curves coincide)")


def main(argv=None) -> None:
    p = common.parser(NAME, __doc__)
    p.add_argument("--targets", default=None, help="comma-separated: dicts "
                   "(DetectionCollate(pack=False)), packed (default both; quick dicts)")
    p.add_argument("--steps", type=int, default=None, help="steps per run (100; quick 40)")
    p.add_argument("--images", type=int, default=128)
    p.add_argument("--resolution", type=int, default=256)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None, help="data folder (default: the per-user verified cache)")
    args = common.parse(p, argv)
    args.steps = args.steps or (40 if args.quick else 100)
    args.targets = args.targets or ("dicts" if args.quick else "dicts,packed")
    args.data, _ = workload.coco_like_data(args.images, args.seed, args.data)

    losses: dict = {}
    cells = args.targets.split(",")
    raw = common.interleave(cells, ARMS, lambda t, arm, rep: measure(t, arm, args, losses),
                            reps=args.reps, warmup_reps=args.warmup_reps, label=NAME)
    text = render(raw, args, losses)
    writers.write_outputs(args, text, {
        "raw": raw.as_json(),
        "same_losses": {t: same_losses(losses, t) for t in cells},
        "losses": {t: [{"arm": a, "losses": l} for a, l in runs]
                   for t, runs in losses.items()},
        "summary": common.summaries(raw, METRICS, baseline="DataLoader")})
    if args.plot:
        plot(raw, args, losses)


if __name__ == "__main__":
    main()
