"""What step checkpoints cost: by_feature/step_checkpoints.py's training throughput with a snapshot every N steps,
written in the training thread (sync) or in a thread of its own (--async_save), against none.

    python benchmarks/step_checkpoints.py                          # N = 1, 5, 20, 100; 2 ranks; median of 3
    python benchmarks/step_checkpoints.py --every 1 20 --repeats 1 --epochs 2

Each launch is `torchrun --standalone --nproc_per_node=2 by_feature/step_checkpoints.py` in a fresh folder, its
samples/s read from the summary line (the training loop only, start-up excluded). The cost of one snapshot is
what it adds to the wall time, divided by the snapshots taken: cost_s = (1/throughput - 1/baseline) * samples /
snapshots. The rule the docs give for choosing N follows from it: N steps of work should take at least ~50 times
what a snapshot costs (2% overhead), and no more than what you accept to lose to a crash.
Writes step_checkpoints.json to --out (default benchmarks/results).
"""
import re
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file: make the repository importable
from benchmarks import common, report
from benchmarks.launches import clean_env, launch_once, torchrun_cmd
from benchmarks.common import UsageError

SUMMARY = re.compile(r"^Summary: epochs \d+ \| steps (\d+) \| .* \| samples/s ([\d.]+) \| wall ([\d.]+)s", re.M)
NEVER = 10**9  # --save_every_steps for "no step snapshot": only the epoch ends save


def throughput(args, every, background):
    """(samples/s, steps) of one launch, or raise UsageError with the launch's tail."""
    with tempfile.TemporaryDirectory() as tmp:
        argv = torchrun_cmd("by_feature/step_checkpoints.py", "--epochs", str(args.epochs), "--batch_size",
                            str(args.batch_size), "--save_every_steps", str(every),
                            *(["--async_save"] if background else []), "--snapshot_path", f"{tmp}/snapshot.pt")
        _, _, code, output = launch_once([str(a) for a in argv], tmp, clean_env(), args.launch_timeout)
    match = SUMMARY.search(output)
    if code != 0 or not match:
        raise UsageError(f"step_checkpoints.py --save_every_steps {every} failed (exit code {code}): "
                         f"{output.splitlines()[-3:]}")
    return float(match[2]), int(match[1])


def median_throughput(args, every, background):
    runs = [throughput(args, every, background) for _ in range(args.repeats)]
    return statistics.median(rate for rate, _ in runs), runs[0][1]


def main(args):
    machine = report.machine("gloo", 2)
    samples = args.epochs * 4096
    baseline, steps = median_throughput(args, NEVER, False)
    rows = [{"every_steps": None, "mode": "none", "samples_per_s": baseline, "snapshots": 0, "cost_ms": None,
             "overhead": 0.0}]
    for every in args.every:
        for mode in ("sync", "async"):
            rate, _ = median_throughput(args, every, mode == "async")
            snapshots = steps // every
            cost = (1 / rate - 1 / baseline) * samples / max(snapshots, 1)
            rows.append({"every_steps": every, "mode": mode, "samples_per_s": rate, "snapshots": snapshots,
                         "cost_ms": cost * 1000, "overhead": baseline / rate - 1})
    step_ms = 1000 * samples / baseline / steps
    print(report.machine_line(machine))
    print(f"by_feature/step_checkpoints.py, 2 ranks, batch {args.batch_size} per rank, {args.epochs} epochs of "
          f"{steps // args.epochs} steps | a step takes {step_ms:.2f} ms without snapshots")
    print(report.table(["every N steps", "mode", "samples/s", "snapshots", "ms per snapshot", "overhead"],
                       [[row["every_steps"] or "-", row["mode"], f"{row['samples_per_s']:.0f}", row["snapshots"],
                         "-" if row["cost_ms"] is None else f"{row['cost_ms']:.1f}", f"{row['overhead']:+.0%}"]
                        for row in rows]))
    # The cost of one snapshot from the smallest N, where snapshots are many and their cost stands out of the
    # machine's noise (at large N it is a few percent of the run, within what two launches differ by).
    smallest = min(args.every)
    cost = {row["mode"]: row["cost_ms"] for row in rows if row["every_steps"] == smallest}
    print(f"One snapshot costs {cost['sync']:.1f} ms in the training thread "
          f"({cost['async']:.1f} ms with --async_save), "
          f"measured at N = {smallest}; a step takes {step_ms:.1f} ms. Rule of thumb: N >= 50 x snapshot / step keeps "
          f"the overhead near 2%: N >= {max(1, round(50 * cost['sync'] / step_ms))} here "
          f"({max(1, round(50 * cost['async'] / step_ms))} with --async_save)")
    result = {"benchmark": "step_checkpoints", "machine": machine, "epochs": args.epochs,
              "batch_per_rank": args.batch_size, "world_size": 2, "repeats": args.repeats, "step_ms": step_ms,
              "results": rows, "snapshot_ms": cost, "snapshot_ms_measured_at_every_steps": smallest}
    print(f"Wrote {report.write_json(args.out / 'step_checkpoints.json', result)}")


if __name__ == "__main__":
    parser = common.ArgumentParser(description="Throughput of step_checkpoints.py with a snapshot every N steps.")
    parser.add_argument("--every", nargs="+", type=common.positive_int, default=[1, 5, 20, 100],
                        help="the N of --save_every_steps to measure (default 1 5 20 100)")
    parser.add_argument("--epochs", type=common.positive_int, default=4, help="epochs per launch (default 4)")
    parser.add_argument("--batch_size", type=common.positive_int, default=16,
                        help="samples per step and rank (default 16: 128 steps an epoch)")
    parser.add_argument("--repeats", type=common.positive_int, default=3, help="launches per setting; median reported")
    parser.add_argument("--launch_timeout", type=common.positive_float, default=300,
                        help="seconds a launch may take before it counts as hung")
    parser.add_argument("--out", type=Path, default=report.DEFAULT_OUT, help="where to write the JSON")
    common.run(main, parser)
