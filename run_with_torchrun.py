"""One job, three launchers (1 of 3): torchrun starts the processes and tells each one who it is.

    torchrun --standalone --nproc_per_node=2 run_with_torchrun.py       # one machine, 2 processes
    torchrun --nnodes=2 --nproc_per_node=4 --rdzv-id=job1 --rdzv-backend=c10d \
        --rdzv-endpoint=HOST_OF_NODE_0:29500 run_with_torchrun.py       # the same on every node

torchrun provides: the processes (and restarts them with --max-restarts), RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, and MASTER_ADDR/MASTER_PORT of a rendezvous store it hosts itself.
The script provides: the device choice and the process group (init_process_group reads those
variables), the collectives, and the cleanup. Compare run_with_python.py and run_with_mpirun.py.
"""
from datetime import timedelta

import torch.distributed as dist

from ddp_common import cli, collectives
from ddp_common.distributed import add_backend_arg, pick_backend_and_device, torchrun_ranks


def main(args):
    if args.backend == "mpi":
        raise cli.UsageError("the mpi backend takes its ranks from mpirun, not torchrun; "
                             "run `mpirun -np 2 python run_with_mpirun.py --backend mpi`")
    # RANK is the rank in the whole job; LOCAL_RANK only numbers the processes of this node (and picks
    # the GPU). Using LOCAL_RANK as the rank works on one node and breaks on the second.
    rank, local_rank, world_size, local_world_size = torchrun_ranks("run_with_torchrun.py")
    backend, device = pick_backend_and_device(args.backend, local_rank, local_world_size)
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))  # env://: torchrun's variables
    try:
        collectives.announce(rank, world_size, device)
        collectives.say(f"Process {rank}: rank from RANK, local rank {local_rank} from LOCAL_RANK, world size "
                        f"from WORLD_SIZE, all set by torchrun; backend {backend}")
        collectives.report(collectives.run_all(device), device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    parser = cli.ArgumentParser(description="Run and check the collectives in processes started by torchrun.")
    add_backend_arg(parser)
    cli.add_timeout_arg(parser)
    cli.run(main, parser.parse_args())
