"""What a plan costs the laptop: plan.py's wall time and peak memory (its process's maximum resident set) for
rank 0 of large jobs (target: 8,192 ranks of the 70B shape in under 30 s and 1 GiB).

    python benchmarks/plan_scale.py                 # the 70B and 8B shapes on 8,192 ranks, and 8B on 64
    python benchmarks/plan_scale.py --repeats 3

Each plan is a fresh `python plan.py ...` process (import torch included), timed from its start to its exit;
its memory is the kernel's count of its largest resident set (wait4's ru_maxrss). Writes plan_scale.json to --out
(default benchmarks/results).
"""
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file: make the repository importable
from benchmarks import common, report
from benchmarks.launches import REPO

PLANS = [
    ("70B, 8,192 ranks: pp 8 x dp_shard 128 x tp 8, 16 micro-batches",
     "--model llama3-70b --world_size 8192 --pp 8 --dp_shard 128 --tp 8 --microbatches 16 --seq_len 8192 "
     "--global_batch_size 2048"),
    ("8B, 8,192 ranks: dp_shard 1024 x tp 8",
     "--model llama3-8b --world_size 8192 --dp_shard 1024 --tp 8 --seq_len 8192 --global_batch_size 8192"),
    ("8B, 64 ranks: dp_shard 8 x tp 8",
     "--model llama3-8b --world_size 64 --dp_shard 8 --tp 8 --seq_len 8192 --global_batch_size 64"),
]
TARGET_S, TARGET_BYTES = 30.0, 1 << 30


def main(args):
    machine = report.machine()
    print(report.machine_line(machine), flush=True)
    rows = []
    for name, flags in PLANS:
        runs = []
        for _ in range(args.repeats):
            read, write = os.pipe()
            start = time.perf_counter()
            pid = os.fork()
            if pid == 0:  # the child: plan.py in this process's place, so that wait4 reports its own maximum
                os.close(read)
                os.dup2(write, 1)
                os.chdir(REPO)
                os.execv(sys.executable, [sys.executable, "plan.py", *flags.split()])
            os.close(write)
            with os.fdopen(read) as pipe:
                lines = pipe.read().splitlines()
            _, status, usage = os.wait4(pid, 0)
            seconds = time.perf_counter() - start
            if os.waitstatus_to_exitcode(status) != 0:
                raise common.UsageError(f"plan.py {flags} failed (exit {os.waitstatus_to_exitcode(status)})")
            runs.append((seconds, usage.ru_maxrss * 1024, lines))
        seconds = statistics.median(run[0] for run in runs)
        peak = max(run[1] for run in runs)
        traced = next(line for line in runs[0][2] if line.startswith("Method:"))
        rows.append({"plan": name, "command": f"python plan.py {flags}", "seconds": seconds,
                     "seconds_repeats": [run[0] for run in runs], "max_resident_bytes": peak,
                     "trace_s": float(traced.split(" traced in ")[1].split("s ")[0]),
                     "meets_target": seconds < TARGET_S and peak < TARGET_BYTES, "plan_lines": runs[0][2]})
        print(f"{name}: {seconds:.1f} s, {peak / 2 ** 20:,.0f} MiB", flush=True)
    machine["load_average_after"] = report.machine()["load_average_1_5_15min"]
    print(report.table(["plan", "wall s (median)", "trace s", "max resident MiB", f"< {TARGET_S:.0f} s and 1 GiB"],
                       [[r["plan"], f"{r['seconds']:.1f}", f"{r['trace_s']:.1f}",
                         f"{r['max_resident_bytes'] / 2 ** 20:,.0f}", "yes" if r["meets_target"] else "no"]
                        for r in rows]))
    print(f"Load average after: {', '.join(f'{x:.2f}' for x in machine['load_average_after'])}")
    result = {"benchmark": "plan_scale", "machine": machine, "repeats": args.repeats, "target_s": TARGET_S,
              "target_bytes": TARGET_BYTES, "results": rows}
    print(f"Wrote {report.write_json(Path(args.out) / 'plan_scale.json', result)}")


if __name__ == "__main__":
    parser = common.ArgumentParser(description=__doc__, formatter_class=common.argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=common.positive_int, default=1, help="runs of each plan (median wall)")
    parser.add_argument("--out", default=report.DEFAULT_OUT, help="folder of plan_scale.json")
    common.run(main, parser)
