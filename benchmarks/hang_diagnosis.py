"""What finding a hung rank costs on the happy path: torch's flight recorder, per training step and per collective.

    python benchmarks/hang_diagnosis.py                       # 5 rounds of the 3 settings, medians; some minutes
    python benchmarks/hang_diagnosis.py --repeats 1 --steps 50 --out /tmp/results     # a smoke test

The diagnosis tool (torchdiagnose: which rank, which collective, which line) reads torch's flight recorder
when a collective stands still; the tool's own cost is benchmarks/diagnose_cost.py's. The flight recorder records
every collective (kind, shapes, Python stack) in a ring buffer. torch 2.13 turns it on by default (2000 entries);
TORCH_FR_BUFFER_SIZE=0 turns it off. Each setting is a torchrun launch of 2 CPU processes running this file's
worker: the tutorial's DDP training step (MLP, batch 32, one gradient all_reduce and one all_gather of 2 numbers
per step, as hangs.py trains), timed over --steps after a warm-up, then --collectives all_reduces of one number,
the collective where a fixed cost per call shows most.
Each figure is the slower rank's: the wall time per call (median over blocks of 20), and the CPU time of the
training thread per call, which the recording adds to and which other processes' load barely changes. The
settings' launches run at the same time, each timed part starting once all are ready, so that they share
whatever else loads the machine alike (on a shared machine the load changes from one minute to the next, by more
than the cost measured here); the result is the median over --repeats such rounds.
TORCH_DISTRIBUTED_DEBUG=DETAIL (a check before every collective) is measured too, for scale: it is a debugging
mode, not for the happy path.
Writes hang_diagnosis.json to --out (default benchmarks/results).
"""
import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file: make the repository importable
from benchmarks import report
from benchmarks.launches import clean_env, torchrun_cmd

