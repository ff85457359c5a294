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

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddp_common import cli, collectives, launchers
from ddp_common.devices import check_backend
from ddp_common.errors import UsageError
from ddp_common.rendezvous import check_can_listen, free_port


@cli.rank_main  # one-line errors in each process, as cli.run gives the parent
def main(rank, world_size, backend, address, port, timeout):
    # The rank is the mp.spawn index; one machine, so it is also the local rank, which picks the GPU.
    accelerator = torch.accelerator.current_accelerator(check_available=True)  # None without a usable GPU
    device = torch.device(accelerator.type, rank) if accelerator else torch.device("cpu")
    if accelerator:  # before the process group, so NCCL binds this process to its own GPU
        torch.accelerator.set_device_index(device.index)
    host = f"[{address}]" if ":" in address else address  # an IPv6 address goes in brackets in a URL
    dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=rank, world_size=world_size,
                            timeout=timeout, device_id=device if accelerator else None)
    collectives.announce(rank, world_size, device)
    collectives.say(f"Process {rank}: rank and local rank from the mp.spawn process index, world size "
                    f"{world_size} from the script, rendezvous tcp://{host}:{port}; backend {backend}")
    collectives.report(collectives.run_all(device), device)
    dist.destroy_process_group()


def spawn(args):
    if launchers.launched_by_torchrun() or launchers.launched_by_mpirun():
        raise UsageError("run_with_python.py starts its own processes; under a launcher every copy would "
                         "start a job of its own. Run `python run_with_python.py --world_size 2`")
    if args.backend == "mpi":
        raise UsageError("the mpi backend takes its ranks from mpirun, not from mp.spawn; "
                         "run `mpirun -np 2 python run_with_mpirun.py --backend mpi`")
    world_size = args.world_size or torch.accelerator.device_count() or 2
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    device = torch.device(accelerator.type, 0) if accelerator else torch.device("cpu")  # the processes' kind
    backend = check_backend(args.backend or dist.get_default_backend_for_device(device), device, world_size)
    # Before any process starts: a wrong address or a taken port would otherwise surface as a rank 0
    # crash and the others waiting for it until the timeout.
    check_can_listen(args.master_addr, args.master_port or 0)
    port = args.master_port or free_port(args.master_addr)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does: else each process takes every core
    # world_size processes, each running main(rank, world_size, backend, address, port, timeout)
    mp.spawn(main, args=(world_size, backend, args.master_addr, port, args.timeout), nprocs=world_size)


if __name__ == "__main__":
    parser = cli.ArgumentParser(description="Start the processes with mp.spawn, run and check the collectives.")
    parser.add_argument("--world_size", type=cli.positive_int,
                        help="processes to start (default: one per GPU, or 2 without GPUs)")
    parser.add_argument("--master_addr", default="127.0.0.1",
                        help="address of this machine for the rendezvous (default 127.0.0.1)")
    parser.add_argument("--master_port", type=cli.port_number,
                        help="port for the rendezvous (default: a free one)")
    cli.add_distributed_args(parser)
    cli.run(spawn, parser)
