"""What the benchmarks share besides launches.py and report.py: their flags' types, the entry point that turns a
usage error into one line (exit 2), the backend check, free ports, the tutorial's group_store (imported),
and the environment torchrun would set, made from MPI for a run under mpirun (allreduce.py).
"""
import argparse
import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from multigpu_torchrun import group_store  # noqa: F401  the tutorial's own: a store of each group's own under torchrun

BACKENDS = ("nccl", "gloo", "mpi")
# Each MPI implementation names the rank within the node, and its launch, differently.
MPI_LOCAL_RANK_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK")
MPI_LAUNCH_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE")


class UsageError(Exception):
    """A problem the user can fix (a flag, a file, the launcher): one line and exit code 2 from run()."""


class FlagError(UsageError):
    """A flag the parser refused: printed as argparse prints it, `script.py: error: ...`."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr (exit 2), not a usage block."""

    def error(self, message):
        raise FlagError(f"{self.prog}: error: {message} (see --help)")


def run(main, parser):
    """main(parser.parse_args()); a UsageError becomes one line on stderr and exit code 2."""
    try:
        return main(parser.parse_args())
    except UsageError as error:
        print(error if isinstance(error, FlagError) else f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)


def _number(text, kind, name):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {name}, got {text!r}") from None


def positive_int(text):
    value = _number(text, int, "a positive integer")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative_int(text):
    value = _number(text, int, "a whole number")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def positive_float(text):
    value = _number(text, float, "a positive number")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def seconds(text):
    """A positive number of seconds, as the timedelta torch.distributed takes."""
    return timedelta(seconds=positive_float(text))


def add_distributed_args(parser):
    """--backend and --timeout."""
    parser.add_argument("--backend", choices=BACKENDS, default=None,
                        help="process-group backend (default: the device's, nccl on CUDA GPUs and gloo on the CPU)")
    parser.add_argument("--timeout", type=seconds, default=timedelta(seconds=300),
                        help="seconds to wait for the other ranks before giving up (default 300; the library "
                             "default is 30 minutes)")


def check_backend(backend, device, local_world_size):
    """`backend` if this machine can run it, one process per device, with `local_world_size` processes on this
    node; otherwise a UsageError saying what to do instead."""
    if backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        built = "a CUDA build of torch that sees no GPU" if torch.backends.cuda.is_built() else "a CPU build of torch"
        raise UsageError(f"backend nccl needs CUDA GPUs, and this machine has {built}; leave out --backend (gloo "
                         "on the CPU is the default there) or use --backend gloo")
    if backend == "mpi" and not dist.is_mpi_available():
        raise UsageError("this torch build has no MPI backend (torch.distributed.is_mpi_available() is False); "
                         "under mpirun use --backend gloo on CPUs or --backend nccl on GPUs")
    if backend == "gloo" and not dist.is_gloo_available():
        raise UsageError("this torch build has no gloo backend; use --backend nccl on GPUs")
    devices = torch.accelerator.device_count()
    if device.type != "cpu" and local_world_size > devices:
        raise UsageError(f"{local_world_size} ranks on this node but only {devices} {device.type} device(s), one "
                         f"per rank; start at most {devices} per node (torchrun --nproc_per_node={devices}), or "
                         "hide the GPUs (CUDA_VISIBLE_DEVICES=) to run every rank on the CPU")
    return backend


def usable_cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def free_port(host="127.0.0.1"):
    """A port nobody listens on right now (the OS picks it), so two jobs on one machine never collide."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def launched_by_mpirun():
    return any(name in os.environ for name in MPI_LAUNCH_VARIABLES)


def setup_mpi_environment():
    """Under mpirun: set RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT from MPI, as
    torchrun would (rank 0 picks the rendezvous address and broadcasts it), and, unless OMP_NUM_THREADS is set,
    give each process its share of the cores (mpirun, unlike torchrun, leaves every process a thread per core).
    Returns MPI's world communicator."""
    from mpi4py import MPI  # here: importing it starts MPI, which only an mpirun launch needs

    comm = MPI.COMM_WORLD
    rank, world_size = comm.Get_rank(), comm.Get_size()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)  # the processes of this node
    local_rank, local_world_size = node.Get_rank(), node.Get_size()
    node.Free()
    local_rank = next((int(os.environ[name]) for name in MPI_LOCAL_RANK_VARIABLES if name in os.environ), local_rank)
    address = None
    if rank == 0:
        one_host = local_world_size == world_size
        # On several hosts: the address this host's name resolves to, which the others must reach.
        host = os.environ.get("MASTER_ADDR") or ("127.0.0.1" if one_host
                                                 else socket.gethostbyname(socket.gethostname()))
        address = (host, int(os.environ.get("MASTER_PORT") or free_port("127.0.0.1" if one_host else "")))
    host, port = comm.bcast(address, root=0)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(local_world_size), MASTER_ADDR=host, MASTER_PORT=str(port))
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, usable_cores() // local_world_size))
    return comm
