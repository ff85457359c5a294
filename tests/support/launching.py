"""How the tests and the benchmarks launch the example scripts: a clean environment and the launcher command lines.
The tests' helpers live in tests/ (this folder and conftest.py); the benchmarks import these from here.
"""
import gzip
import os
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
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


def rank_0_env(nproc, **extra):
    """The environment torchrun gives rank 0 of `nproc` processes on this machine. For the checks a script makes
    before its process group: every rank would say the same line, so rank 0 alone, without the launcher and the
    other ranks' start-up (seconds of imports each), says what the whole launch would."""
    return clean_env(**{"RANK": 0, "LOCAL_RANK": 0, "WORLD_SIZE": nproc, "LOCAL_WORLD_SIZE": nproc,
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 29400, **extra})  # extra wins (a free port)


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
