"""How the benchmarks and the tests launch the example scripts: a clean environment, the launcher command
lines, one tiny launch of every script that runs distributed, and a launch with a deadline.
"""
import gzip
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent  # torchrun and mpirun are installed beside this python
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# What a process prints when it died in a way its exit code may not show: torchrun, for one, counts a
# worker's SIGABRT after the summary line as the job's failure only sometimes.
ABORT_MARKERS = ("terminate called", "SIGABRT", "Segmentation fault")


def clean_env(**extra):
    """The environment of a fresh shell: no launcher variables leaking in from a surrounding job,
    unbuffered output (or a line would only show up when the buffer fills)."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARIABLES and not k.startswith(("OMPI_", "PMIX_", "TORCHELASTIC_"))}
    env.update(PYTHONUNBUFFERED="1", **{k: str(v) for k, v in extra.items()})
    return env


def mpi_env(**extra):
    """Open MPI runs as root only when told twice."""
    return clean_env(OMPI_ALLOW_RUN_AS_ROOT=1, OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1, **extra)


def python_cmd(script, *args):
    return [sys.executable, REPO / script, *args]


def torchrun_cmd(script, *args, nproc=2, extra=()):
    return [BIN / "torchrun", "--standalone", f"--nproc_per_node={nproc}", *extra, REPO / script, *args]


def mpirun_cmd(script, *args, np_=2):
    """Above 2 ranks on this machine's 2 cores, Open MPI needs --oversubscribe."""
    return [BIN / "mpirun", "-np", str(np_), "--oversubscribe", "--bind-to", "none", sys.executable,
            REPO / script, *args]


def write_idx(path, array):
    """An IDX file of unsigned bytes (gzipped if path ends in .gz), as MNIST's: how tests make MNIST folders."""
    array = np.asarray(array, dtype=np.uint8)
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in array.shape)
    with (gzip.open if path.endswith(".gz") else open)(path, "wb") as f:
        f.write(header + array.tobytes())


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
