"""When training hangs: break one rank on purpose, in each of the classic ways, and let the diagnosis tool find
the rank, the collective and the line (docs/hangs.md). Run it under torchdiagnose (pip install ./diagnose):

    torchrun --standalone --nproc_per_node=2 hangs.py                                   # --fault none: trains
    torchdiagnose --timeout 10 torchrun --standalone --nproc_per_node=2 hangs.py --fault skip
    torchdiagnose --timeout 10 torchrun --standalone --nproc_per_node=2 hangs.py --fault other_collective
    torchdiagnose --timeout 10 torchrun --standalone --nproc_per_node=2 hangs.py --fault other_shape
    torchdiagnose --timeout 10 torchrun --standalone --nproc_per_node=2 hangs.py --fault stall
    torchdiagnose --timeout 10 torchrun --standalone --nproc_per_node=2 hangs.py --fault die
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

Without the tool the other ranks wait --timeout (default 300 s) and end with torch's own timeout, which names
neither the rank nor the line.
"""
import argparse
import os
import signal
import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.nn  # before any process group: docs/failures.md, clean exits
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from models_and_data import MLP, regression_dataset

FAULTS = ("none", "skip", "other_collective", "other_shape", "stall", "die")


def say(text):
    os.write(1, f"{text}\n".encode())  # one write: the ranks share one stdout, their lines never mix


def break_rank(fault, step, stats, rank, device):
    """The faulty rank's step: what it does in place of the others' all_gather of `stats` (None: all is done)."""
    say(f"rank {rank}: --fault {fault} at step {step}")
    if fault == "stall":  # a deadlock in the rank's own code: a lock taken twice
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()  # never returns
    if fault == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "skip":
        return None  # no all_gather: its next collective is the next step's gradient all_reduce
    if fault == "other_collective":
        dist.all_reduce(stats)
        return None
    if fault == "other_shape":
        gathered = [torch.zeros(1, device=device) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, stats[:1])
        return None
    return stats


def main(args):
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size, local_world_size = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    accelerator = torch.accelerator.current_accelerator(check_available=True)  # None without a usable GPU
    if accelerator and local_world_size > torch.accelerator.device_count():
        accelerator = None  # more processes than devices (a Mac has one mps device): every process on the CPU
    device = torch.device(accelerator.type, local_rank) if accelerator else torch.device("cpu")
    backend = args.backend or dist.get_default_backend_for_device(device)
    if backend == "nccl" and device.type != "cuda":
        sys.exit("error: --backend nccl needs a CUDA GPU for each process; leave --backend out for gloo on the CPU")
    if accelerator:
        torch.accelerator.set_device_index(device.index)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=args.timeout),
                            device_id=device if accelerator else None)
    say(f"rank {rank}: pid {os.getpid()} on {os.uname().nodename}")
    torch.manual_seed(args.seed)
    dataset = regression_dataset(4096, seed=args.seed)
    model = DDP(MLP(input_size=20).to(device), device_ids=[device.index] if accelerator else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = DataLoader(dataset, batch_size=args.batch_size, sampler=DistributedSampler(dataset, seed=args.seed))
    if rank == 0:
        say(f"{world_size} ranks | backend {backend} | --fault {args.fault} on rank {args.fault_rank} at step "
            f"{args.at_step}")
    step, epoch = 0, 0
    faulty = rank == args.fault_rank and args.fault != "none"
    while step < args.steps:
        data.sampler.set_epoch(epoch)
        for source, targets in data:
            if step >= args.steps:
                break
            if faulty and step == args.at_step and args.fault == "stall":
                break_rank(args.fault, step, None, rank, device)
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
                    say(f"step {step} | loss per rank " + " ".join(f"{s[0].item():.4f}" for s in gathered))
            step += 1
        epoch += 1
    if rank == 0:
        say(f"Trained {step} steps: no fault, no hang")
    del model, optimizer  # DDP holds the process group: free it first
    dist.destroy_process_group()


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fault", choices=FAULTS, default="none", help="how the faulty rank breaks (default none)")
    parser.add_argument("--fault_rank", type=int, default=1, help="the rank that breaks (default 1)")
    parser.add_argument("--at_step", type=int, default=5, help="the step it breaks at (default 5)")
    parser.add_argument("--steps", type=int, default=40, help="steps to train (default 40)")
    parser.add_argument("--log_every", type=int, default=10, help="rank 0 logs every N steps (default 10)")
    parser.add_argument("--batch_size", type=int, default=32, help="samples per step and rank (default 32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=["nccl", "gloo"], help="default: nccl on CUDA, gloo on the CPU")
    parser.add_argument("--timeout", type=float, default=300,
                        help="seconds a collective waits before torch gives up (default 300; the tool's --timeout "
                             "names the rank sooner)")
    args = parser.parse_args()
    if min(args.steps, args.log_every, args.batch_size, args.timeout) <= 0 or min(args.at_step, args.fault_rank) < 0:
        parser.error("--steps, --log_every, --batch_size and --timeout must be positive, --at_step and "
                     "--fault_rank not negative")
    if "RANK" not in os.environ:
        parser.error("start it with torchrun, under the diagnosis tool: python -m torchdiagnose --timeout 10 "
                     "torchrun --standalone --nproc_per_node=2 hangs.py --fault stall")
    if args.fault_rank >= int(os.environ["WORLD_SIZE"]):
        parser.error(f"--fault_rank {args.fault_rank} is not a rank of {os.environ['WORLD_SIZE']} "
                     f"(0 to {int(os.environ['WORLD_SIZE']) - 1})")
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
