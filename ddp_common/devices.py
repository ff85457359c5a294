"""The backend checked against the machine, and the CPU cores shared between the processes on it.

Which device a script trains on is the script's own lesson, in its own lines:
`torch.accelerator.current_accelerator(check_available=True)` is the GPU's kind (cuda, ...) when one is usable,
None otherwise. Without check_available it names the accelerator torch was *built* for: PyPI's torch for Linux
is a CUDA build, and on a machine without a GPU it still says cuda.
"""
import os
import socket

import torch
import torch.distributed as dist

from ddp_common.errors import UsageError

BACKENDS = ("nccl", "gloo", "mpi")


def check_backend(backend, device, local_world_size):
    """`backend` if this machine can run it, one process per device, with `local_world_size` processes on
    this node; otherwise a UsageError saying what to do instead."""
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


def cpu_threads_for(processes):
    """Intra-op threads for each of `processes` CPU processes on this machine: its cores shared out, at least 1."""
    return max(1, len(os.sched_getaffinity(0)) // processes)


def share_cores(device):
    """Every rank calls this once its process group exists: when the user has not set OMP_NUM_THREADS, each CPU
    process on this machine gets an equal share of its cores as intra-op threads. Returns a line for rank 0 to
    print when it chose, None otherwise.

    Left alone, every process starts a thread per core, and N processes on one machine fight over its cores:
    torchrun sets OMP_NUM_THREADS=1 only for --nproc_per_node > 1, so two torchrun nodes of one process each
    on one machine oversubscribe it (measured: several times slower). The processes of this machine are
    counted by host name, so that nodes sharing a machine count together."""
    if "OMP_NUM_THREADS" in os.environ or device.type != "cpu":
        return None
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    here = hosts.count(socket.gethostname())
    threads = cpu_threads_for(here)
    torch.set_num_threads(threads)
    return (f"{here} process{'es' * (here > 1)} on this machine's {len(os.sched_getaffinity(0))} cores: {threads} "
            "intra-op thread(s) each (OMP_NUM_THREADS is not set; set it to choose)")

