"""One job, three launchers (2 of 3): plain python, the script starts its own processes.

    python run_with_python.py                          # one process per GPU, or 2 CPU processes
    python run_with_python.py --world_size 4           # 4 processes
    python run_with_python.py --world_size 2 --master_addr 127.0.0.1 --master_port 29500

No launcher provides anything here, so the script does it all: it picks the number of processes,
an address and a free port for the rendezvous, starts the processes with torch.multiprocessing.spawn,
numbers them (the rank is the spawn index), and turns a failed process into an exit code. One machine
only: for several, use run_with_torchrun.py or run_with_mpirun.py.
"""
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddp_common import cli, collectives, mpi
from ddp_common.distributed import add_backend_arg, check_backend, check_can_listen, device_for, free_port


def main(rank, world_size, backend, address, port, timeout):
    device = device_for(backend, rank, world_size)  # one node: the rank is also the local rank
    dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout))
    try:
        collectives.announce(rank, world_size, device)
        collectives.say(f"Process {rank}: rank and local rank from the mp.spawn process index, world size "
                        f"{world_size} from the script, rendezvous tcp://{address}:{port}; backend {backend}")
        collectives.report(collectives.run_all(device), device)
    finally:
        dist.destroy_process_group()


def spawn(args):
    if "TORCHELASTIC_RUN_ID" in os.environ or mpi.launched_by_mpirun():
        raise cli.UsageError("run_with_python.py starts its own processes; under a launcher every copy would "
                             "start a job of its own. Run `python run_with_python.py --world_size 2`")
    if args.backend == "mpi":
        raise cli.UsageError("the mpi backend takes its ranks from mpirun, not from mp.spawn; "
                             "run `mpirun -np 2 python run_with_mpirun.py --backend mpi`")
    world_size = args.world_size or torch.cuda.device_count() or 2
    backend = check_backend(args.backend, ranks_per_node=world_size)
    # Before any process starts: a wrong address or a taken port would otherwise surface as a rank 0
    # crash and the others waiting for it until the timeout.
    check_can_listen(args.master_addr, args.master_port or 0)
    port = args.master_port or free_port(args.master_addr)
    try:
        mp.spawn(cli.run_rank, args=(main, world_size, backend, args.master_addr, port, args.timeout),
                 nprocs=world_size)
    except mp.ProcessExitedException as error:
        cli.exit_for_spawned_failure(error)


if __name__ == "__main__":
    parser = cli.ArgumentParser(description="Start the processes with mp.spawn, run and check the collectives.")
    parser.add_argument("--world_size", type=cli.positive_int,
                        help="processes to start (default: one per GPU, or 2 without GPUs)")
    parser.add_argument("--master_addr", default="127.0.0.1",
                        help="address of this machine for the rendezvous (default 127.0.0.1)")
    parser.add_argument("--master_port", type=cli.port_number,
                        help="port for the rendezvous (default: a free one)")
    add_backend_arg(parser)
    cli.add_timeout_arg(parser)
    cli.run(spawn, parser.parse_args())
