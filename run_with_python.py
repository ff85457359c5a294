"""One job, three launchers (2 of 3): plain python, the script starts its own processes.

    python run_with_python.py                          # one process per GPU, or 2 CPU processes
    python run_with_python.py --world_size 4           # 4 processes
    python run_with_python.py --world_size 2 --master_addr 127.0.0.1 --master_port 29500

No launcher provides anything here, so the script does it all: it picks the number of processes,
an address and a free port for the rendezvous, starts the processes with torch.multiprocessing.spawn,
numbers them (the rank is the spawn index), and turns a failed process into an exit code. One machine
only: for several, use run_with_torchrun.py or run_with_mpirun.py.
"""
import argparse
import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def say(text):
    os.write(1, f"{text}\n".encode())  # one write: the ranks share one stdout, their lines never mix


def check_collectives(rank, world_size, device, store):
    """Every collective on integers made from the rank numbers, so that each rank knows the exact answer it must
    get (integer sums and means need no tolerance): [(collective, expected, got)] as this rank saw them."""
    def tensor(*values):
        return torch.tensor(values, dtype=torch.int64, device=device)

    total = world_size * (world_size + 1) // 2  # 1 + 2 + ... + world_size
    checks = []
    summed = tensor(rank + 1, 10 * (rank + 1))
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)
    checks.append(("all_reduce sum", [total, 10 * total], summed.tolist()))
    averaged = tensor(world_size * (rank + 1))  # the mean is total: an integer, exact
    if dist.get_backend() == "nccl":
        dist.all_reduce(averaged, op=dist.ReduceOp.AVG)
    else:  # gloo and MPI have no AVG: sum, then divide
        dist.all_reduce(averaged, op=dist.ReduceOp.SUM)
        averaged //= world_size
    checks.append(("all_reduce avg", [total], averaged.tolist()))
    gathered = [tensor(0, 0) for _ in range(world_size)]
    dist.all_gather(gathered, tensor(rank, rank * rank))
    checks.append(("all_gather", [[r, r * r] for r in range(world_size)], [t.tolist() for t in gathered]))
    source = world_size - 1  # not rank 0: a broadcast that did nothing would pass on rank 0 anyway
    broadcast = tensor(100 + rank)
    dist.broadcast(broadcast, src=source)
    checks.append((f"broadcast from {source}", [100 + source], broadcast.tolist()))
    for destination in range(world_size):  # only the destination gets the result: each rank in turn
        reduced = tensor((rank + 1) * (destination + 1))
        dist.reduce(reduced, dst=destination, op=dist.ReduceOp.SUM)
        if destination == rank:
            checks.append(("reduce to each rank in turn", [total * (rank + 1)], reduced.tolist()))
    # A barrier returns nothing; it promises that nobody leaves before everyone arrived: each rank counts
    # itself in on the way in, and on the way out finds them all.
    store.add("arrived", 1)
    dist.barrier()
    checks.append(("barrier", f"{world_size} arrived", f"{store.add('arrived', 0)} arrived"))
    return checks


