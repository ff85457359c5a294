"""One job, three launchers (3 of 3): mpirun starts the processes, the script turns MPI's numbering
into what torch.distributed reads.

    mpirun -np 4 python run_with_mpirun.py                        # collectives, checked
    mpirun -np 4 python run_with_mpirun.py --backend mpi          # torch's MPI backend (MPI builds only)
    mpirun -np 2 python run_with_mpirun.py --train --total_epochs 50 --save_every 10   # DDP training
    mpirun -H host1:4,host2:4 -x MASTER_ADDR=ADDRESS_OF_HOST1 python run_with_mpirun.py   # two hosts
    python run_with_mpirun.py                                     # no mpirun: a world of one

mpirun provides: the processes on every host, the rank and size (MPI.COMM_WORLD), the local rank
(OMPI_COMM_WORLD_LOCAL_RANK and the like) and a channel between the ranks. It does not provide a
rendezvous address for torch: ddp_common.mpi.setup_environment has rank 0 pick one and broadcast it
over MPI, then sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT as
torchrun would. From there on the script is a torchrun script: --train runs multigpu_torchrun.py's
training unchanged. As root, Open MPI also wants OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1,
and more ranks than cores need --oversubscribe.
"""
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from mpi4py import MPI

import multigpu_torchrun
from ddp_common import cli, collectives, mpi
from ddp_common.distributed import add_backend_arg, pick_backend_and_device, torchrun_ranks


def main(args):
    if "TORCHELASTIC_RUN_ID" in os.environ:
        raise cli.UsageError("run_with_mpirun.py takes its ranks from mpirun, not torchrun; "
                             "run `mpirun -np 2 python run_with_mpirun.py`")
    source = mpi.setup_environment()
    # From here on the environment is what torchrun would have set.
    rank, local_rank, world_size, local_world_size = torchrun_ranks("run_with_mpirun.py")
    launcher = "mpirun" if mpi.launched_by_mpirun() else "no launcher: MPI runs this process as a world of one"
    collectives.say(f"Process {rank}: rank from {source['rank']}, local rank {local_rank} from "
                    f"{source['local_rank']}, world size {world_size} from {source['world_size']}, master "
                    f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} {source['master']} ({launcher})")
    if args.train:
        multigpu_torchrun.main(args)  # the torchrun trainer, as is: it reads the variables set above
        return

    backend, device = pick_backend_and_device(args.backend, local_rank, local_world_size)
    store = None
    if backend == "mpi":
        dist.init_process_group("mpi", timeout=timedelta(seconds=args.timeout))  # ranks from MPI itself
        # The MPI backend keeps no key-value store; the barrier check counts arrivals in one.
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                              is_master=rank == 0, timeout=timedelta(seconds=args.timeout))
    else:
        dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))  # env://, set above
    try:
        collectives.announce(rank, world_size, device)
        checks = collectives.run_all(device, store)
        # The same sum through torch and through MPI's own allreduce must agree.
        summed = torch.tensor([rank + 1], device=device)
        dist.all_reduce(summed)
        checks.append(collectives.Check("all_reduce vs MPI allreduce", [MPI.COMM_WORLD.allreduce(rank + 1)],
                                        summed.tolist()))
        collectives.report(checks, device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    parser = cli.ArgumentParser(description="Processes started by mpirun: check the collectives, or --train.")
    parser.add_argument("--train", action="store_true",
                        help="train the tutorial model as multigpu_torchrun.py does, instead of the collectives")
    cli.add_training_args(parser)
    add_backend_arg(parser)
    cli.add_timeout_arg(parser)
    cli.run(main, cli.training_args(parser))
