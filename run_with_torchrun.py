"""One job, three launchers (1 of 3): torchrun starts the processes and tells each one who it is.

    torchrun --standalone --nproc_per_node=2 run_with_torchrun.py       # one machine, 2 processes
    torchrun --nnodes=2 --nproc_per_node=4 --rdzv_id=job1 --rdzv_backend=c10d \
        --rdzv_endpoint=HOST_OF_NODE_0:29500 run_with_torchrun.py       # the same on every node

torchrun provides: the processes (and restarts them with --max_restarts), RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, and MASTER_ADDR/MASTER_PORT of a rendezvous store it hosts itself. The script
provides: the device choice, the process group, the collectives, and the cleanup.
Compare run_with_python.py and run_with_mpirun.py.
"""
import argparse
import os
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


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


def group_store(rank, world_size, timeout):
    """Under torchrun, a store of this group's own: torchrun's outlives a restart with the dead group's keys, and a
    restarted rank can read a dead peer's address and burn the restart (pytorch/pytorch#135712, torch 2.13 too)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    host = os.environ["MASTER_ADDR"]
    torchrun_store = dist.TCPStore(host, int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    if rank == 0:  # a fresh store, listening at the rendezvous address alone; its port posted in torchrun's
        listener = socket.create_server((host, 0), family=socket.getaddrinfo(host, 0)[0][0])
        store = dist.TCPStore(host, listener.getsockname()[1], world_size, is_master=True, timeout=timeout,
                              wait_for_workers=False, master_listen_fd=listener.detach())
        torchrun_store.set("group_store_port", str(store.port))
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while time.monotonic() < deadline:  # where nothing answers at the posted port, the post is the dead group's
        port = int(torchrun_store.get("group_store_port"))
        try:
            socket.create_connection((host, port), timeout=3).close()  # refused at once where rank 0 died
            return dist.TCPStore(host, port, is_master=False, timeout=timeout)
        except OSError:
            time.sleep(0.1)
    sys.exit(f"error: rank 0 opened no store for this group within --timeout {timeout.total_seconds():g}s")


def main(args):
    # RANK is the rank in the whole job; LOCAL_RANK only numbers the processes of this node (and picks the
    # GPU). Using LOCAL_RANK as the rank works on one node and breaks on the second.
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size, local_world_size = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    accelerator = torch.accelerator.current_accelerator(check_available=True)  # None without a usable GPU
    if accelerator and local_world_size > torch.accelerator.device_count():
        accelerator = None  # more processes than devices (a Mac has one mps device): every process on the CPU
    device = torch.device(accelerator.type, local_rank) if accelerator else torch.device("cpu")
    backend = args.backend or dist.get_default_backend_for_device(device)
    if backend == "nccl" and device.type != "cuda":
        sys.exit("error: --backend nccl needs a CUDA GPU for each process; leave --backend out for gloo on the CPU")
    if accelerator:  # before the process group, so NCCL binds this process to its own GPU
        torch.accelerator.set_device_index(device.index)
    timeout = timedelta(seconds=args.timeout)
    # The store init_process_group would make from MASTER_ADDR/MASTER_PORT (env://), or one of this group's own.
    store = group_store(rank, world_size, timeout) or dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=rank == 0, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                            device_id=device if accelerator else None)
    host = socket.gethostname()
    say(f"{host}$Process {rank}: {rank} # {world_size}")
    say(f"{host}$Process {rank}: Default device is set to {device.index if accelerator else 'cpu'}")
    say(f"Process {rank}: rank from RANK, local rank {local_rank} from LOCAL_RANK, world size from WORLD_SIZE, "
        f"all set by torchrun; backend {backend}")
    report(check_collectives(rank, world_size, device, store), rank, world_size, device)
    dist.destroy_process_group()


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["nccl", "gloo"], help="default: nccl on CUDA, gloo on the CPU "
                        "(the mpi backend takes its ranks from mpirun: run_with_mpirun.py)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds to wait for the other ranks (default 300)")
    args = parser.parse_args()
    if args.timeout <= 0:
        parser.error("--timeout must be positive")
    if "RANK" not in os.environ:
        parser.error("start it with torchrun: torchrun --standalone --nproc_per_node=2 run_with_torchrun.py")
    return args


if __name__ == "__main__":
    try:
        main(parse_args())
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