SETTINGS = {  # name -> the environment it adds
    "flight recorder on (torch's default, 2000 entries)": {},
    "flight recorder off (TORCH_FR_BUFFER_SIZE=0)": {"TORCH_FR_BUFFER_SIZE": "0"},
    "TORCH_DISTRIBUTED_DEBUG=DETAIL": {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"},
}
ON, OFF, DETAIL = SETTINGS
RESULT = "hang-diagnosis-result:"
BLOCK = 20  # steps or collectives timed together
READY = "HANG_DIAGNOSIS_READY"  # the folder where the launches of a round say they are ready


def worker(args):
    """One launch: every rank times the steps and the collectives; rank 0 prints the slower rank's means."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from torchdiagnose.start import work_around_detail_crash
    from models_and_data import MLP, regression_dataset

    work_around_detail_crash()  # as the tool does: under DETAIL, torch 2.13's DDP crashes with gloo without it
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    x, y = regression_dataset(args.batch_size * 8, seed=rank).tensors
    model = DDP(MLP(input_size=20))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step(i):
        batch = slice((i % 8) * args.batch_size, (i % 8 + 1) * args.batch_size)
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x[batch]), y[batch])
        loss.backward()
        optimizer.step()
        stats = torch.stack([loss.detach(), loss.detach()])
        dist.all_gather([torch.zeros_like(stats) for _ in range(world_size)], stats)

    def blocks(run, count):
        """(wall, CPU) us per call: the wall time as the median over blocks of BLOCK calls (a burst of the
        machine's load spoils a block or two, not the figure), and the CPU time of this thread, the one that
        trains, over all calls (what the recording itself costs; other processes' load barely touches it)."""
        times, cpu = [], time.thread_time()
        for first in range(0, count, BLOCK):
            start = time.perf_counter()
            for i in range(first, min(first + BLOCK, count)):
                run(i)
            times.append((time.perf_counter() - start) / (min(first + BLOCK, count) - first) * 1e6)
        return statistics.median(times), (time.thread_time() - cpu) / count * 1e6

    def all_jobs_ready(stage):
        """Wait for the other settings' launches to reach `stage` too, so that they are timed side by side."""
        folder = Path(os.environ[READY])
        if rank == 0:
            (folder / f"{stage}-{os.getpid()}").touch()
            deadline = time.monotonic() + 600
            while len(list(folder.glob(f"{stage}-*"))) < len(SETTINGS) and time.monotonic() < deadline:
                time.sleep(0.01)
        dist.barrier()

    for i in range(args.warmup):
        step(i)
    all_jobs_ready("steps")
    step_us, step_cpu_us = blocks(step, args.steps)
    one = torch.ones(1)
    all_jobs_ready("collectives")
    collective_us, collective_cpu_us = blocks(lambda i: dist.all_reduce(one), args.collectives)
    figures = report.slowest([step_us, collective_us, step_cpu_us, collective_cpu_us], torch.device("cpu"))
    if rank == 0:
        # One write: under torchrun's -u, print() writes each piece apart and rank 1's lines can land between them.
        sys.stdout.write(" ".join([RESULT, *(f"{x:.3f}" for x in figures)]) + "\n")
        sys.stdout.flush()
    model = optimizer = None  # DDP holds the group: let go of it before destroy_process_group
    dist.destroy_process_group()


def launch_together(args):
    """One launch of every setting at the same time, so that they share the machine's load alike: {setting:
    (us per step, us per all_reduce)}."""
    command = [str(c) for c in torchrun_cmd("benchmarks/hang_diagnosis.py", "--worker", "--steps", str(args.steps),
                                            "--warmup", str(args.warmup), "--collectives", str(args.collectives),
                                            "--batch_size", str(args.batch_size))]
    ready = tempfile.mkdtemp(prefix="hang_diagnosis-")
    jobs = {setting: subprocess.Popen(command, env=clean_env(**extra, **{READY: ready}), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True)
            for setting, extra in SETTINGS.items()}
    results = {}
    for setting, job in jobs.items():
        output, _ = job.communicate(timeout=args.launch_timeout)
        found = re.search(re.escape(RESULT) + r"((?: [0-9.]+){4})$", output, re.MULTILINE)
        if not found:
            raise RuntimeError(f"{setting}: the launch gave no result (exit code {job.returncode}):\n{output[-2000:]}")
        results[setting] = tuple(map(float, found[1].split()))
    shutil.rmtree(ready, ignore_errors=True)
    return results


def main(args):
    if args.worker:
        return worker(args)
    machine = report.machine("gloo", 2)
    print(report.machine_line(machine), flush=True)
    runs = {setting: [] for setting in SETTINGS}
    for repeat in range(args.repeats):
        for setting, figures in launch_together(args).items():
            runs[setting].append(figures)
            print(f"round {repeat + 1}/{args.repeats} | {setting}: {figures[0]:.1f} us/step ({figures[2]:.1f} CPU), "
                  f"{figures[1]:.1f} us per all_reduce of one number ({figures[3]:.1f} CPU)", flush=True)
    results = {}
    names = ("step_us", "all_reduce_us", "step_cpu_us", "all_reduce_cpu_us")
    for setting, values in runs.items():
        results[setting] = {f"{name}_median": statistics.median(v[i] for v in values) for i, name in enumerate(names)}
        results[setting].update({f"{name}_rounds": [v[i] for v in values] for i, name in enumerate(names)})
    on, off = results[ON], results[OFF]
    cost = {}
    for name in names:
        cost[name] = on[f"{name}_median"] - off[f"{name}_median"]
        cost[name.replace("_us", "_percent")] = 100 * (on[f"{name}_median"] / off[f"{name}_median"] - 1)
    rows = [(setting, *(f"{r[f'{name}_median']:.1f}" for name in names)) for setting, r in results.items()]
    print(report.table(("setting", "us/step", "us/all_reduce", "CPU us/step", "CPU us/all_reduce"), rows))
    print(f"Flight recorder cost (medians of {args.repeats} rounds): {cost['step_cpu_us']:+.1f} us of CPU per step "
          f"({cost['step_cpu_percent']:+.1f}%), {cost['all_reduce_cpu_us']:+.1f} us of CPU per collective "
          f"({cost['all_reduce_cpu_percent']:+.1f}%); wall time {cost['step_us']:+.1f} us per step "
          f"({cost['step_percent']:+.1f}%), {cost['all_reduce_us']:+.1f} us per collective "
          f"({cost['all_reduce_percent']:+.1f}%)")
    machine["load_average_after"] = report.machine()["load_average_1_5_15min"]
    data = {**machine, "machine": machine, "command": " ".join(["python", "benchmarks/hang_diagnosis.py",
                                                                *sys.argv[1:]]),
            "steps": args.steps, "warmup": args.warmup, "collectives": args.collectives,
            "batch_size": args.batch_size, "repeats": args.repeats, "results": results,
            "flight_recorder_cost": cost}
    path = report.write_json(Path(args.out) / "hang_diagnosis.json", data)
    print(f"Wrote {path}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="The happy-path cost of the flight recorder (docs/hangs.md).")
    parser.add_argument("--repeats", type=int, default=5, help="rounds of launches (default 5)")
    parser.add_argument("--steps", type=int, default=150, help="timed steps per launch (default 150)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps first (default 20)")
    parser.add_argument("--collectives", type=int, default=1000,
                        help="timed all_reduces of one number per launch (default 1000)")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--launch_timeout", type=float, default=600)
    parser.add_argument("--out", default=str(report.DEFAULT_OUT), help="folder for hang_diagnosis.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one launch's rank
    args = parser.parse_args()
    if min(args.repeats, args.steps, args.warmup, args.collectives, args.batch_size, args.launch_timeout) <= 0:
        parser.error("every count and --launch_timeout must be positive")
    main(args)
