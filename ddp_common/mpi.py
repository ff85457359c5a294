"""From an MPI launch to what torch.distributed needs: ranks, the local rank, and a rendezvous address.

mpirun starts the processes and numbers them, but says nothing about where torch's rendezvous store
lives. So rank 0 picks an address and a free port and broadcasts them over MPI itself.
run_with_mpirun.py shows these steps one by one; setup_environment() does them all for the scripts
whose lesson is elsewhere (train.py, benchmarks/allreduce.py).
"""
import os
import socket

import torch

from ddp_common.devices import cpu_threads_for
from ddp_common.launchers import MPI_LOCAL_RANK_VARIABLES
from ddp_common.rendezvous import free_port


def local_rank_and_size(comm):
    """(local rank, processes on this node, where the local rank came from): from the MPI implementation's
    variable where it sets one, else from a split of `comm` by shared memory (one group per node)."""
    from mpi4py import MPI  # here, not above: importing it starts MPI, which only an mpirun launch needs

    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    local_rank, local_size, source = node.Get_rank(), node.Get_size(), "MPI shared-memory split"
    node.Free()
    for name in MPI_LOCAL_RANK_VARIABLES:
        if name in os.environ:
            local_rank, source = int(os.environ[name]), name
            break
    return local_rank, local_size, source


def rendezvous_address(one_host):
    """What rank 0 offers the others for torch's rendezvous: MASTER_ADDR/MASTER_PORT if set (on several
    hosts MASTER_ADDR must be an address of rank 0's host that the others reach), else 127.0.0.1 on one
    host or the address this host's name resolves to, and a free port."""
    address = os.environ.get("MASTER_ADDR") or ("127.0.0.1" if one_host else _own_address())
    port = int(os.environ.get("MASTER_PORT") or free_port("127.0.0.1" if one_host else ""))
    return address, port


def setup_environment():
    """Set RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT from MPI, as torchrun
    would, and give each process its share of the CPU cores (mpirun, unlike torchrun, leaves
    OMP_NUM_THREADS unset, and every process would start a thread per core)."""
    from mpi4py import MPI  # here, not above: importing it starts MPI, which only an mpirun launch needs

    comm = MPI.COMM_WORLD
    rank, world_size = comm.Get_rank(), comm.Get_size()
    local_rank, local_world_size, _ = local_rank_and_size(comm)
    address, port = comm.bcast(rendezvous_address(local_world_size == world_size) if rank == 0 else None, root=0)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(local_world_size), MASTER_ADDR=address, MASTER_PORT=str(port))
    share_cores(local_world_size)


def share_cores(local_world_size):
    """mpirun, unlike torchrun, leaves OMP_NUM_THREADS unset: without this every process starts a thread per
    core. Returns the threads each process takes (None: the user's OMP_NUM_THREADS stands)."""
    if "OMP_NUM_THREADS" in os.environ:
        return None
    torch.set_num_threads(cpu_threads_for(local_world_size))
    return torch.get_num_threads()


def _own_address():
    """An address of this host that other hosts can reach: the one its name resolves to."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return socket.gethostname()
