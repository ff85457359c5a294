"""The PyTorch DDP tutorial's shape: mp.spawn, MASTER_PORT set here, world_size passed to init_process_group."""
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

FAULT = os.environ.get("FAULT", "")
if FAULT == "stop_at_import" and __name__ == "__mp_main__":  # a spawned process, still importing this script
    try:
        with open("stopped.pid", "x") as f:  # the first to get here
            f.write(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)
    except FileExistsError:
        pass


def setup(rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12355"  # the tutorial's line
    if FAULT == "stop_before_init" and rank == 1:
        print("rank 1: stop_before_init", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def train(rank, world_size):
    setup(rank, world_size)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(10):
        if rank == 1 and step == 3 and FAULT in ("stall", "die"):
            print(f"rank 1: {FAULT} at step 3", flush=True)
            if FAULT == "stall":
                time.sleep(3600)  # the stall
            os.kill(os.getpid(), signal.SIGKILL)
        optimizer.zero_grad()
        model(torch.randn(32, 20)).pow(2).mean().backward()  # the backward line
        optimizer.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    if "OMPI_COMM_WORLD_RANK" in os.environ:
        train(int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"]))
    else:
        mp.spawn(train, args=(2,), nprocs=2)
