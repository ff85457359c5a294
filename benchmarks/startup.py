"""Launch-to-first-training-step time of every example script on the CPU (target: at most 5 s).

    python benchmarks/startup.py                                   # every script, median of 3 launches
    python benchmarks/startup.py --scripts singlegpu.py multinode.py --repeats 1

Each script is started the way its docstring shows, with its own launcher (python, torchrun, mpirun), 2
CPU processes where it runs several, a tiny job, and a fresh empty working folder (no snapshot or .env
to pick up). The clock runs from the launch to the first line on its output that reports finished
training work (per script below: the first `Epoch N` line, the Trainer's first `'loss'` log, or, for the
two scripts that only run collectives, their result table), and on to the exit. Everything before that
line is the cost of starting: the launcher, `import torch`, process spawning, the rendezvous, building
data and model. A script that does not exist (yet) is reported as missing, not as a failure.
Writes startup.json to --out (default benchmarks/results).
"""
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file: make the repository importable
from benchmarks import report  # noqa: E402
from ddp_common import cli  # noqa: E402
from ddp_common.data import write_idx  # noqa: E402

BIN = Path(sys.executable).parent  # torchrun and mpirun are installed beside this python
EPOCH = r"\bEpoch \d"
TORCHRUN = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2"]
MPIRUN = [str(BIN / "mpirun"), "-np", "2", "--bind-to", "none", sys.executable]
# script: (launcher, arguments ({tmp}: the fresh working folder), the line that marks the first finished work)
SCRIPTS = {
    "singlegpu.py": ([sys.executable], "--total_epochs 1 --save_every 1", EPOCH),
    "multigpu.py": ([sys.executable], "--total_epochs 1 --save_every 1 --world_size 2 --backend gloo", EPOCH),
    "multigpu_torchrun.py": (TORCHRUN, "--total_epochs 1 --save_every 1", EPOCH),
    "multinode.py": (TORCHRUN, "--total_epochs 1 --save_every 1", EPOCH),
    "torchrun_ddp.py": (TORCHRUN, "--epochs 1 --save_every 1 --snapshot_path {tmp}/snapshot.pt", EPOCH),
    "ddp.py": ([sys.executable], "--backend gloo --epochs 1 --world_size 2", EPOCH),
    "run_with_torchrun.py": (TORCHRUN, "", r"^Collectives on"),
    "run_with_python.py": ([sys.executable], "--world_size 2", r"^Collectives on"),
    "run_with_mpirun.py": (MPIRUN, "--train --total_epochs 1 --save_every 1", EPOCH),
    "train.py": (TORCHRUN, "--data_dir {tmp}/mnist --output_dir {tmp}/out --max_steps 2 --logging_steps 1 "
                           "--eval_strategy no --save_strategy no", r"'loss'"),
}
TARGET_S = 5.0


def tiny_mnist(directory):
    """Random 28x28 digits in the MNIST IDX format: train.py's start-up cost without a download."""
    rng = np.random.default_rng(0)
    os.makedirs(directory, exist_ok=True)
    for split, count in (("train", 256), ("t10k", 64)):
        write_idx(os.path.join(directory, f"{split}-images-idx3-ubyte"),
                  rng.integers(0, 256, (count, 28, 28), dtype=np.uint8))
        write_idx(os.path.join(directory, f"{split}-labels-idx1-ubyte"), rng.integers(0, 10, count).astype(np.uint8))


