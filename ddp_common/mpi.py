"""From an MPI launch to the variables torch.distributed reads (RANK, WORLD_SIZE, MASTER_ADDR, ...).

mpirun starts the processes and numbers them, but says nothing about where torch's rendezvous store
lives. So rank 0 picks an address and a free port and broadcasts them over MPI itself.
"""
import os
import socket

from ddp_common.distributed import free_port

# Each MPI implementation names the rank within the node differently.
LOCAL_RANK_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK")
LAUNCHED_BY_MPI_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE")


def launched_by_mpirun():
    return any(name in os.environ for name in LAUNCHED_BY_MPI_VARIABLES)


def setup_environment():
    """Fill RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT from MPI.

    Returns a dict saying where each value came from, for the scripts to print. MASTER_ADDR and
    MASTER_PORT already in the environment win (on several hosts, MASTER_ADDR must be an address of
    rank 0's host that the other hosts reach)."""
    from mpi4py import MPI  # imported here: scripts that never see mpirun need no MPI library

    comm = MPI.COMM_WORLD
    rank, world_size = comm.Get_rank(), comm.Get_size()
    node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_world_size = node_comm.Get_size()
    source = {"rank": "MPI.COMM_WORLD.Get_rank()", "world_size": "MPI.COMM_WORLD.Get_size()"}
    for name in LOCAL_RANK_VARIABLES:
        if name in os.environ:
            local_rank, source["local_rank"] = int(os.environ[name]), name
            break
    else:
        local_rank, source["local_rank"] = node_comm.Get_rank(), "MPI shared-memory split"
    node_comm.Free()

    rendezvous = None
    if rank == 0:
        one_host = local_world_size == world_size
        address = os.environ.get("MASTER_ADDR") or ("127.0.0.1" if one_host else _own_address())
        port = int(os.environ.get("MASTER_PORT") or free_port("127.0.0.1" if one_host else ""))
        rendezvous = (address, port)
    address, port = comm.bcast(rendezvous, root=0)
    source["master"] = "environment" if "MASTER_ADDR" in os.environ else "chosen by rank 0, sent by MPI bcast"

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(local_world_size), MASTER_ADDR=address, MASTER_PORT=str(port))
    return source


def _own_address():
    """An address of this host that other hosts can reach: the one its name resolves to."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return socket.gethostname()
