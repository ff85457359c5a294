"""One job, three launchers (1 of 3): torchrun starts the processes and tells each one who it is.

    torchrun --standalone --nproc_per_node=2 run_with_torchrun.py       # one machine, 2 processes
    torchrun --nnodes=2 --nproc_per_node=4 --rdzv_id=job1 --rdzv_backend=c10d \
        --rdzv_endpoint=HOST_OF_NODE_0:29500 run_with_torchrun.py       # the same on every node

torchrun provides: the processes (and restarts them with --max_restarts), RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, and MASTER_ADDR/MASTER_PORT of a rendezvous store it hosts itself. The script
provides: the device choice, the process group, the collectives, and the cleanup.
Compare run_with_python.py and run_with_mpirun.py.
"""
import os

import torch
import torch.distributed as dist

from ddp_common import cli, collectives
from ddp_common.devices import check_backend
from ddp_common.errors import UsageError
from ddp_common.rendezvous import group_store


def main(args):
    if args.backend == "mpi":
        raise UsageError("the mpi backend takes its ranks from mpirun, not torchrun; "
                         "run `mpirun -np 2 python run_with_mpirun.py --backend mpi`")
    # RANK is the rank in the whole job; LOCAL_RANK only numbers the processes of this node (and picks the
    # GPU). Using LOCAL_RANK as the rank works on one node and breaks on the second.
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size, local_world_size = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    accelerator = torch.accelerator.current_accelerator(check_available=True)  # None without a usable GPU
    device = torch.device(accelerator.type, local_rank) if accelerator else torch.device("cpu")
    backend = check_backend(args.backend or dist.get_default_backend_for_device(device), device, local_world_size)
    if accelerator:  # before the process group, so NCCL binds this process to its own GPU
        torch.accelerator.set_device_index(device.index)
    # A store of this group's own: torchrun's outlives a restart with the old group's keys (docs/failures.md).
    dist.init_process_group(backend, store=group_store(rank, world_size, args.timeout), rank=rank,
                            world_size=world_size, timeout=args.timeout, device_id=device if accelerator else None)
    collectives.announce(rank, world_size, device)
    collectives.say(f"Process {rank}: rank from RANK, local rank {local_rank} from LOCAL_RANK, world size "
                    f"from WORLD_SIZE, all set by torchrun; backend {backend}")
    collectives.report(collectives.run_all(device), device)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = cli.ArgumentParser(description="Run and check the collectives in processes started by torchrun.")
    cli.add_distributed_args(parser)
    cli.run(main, parser)