def environment():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith(("OMPI_", "PMIX_", "TORCHELASTIC_"))}
    # Unbuffered, or the first line would only show up when the buffer fills; Open MPI runs as root only
    # when told twice.
    env.update(PYTHONUNBUFFERED="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               HF_HUB_OFFLINE="1")
    return env


def launch_once(argv, cwd, progress, timeout):
    """(seconds to the first progress line or None, seconds to exit, exit code, last lines of output)."""
    lines, first = [], None
    start = time.perf_counter()
    process = subprocess.Popen(argv, cwd=cwd, env=environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    # Its own session: on a hang, the launcher and every rank it started go down together.
    watchdog = threading.Timer(timeout, os.killpg, (process.pid, signal.SIGKILL))
    watchdog.start()
    try:
        for line in process.stdout:
            if first is None and re.search(progress, line):
                first = time.perf_counter() - start
            lines.append(line.rstrip())
        process.wait()
    finally:
        watchdog.cancel()
    if process.returncode == -signal.SIGKILL:
        lines.append(f"(killed after {timeout:.0f} s)")
    return first, time.perf_counter() - start, process.returncode, lines[-5:]


def measure(script, repeats, timeout):
    path = report.REPO / script
    launcher, arguments, progress = SCRIPTS[script]
    row = {"script": script, "command": " ".join([Path(launcher[0]).name, *launcher[1:], script, arguments]).strip()}
    if not path.exists():
        return {**row, "status": "missing"}
    firsts, exits = [], []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            if "{tmp}/mnist" in arguments:
                tiny_mnist(os.path.join(tmp, "mnist"))
            argv = [*launcher, str(path), *arguments.format(tmp=tmp).split()]
            first, total, code, tail = launch_once(argv, tmp, progress, timeout)
        if code != 0 or first is None:
            reason = f"exit code {code}" if code != 0 else "no progress line"
            return {**row, "status": "failed", "reason": reason, "output_tail": tail}
        firsts.append(first)
        exits.append(total)
    first = statistics.median(firsts)
    return {**row, "status": "PASS" if first <= TARGET_S else "MISS", "first_step_s": first,
            "exit_s": statistics.median(exits), "first_step_s_repeats": firsts}


def main(args):
    unknown = [s for s in args.scripts if s not in SCRIPTS]
    if unknown:
        raise cli.UsageError(f"no launch command known for {', '.join(unknown)}; known: {', '.join(SCRIPTS)}")
    machine = report.machine()
    print(report.machine_line(machine), flush=True)
    rows = []
    for script in args.scripts:
        rows.append(measure(script, args.repeats, args.launch_timeout))
        row = rows[-1]
        print(f"{script}: {row['status']}"
              + (f" {row['first_step_s']:.1f} s" if "first_step_s" in row else "")
              + (f" ({row['reason']})" if "reason" in row else ""), flush=True)
    machine["load_average_after"] = report.machine()["load_average_1_5_15min"]
    print(report.table(
        ["script", "first step", "exit", "status", "command"],
        [[r["script"], f"{r['first_step_s']:.1f} s" if "first_step_s" in r else "-",
          f"{r['exit_s']:.1f} s" if "exit_s" in r else "-", r["status"], r["command"]] for r in rows]))
    for r in rows:
        if r["status"] == "failed":
            print(f"{r['script']} failed ({r['reason']}):\n  " + "\n  ".join(r["output_tail"]))
    counts = {s: sum(r["status"] == s for r in rows) for s in ("PASS", "MISS", "missing", "failed")}
    print(f"Target: first training step within {TARGET_S:.0f} s of the launch, median of {args.repeats} | "
          + " | ".join(f"{k} {v}" for k, v in counts.items()) + " | load average after "
          + ", ".join(f"{x:.2f}" for x in machine["load_average_after"]))
    result = {"benchmark": "startup", "machine": machine, "target_s": TARGET_S, "repeats": args.repeats,
              "results": rows}
    print(f"Wrote {report.write_json(args.out / 'startup.json', result)}")
    if counts["failed"]:
        sys.exit(1)


if __name__ == "__main__":
    parser = cli.ArgumentParser(description="Seconds from launching each example script to its first "
                                            "training step, on the CPU.")
    parser.add_argument("--scripts", nargs="+", default=list(SCRIPTS), metavar="SCRIPT",
                        help=f"scripts to launch (default: all of {', '.join(SCRIPTS)})")
    parser.add_argument("--repeats", type=cli.positive_int, default=3, help="launches per script; median reported")
    parser.add_argument("--launch_timeout", type=cli.positive_float, default=300,
                        help="seconds before a launch is killed and counted as failed (default 300)")
    parser.add_argument("--out", type=Path, default=report.DEFAULT_OUT, help="folder for the JSON")
    cli.run(main, parser.parse_args())
