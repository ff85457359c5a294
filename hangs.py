"""When training hangs: break one rank on purpose, in each of the classic ways, and find the rank and the
collective (docs/hangs.md). Each way ends within --timeout plus a few seconds, with one line naming the rank,
the collective and where to look next.

    torchrun --standalone --nproc_per_node=2 hangs.py                                   # --fault none: trains
    torchrun --standalone --nproc_per_node=2 hangs.py --fault skip --fault_rank 1 --timeout 10
    torchrun --standalone --nproc_per_node=2 hangs.py --fault other_collective --timeout 10
    torchrun --standalone --nproc_per_node=2 hangs.py --fault other_shape --timeout 10
    torchrun --standalone --nproc_per_node=2 hangs.py --fault stall --timeout 10
    torchrun --standalone --nproc_per_node=2 hangs.py --fault die --timeout 10
    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --standalone --nproc_per_node=2 hangs.py --fault other_shape
    torchfrtrace fr_traces/<the folder the line names>                 # what each rank's flight recorder holds

Each step trains a small MLP with DDP (an all_reduce of the gradients in backward()), then gathers every
rank's loss and gradient norm for the log (an all_gather of a tensor of 2). At step --at_step, rank
--fault_rank breaks:

    skip              it skips the step's all_gather (a rank that takes another branch of an if)
    other_collective  it all_reduces its statistics where the others all_gather theirs
    other_shape       it gathers its loss alone, 1 number where the others gather 2
    stall             it deadlocks in its own code before the step (a lock taken twice: a data loader or a
                      thread that never delivers)
    die               it is killed (SIGKILL), as by the out-of-memory killer

Every rank prints its pid: `py-spy dump --pid PID` or `kill -USR1 PID` (faulthandler, registered here) shows
where it waits while it hangs, and a rank that its launcher stops (SIGTERM) prints where it was.
"""
import faulthandler
import os
import signal
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  imported before any process group: docs/failures.md, clean exits
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ddp_common import cli
from ddp_common.data import regression_dataset
from ddp_common.devices import BACKENDS, check_backend
from ddp_common.models import MLP
from ddp_common.rendezvous import group_store

FAULTS = ("none", "skip", "other_collective", "other_shape", "stall", "die")


def break_rank(fault, step, stats, rank, device):
    """The faulty rank's step: what it does in place of the others' all_gather of `stats` (None: all is done)."""
    say(f"rank {rank}: --fault {fault} at step {step}")
    if fault == "skip":
        return None  # no all_gather: its next collective is the next step's gradient all_reduce
    if fault == "other_collective":
        dist.all_reduce(stats)
        return None
    if fault == "other_shape":
        gathered = [torch.zeros(1, device=device) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, stats[:1])
        return None
    if fault == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    return stats


def stall():
    """A deadlock in the rank's own code: a lock taken twice, as a data loader whose worker never delivers."""
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()  # never returns


def say(text):
    os.write(1, f"{text}\n".encode())  # one write: the ranks share torchrun's stdout


def main(args):
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size, local_world_size = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    if args.fault_rank >= world_size:
        raise cli.FlagError(f"hangs.py: error: --fault_rank {args.fault_rank} is not a rank of {world_size} "
                            f"(0 to {world_size - 1}) (see --help)")
    # Where each rank waits, on demand (kill -USR1 PID) and when the launcher stops it (SIGTERM, chained on).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    accelerator = torch.accelerator.current_accelerator(check_available=True)  # None without a usable GPU
    device = torch.device(accelerator.type, local_rank) if accelerator else torch.device("cpu")
    backend = check_backend(args.backend or dist.get_default_backend_for_device(device), device, local_world_size)
    if accelerator:
        torch.accelerator.set_device_index(device.index)
    dist.init_process_group(backend, store=group_store(rank, world_size, args.timeout), rank=rank,
                            world_size=world_size, timeout=args.timeout, device_id=device if accelerator else None)
    say(f"rank {rank}: pid {os.getpid()} on {os.uname().nodename}")
    torch.manual_seed(args.seed)
    dataset = regression_dataset(4096, seed=args.seed)
    model = DDP(MLP(input_size=20).to(device), device_ids=[device.index] if accelerator else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = DataLoader(dataset, batch_size=args.batch_size, sampler=DistributedSampler(dataset, seed=args.seed))
    if rank == 0:
        print(f"{world_size} ranks | backend {backend} | --timeout {args.timeout.total_seconds():g}s | "
              f"--fault {args.fault} on rank {args.fault_rank} at step {args.at_step}", flush=True)
    step, epoch = 0, 0
    faulty = rank == args.fault_rank and args.fault != "none"
    while step < args.steps:
        data.sampler.set_epoch(epoch)
        for source, targets in data:
            if step >= args.steps:
                break
            if faulty and step == args.at_step and args.fault == "stall":
                say(f"rank {rank}: --fault stall at step {step}")
                stall()
            optimizer.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(source.to(device)), targets.to(device))
            loss.backward()  # DDP all-reduces the gradients here
            optimizer.step()
            grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
            stats = torch.stack([loss.detach(), grad_norm])
            if faulty and step == args.at_step:
                stats = break_rank(args.fault, step, stats, rank, device)
            if stats is not None:
                gathered = [torch.zeros_like(stats) for _ in range(world_size)]
                dist.all_gather(gathered, stats)  # every rank's loss and gradient norm, for the log
                if rank == 0 and step % args.log_every == 0:
                    losses = " ".join(f"{s[0].item():.4f}" for s in gathered)
                    print(f"step {step} | loss per rank {losses}", flush=True)
            step += 1
        epoch += 1
    if rank == 0:
        print(f"Trained {step} steps: no fault, no hang", flush=True)
    del model, optimizer  # DDP holds the process group: free it first
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = cli.ArgumentParser(description="Break one rank on purpose and find it: docs/hangs.md.")
    parser.add_argument("--fault", choices=FAULTS, default="none", help="how the faulty rank breaks (default none)")
    parser.add_argument("--fault_rank", type=cli.non_negative_int, default=1, help="the rank that breaks (default 1)")
    parser.add_argument("--at_step", type=cli.non_negative_int, default=5, help="the step it breaks at (default 5)")
    parser.add_argument("--steps", type=cli.positive_int, default=40, help="steps to train (default 40)")
    parser.add_argument("--log_every", type=cli.positive_int, default=10, help="rank 0 logs every N steps")
    parser.add_argument("--batch_size", type=cli.positive_int, default=32, help="samples per step and rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=BACKENDS, default=None,
                        help="process-group backend (default: the device's, nccl on CUDA GPUs and gloo on the CPU)")
    cli.add_timeout_arg(parser, default=10)
    cli.run(main, parser)
