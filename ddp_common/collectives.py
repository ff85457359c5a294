"""The collectives every launcher example runs, each checked exactly on every rank.

Every input is built from the rank numbers, so each rank knows the exact answer it must get. The
tensors hold integers: sums and means of small integers are exact, so a check never needs a tolerance
(NCCL's AVG divides an integer sum exactly; a float AVG would round differently from sum / world size).
"""
import socket
import sys
from typing import NamedTuple

import torch
import torch.distributed as dist

from ddp_common.errors import CheckFailed


class Check(NamedTuple):
    name: str
    expected: object
    got: object

    @property
    def ok(self):
        return self.expected == self.got


def say(text):
    """Print in one write, so lines from ranks sharing a terminal or pipe never cut into each other."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def announce(rank, world_size, device):
    """The two lines every rank of the launcher examples prints: who it is and which device it uses."""
    host = socket.gethostname()
    say(f"{host}$Process {rank}: {rank} # {world_size}")
    say(f"{host}$Process {rank}: Default device is set to {device.index if device.type == 'cuda' else 'cpu'}")


def run_all(device, store=None):
    """Run all_reduce (sum and average), all_gather, broadcast, reduce and barrier; return this rank's checks.

    `store` is a key-value store every rank reaches; the barrier check counts arrivals in it. The default
    is the store init_process_group rendezvoused through (torch has no public getter for it)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    ranks = range(world_size)
    checks = []

    def tensor(values):
        return torch.tensor(values, dtype=torch.int64, device=device)

    total = sum(r + 1 for r in ranks)  # 1 + 2 + ... + world_size
    summed = tensor([rank + 1, 10 * (rank + 1)])
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)
    checks.append(Check("all_reduce sum", [total, 10 * total], summed.tolist()))

    # Rank r gives world_size * (r + 1): the mean, world_size * total / world_size = total, is an integer.
    averaged = tensor([world_size * (rank + 1)])
    if dist.get_backend() == "nccl":
        dist.all_reduce(averaged, op=dist.ReduceOp.AVG)
    else:
        dist.all_reduce(averaged, op=dist.ReduceOp.SUM)  # gloo and MPI have no AVG: sum, then divide
        averaged //= world_size
    checks.append(Check("all_reduce avg", [total], averaged.tolist()))

    gathered = [tensor([0, 0]) for _ in ranks]
    dist.all_gather(gathered, tensor([rank, rank * rank]))
    checks.append(Check("all_gather", [[r, r * r] for r in ranks], [t.tolist() for t in gathered]))

    # From the last rank, not rank 0: a broadcast that did nothing would pass on rank 0 anyway.
    source = world_size - 1
    broadcast = tensor([100 + rank])
    dist.broadcast(broadcast, src=source)
    checks.append(Check(f"broadcast from {source}", [100 + source], broadcast.tolist()))

    # Only the destination receives the result of a reduce, so reduce to every rank in turn:
    # each rank checks the one that came to it.
    for destination in ranks:
        reduced = tensor([(rank + 1) * (destination + 1)])
        dist.reduce(reduced, dst=destination, op=dist.ReduceOp.SUM)
        if destination == rank:
            received = Check("reduce to each rank in turn", [total * (rank + 1)], reduced.tolist())
    checks.append(received)

    # A barrier returns nothing to compare; what it promises is that nobody leaves before everyone
    # arrived. So each rank counts itself in the store on the way in, and on the way out finds all of them.
    store = store or dist.distributed_c10d._get_default_store()
    store.add("barrier_check/arrived", 1)
    dist.barrier()
    checks.append(Check("barrier", f"{world_size} arrived", f"{store.add('barrier_check/arrived', 0)} arrived"))
    return checks


def report(checks, device):
    """Agree with the other ranks on which checks failed where, print the table on rank 0, and stop a rank
    that got a wrong value (CheckFailed, naming the collective and the rank). Every rank must call it."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    wrong = torch.zeros(world_size, len(checks), dtype=torch.int64, device=device)
    wrong[rank] = torch.tensor([not check.ok for check in checks], dtype=torch.int64, device=device)
    dist.all_reduce(wrong)  # row r: the checks that failed on rank r
    if rank == 0:
        rows = [("collective", "expected", "got", "ok")]
        for column, check in enumerate(checks):
            bad_ranks = wrong[:, column].nonzero().flatten().tolist()
            ok = "yes" if not bad_ranks else "NO on rank " + ", ".join(map(str, bad_ranks))
            rows.append((check.name, str(check.expected), str(check.got), ok))
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = [" | ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "-+-".join("-" * width for width in widths))
        say(f"Collectives on {world_size} rank(s), as rank 0 saw them:\n" + "\n".join(lines))
    failed = [check for check in checks if not check.ok]
    if failed:
        raise CheckFailed(f"rank {rank} got wrong results: " + "; ".join(
            f"{check.name} gave {check.got}, expected {check.expected}" for check in failed))
