"""Helpers for launching the real scripts under their real launchers, in subprocesses."""
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent  # torchrun and mpirun are installed beside this python
# The official MNIST test set's two IDX files, carried in the repository (tests/data/mnist/README.md says
# where they come from); MNIST_DIR points at another copy.
MNIST = Path(os.environ.get("MNIST_DIR", REPO / "tests" / "data" / "mnist"))
sys.path.insert(0, str(REPO))


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def clean_env(**extra):
    """The environment of a fresh shell: no launcher variables leaking in from a surrounding job."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith(("OMPI_", "PMIX_", "TORCHELASTIC_"))}
    env.update(PYTHONUNBUFFERED="1", **{k: str(v) for k, v in extra.items()})
    return env


def run(cmd, cwd, timeout=120, env=None, check=True):
    """Run a command; on an unexpected exit code fail with its output, so a broken run explains itself."""
    result = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env or clean_env(), capture_output=True,
                            text=True, timeout=timeout)
    if check and result.returncode != 0:
        pytest.fail(f"{' '.join(map(str, cmd))} exited {result.returncode}\n"
                    f"--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}")
    return result


def python_cmd(script, *args):
    return [sys.executable, REPO / script, *args]


def torchrun_cmd(script, *args, nproc=2, extra=()):
    return [BIN / "torchrun", "--standalone", f"--nproc_per_node={nproc}", *extra, REPO / script, *args]


def mpirun_cmd(script, *args, np_=2):
    """mpirun as root needs the two OMPI_ALLOW variables (set in mpi_env); above 2 ranks, --oversubscribe."""
    return [BIN / "mpirun", "-np", str(np_), "--oversubscribe", "--bind-to", "none",
            sys.executable, REPO / script, *args]


def mpi_env(**extra):
    return clean_env(OMPI_ALLOW_RUN_AS_ROOT=1, OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1, **extra)


def load_snapshot(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_bitwise_equal(a, b, what=""):
    """Recursively compare nested state dicts: tensors with torch.equal, everything else with ==."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"{what} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{what} keys differ"
        for key in a:
            assert_bitwise_equal(a[key], b[key], f"{what}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{what} lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{what}[{i}]")
    else:
        assert a == b, f"{what}: {a!r} != {b!r}"


@pytest.fixture(scope="session")
def mnist_dir(tmp_path_factory):
    """The real MNIST test images split 8,000 train / 2,000 eval, written as the four IDX files."""
    from ddp_common.data import read_idx, write_idx
    images = read_idx(str(MNIST / "t10k-images-idx3-ubyte.gz"))
    labels = read_idx(str(MNIST / "t10k-labels-idx1-ubyte.gz"))
    order = np.random.default_rng(0).permutation(len(images))
    train, test = order[:8000], order[8000:]
    directory = tmp_path_factory.mktemp("mnist")
    write_idx(str(directory / "train-images-idx3-ubyte.gz"), images[train])
    write_idx(str(directory / "train-labels-idx1-ubyte.gz"), labels[train])
    write_idx(str(directory / "t10k-images-idx3-ubyte.gz"), images[test])
    write_idx(str(directory / "t10k-labels-idx1-ubyte.gz"), labels[test])
    return directory