def report(checks, rank, world_size, device):
    """Rank 0 prints the table with the ranks where each check failed; a rank that got a wrong value stops."""
    wrong = torch.zeros(world_size, len(checks), dtype=torch.int64, device=device)
    wrong[rank] = torch.tensor([expected != got for _, expected, got in checks], dtype=torch.int64, device=device)
    dist.all_reduce(wrong)  # row r: the checks that failed on rank r
    if rank == 0:
        rows = [("collective", "expected", "got", "ok")]
        for column, (name, expected, got) in enumerate(checks):
            bad = wrong[:, column].nonzero().flatten().tolist()
            rows.append((name, str(expected), str(got), "NO on rank " + ", ".join(map(str, bad)) if bad else "yes"))
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = [" | ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "-+-".join("-" * width for width in widths))
        say(f"Collectives on {world_size} rank(s), as rank 0 saw them:\n" + "\n".join(lines))
    failed = [f"{name} gave {got}, expected {expected}" for name, expected, got in checks if expected != got]
    if failed:
        sys.exit(f"error: rank {rank} got wrong results: " + "; ".join(failed))


def main(rank, world_size, backend, address, port, timeout):
    # The rank is the mp.spawn index; one machine, so it is also the local rank, which picks the GPU.
    accelerator = torch.accelerator.current_accelerator(check_available=True)  # None without a usable GPU
    if accelerator and world_size > torch.accelerator.device_count():
        accelerator = None  # more processes than devices (a Mac has one mps device): every process on the CPU
    device = torch.device(accelerator.type, rank) if accelerator else torch.device("cpu")
    if accelerator:  # before the process group, so NCCL binds this process to its own GPU
        torch.accelerator.set_device_index(device.index)
    # Rank 0 hosts the rendezvous store at address:port, the others connect to it: what
    # init_method="tcp://address:port" would do, with the store in hand for the barrier check.
    store = dist.TCPStore(address, port, world_size, is_master=rank == 0, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                            device_id=device if accelerator else None)
    host = socket.gethostname()
    say(f"{host}$Process {rank}: {rank} # {world_size}")
    say(f"{host}$Process {rank}: Default device is set to {device.index if accelerator else 'cpu'}")
    url = f"tcp://[{address}]:{port}" if ":" in address else f"tcp://{address}:{port}"  # IPv6 in brackets
    say(f"Process {rank}: rank and local rank from the mp.spawn process index, world size {world_size} from the "
        f"script, rendezvous {url}; backend {backend}")
    report(check_collectives(rank, world_size, device, store), rank, world_size, device)
    dist.destroy_process_group()


def worker(rank, *args):  # what mp.spawn runs in each process
    try:
        main(rank, *args)
    except (Exception, SystemExit) as error:
        if not dist.is_initialized():  # no process group: Python's own exit is safe
            raise
        # The group lives on: Python's exit can stall or abort in gloo's threads. Say why as Python would; leave now.
        if isinstance(error, SystemExit):  # sys.exit("error: ...")
            print(error.code, file=sys.stderr)
        else:  # the traceback, through any hook a tool installed
            sys.excepthook(*sys.exc_info())
        sys.stdout.flush()
        os._exit(1)


def spawn(args, parser):
    world_size = args.world_size or torch.accelerator.device_count() or 2
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    if accelerator and world_size > torch.accelerator.device_count():
        accelerator = None  # as main() decides: more processes than devices, every process on the CPU
    backend = args.backend or dist.get_default_backend_for_device(accelerator or torch.device("cpu"))
    if backend == "nccl" and (accelerator is None or accelerator.type != "cuda"):
        sys.exit("error: --backend nccl needs a CUDA GPU for each process; leave --backend out for gloo on the CPU")
    # Before any process starts, listen where rank 0 will: a wrong address or a taken port would otherwise be a
    # rank 0 crash and the others waiting for it until --timeout. Port 0: the system picks a free one.
    try:
        family = socket.getaddrinfo(args.master_addr, None, type=socket.SOCK_STREAM)[0][0]
        with socket.create_server((args.master_addr, args.master_port or 0), family=family) as listener:
            port = listener.getsockname()[1]
    except socket.gaierror:
        parser.error(f"master address {args.master_addr!r} does not resolve; give an address of this machine, "
                     "e.g. 127.0.0.1")
    except OSError as error:
        parser.error(f"cannot listen on {args.master_addr} port {args.master_port or 'any'} "
                     f"({os.strerror(error.errno)}): give an address of this machine (e.g. 127.0.0.1) and a free "
                     "--master_port, or leave it out")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does: else each process takes every core
    # world_size processes, each running worker(rank, world_size, backend, address, port, timeout)
    mp.spawn(worker, args=(world_size, backend, args.master_addr, port, timedelta(seconds=args.timeout)),
             nprocs=world_size)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world_size", type=int, help="processes to start (default: one per GPU, or 2 without GPUs)")
    parser.add_argument("--master_addr", default="127.0.0.1", help="address of this machine for the rendezvous")
    parser.add_argument("--master_port", type=int, default=0, help="port for the rendezvous (default: a free one)")
    parser.add_argument("--backend", choices=["nccl", "gloo"], help="default: nccl on CUDA, gloo on the CPU "
                        "(the mpi backend takes its ranks from mpirun: run_with_mpirun.py)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds to wait for the other ranks (default 300)")
    args = parser.parse_args()
    if args.world_size is not None and args.world_size <= 0 or args.timeout <= 0:
        parser.error("--world_size and --timeout must be positive")
    if not 0 <= args.master_port <= 65535:
        parser.error(f"--master_port must be a port number (1 to 65535), got {args.master_port}")
    if any(name in os.environ for name in ("TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")):
        parser.error("it starts its own processes: under a launcher every copy would start a job of its own; "
                     "run `python run_with_python.py --world_size 2`")
    spawn(args, parser)
