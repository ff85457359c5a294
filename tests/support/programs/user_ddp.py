"""A user's DDP script: torch only. FAULT=stall|die|skip|shape breaks rank FAULT_RANK at step AT_STEP."""
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.distributed.nn
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

FAULT, FAULT_RANK, AT_STEP = os.environ.get("FAULT", ""), int(os.environ.get("FAULT_RANK", 1)), 3


def train(rank, world_size):
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(int(os.environ.get("STEPS", 12))):
        if FAULT and rank == FAULT_RANK and step == AT_STEP:
            print(f"rank {rank}: {FAULT} at step {step}", flush=True)
            while FAULT == "stall" and not os.path.exists(os.environ.get("STALL_UNTIL", "/nonexistent")):
                time.sleep(float(os.environ.get("STALL_S", 3600)))  # the stall
            if FAULT == "die":
                os.kill(os.getpid(), signal.SIGKILL)
        loss = model(torch.randn(32, 20)).pow(2).mean()
        loss.backward()  # the backward line
        optimizer.step()
        optimizer.zero_grad()
        numbers = torch.tensor([float(step), loss.item()])
        if FAULT == "shape" and rank == FAULT_RANK and step == AT_STEP:
            numbers = torch.zeros(3)
        if not (FAULT == "skip" and rank == FAULT_RANK and step == AT_STEP):
            gathered = [torch.zeros_like(numbers) for _ in range(world_size)]
            dist.all_gather(gathered, numbers)  # the all_gather line
    print(f"rank {rank} done", flush=True)
    del model  # DDP holds the group: free it first, or destroy_process_group cannot
    dist.destroy_process_group()


def spawned(rank, world_size):
    train(rank, world_size)


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "OMPI_COMM_WORLD_RANK" in os.environ:  # mpirun
        train(int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"]))
    elif "SLURM_PROCID" in os.environ:  # srun
        train(int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"]))
    elif "RANK" in os.environ:  # torchrun
        train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    else:
        mp.spawn(spawned, args=(2,), nprocs=2)
