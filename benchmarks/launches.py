"""How the benchmarks launch the example scripts: one tiny launch of every script that runs distributed, and a launch
with a deadline. The command lines and the environment are the tests' (tests/support/launching.py).
"""
import os
import re
import signal
import subprocess
import threading
import time

import numpy as np

from tests.support.launching import (ABORT_MARKERS, BIN, REPO, clean_env, mpi_env, mpirun_cmd,  # noqa: F401
                                     python_cmd, torchrun_cmd, write_idx)


def tiny_mnist(directory):
    """Random 28x28 digits in the MNIST IDX format: enough for train.py to start, train and exit."""
    rng = np.random.default_rng(0)
    os.makedirs(directory, exist_ok=True)
    for split, count in (("train", 256), ("t10k", 64)):
        write_idx(os.path.join(directory, f"{split}-images-idx3-ubyte"),
                  rng.integers(0, 256, (count, 28, 28), dtype=np.uint8))
        write_idx(os.path.join(directory, f"{split}-labels-idx1-ubyte"), rng.integers(0, 10, count).astype(np.uint8))


EPOCH = r"\bEpoch \d"
TABLE = r"^Collectives on"
# One tiny job of every script that starts processes or a process group, under each launcher it is made
# for: name -> (command builder, arguments ({tmp}: a fresh working folder), the first line that reports
# finished training work). Two CPU processes wherever a script runs several.
LAUNCHES = {
    "singlegpu.py": (python_cmd, "--total_epochs 1 --save_every 1", EPOCH),
    "multigpu.py": (python_cmd, "--total_epochs 1 --save_every 1 --world_size 2 --backend gloo", EPOCH),
    "multigpu_torchrun.py": (torchrun_cmd, "--total_epochs 1 --save_every 1", EPOCH),
    "multinode.py": (torchrun_cmd, "--total_epochs 1 --save_every 1", EPOCH),
    "torchrun_ddp.py": (torchrun_cmd, "--epochs 1 --save_every 1 --snapshot_path {tmp}/snapshot.pt", EPOCH),
    "by_feature/powersgd_with_zero.py": (torchrun_cmd, "--epochs 1 --save_every 1 --snapshot_path {tmp}/snapshot.pt "
                                                       "--comm_hook powersgd", EPOCH),
    "fsdp.py": (torchrun_cmd, "--total_epochs 1 --save_every 1 --async_save --snapshot_path {tmp}/checkpoints", EPOCH),
    "ddp.py": (python_cmd, "--backend gloo --epochs 1 --world_size 2", EPOCH),
    "run_with_torchrun.py": (torchrun_cmd, "", TABLE),
    "run_with_python.py": (python_cmd, "--world_size 2", TABLE),
    "run_with_mpirun.py": (mpirun_cmd, "", TABLE),
    "run_with_mpirun.py --train": (mpirun_cmd, "--train --total_epochs 1 --save_every 1", EPOCH),
    "train.py": (torchrun_cmd, "--data_dir {tmp}/mnist --output_dir {tmp}/out --max_steps 2 --logging_steps 1 "
                               "--eval_strategy no --save_strategy no", r"'loss'"),
    "train.py (mpirun)": (mpirun_cmd, "--data_dir {tmp}/mnist --output_dir {tmp}/out --max_steps 2 "
                                      "--logging_steps 1 --eval_strategy no --save_strategy no", r"'loss'"),
    "benchmarks/allreduce.py": (torchrun_cmd, "--quick --max_size 4K --out {tmp}", r"^Peak busbw"),
    "benchmarks/allreduce.py (mpirun)": (mpirun_cmd, "--quick --max_size 4K --out {tmp}", r"^Peak busbw"),
    "benchmarks/scaling.py": (python_cmd, "--quick --models mlp --world_sizes 1 2 --out {tmp}", r"^Wrote"),
}


def script_of(name):
    return name.split()[0]


def launch_argv(name, tmp):
    """The command line of LAUNCHES[name] with its working folder `tmp` (made ready for it)."""
    command, arguments, _ = LAUNCHES[name]
    if "{tmp}/mnist" in arguments:
        tiny_mnist(os.path.join(tmp, "mnist"))
    return [str(part) for part in command(script_of(name), *arguments.format(tmp=tmp).split())]


def launch_env(name):
    return mpi_env(HF_HUB_OFFLINE=1) if LAUNCHES[name][0] is mpirun_cmd else clean_env(HF_HUB_OFFLINE=1)


def launch_once(argv, cwd, env, timeout, progress=None):
    """Run a launch to its end in a session of its own: (seconds to the first line matching `progress` or
    None, seconds to exit, exit code, whole output). On a hang, the launcher and every process in its
    session go down together after `timeout` seconds (exit code -9)."""
    lines, first = [], None
    start = time.perf_counter()
    process = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    watchdog = threading.Timer(timeout, os.killpg, (process.pid, signal.SIGKILL))
    watchdog.start()
    try:
        for line in process.stdout:
            if first is None and progress is not None and re.search(progress, line):
                first = time.perf_counter() - start
            lines.append(line)
        process.wait()
    finally:
        watchdog.cancel()
    return first, time.perf_counter() - start, process.returncode, "".join(lines)


def aborted(output):
    """The abort markers found in a launch's output."""
    return [marker for marker in ABORT_MARKERS if marker in output]
