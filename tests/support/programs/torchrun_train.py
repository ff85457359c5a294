"""A torchrun script: env://, evaluation on rank 0 after each epoch while the others wait at a barrier."""
import os
import signal
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

FAULT = os.environ.get("FAULT", "")


def evaluate(model):
    head = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(1, 64), torch.nn.LayerNorm(64),
                                                     torch.nn.Linear(64, 1)) for _ in range(50)])
    with torch.no_grad():
        deadline = time.monotonic() + (3600 if FAULT == "slow" else 0)
        while True:
            head(model(torch.randn(256, 20)))  # the evaluation
            if time.monotonic() > deadline:
                return


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DDP(torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(3):
        for step in range(4):
            if rank == 1 and epoch == 1 and step == 0 and FAULT == "stop":
                print("rank 1: stop at epoch 1", flush=True)
                os.kill(os.getpid(), signal.SIGSTOP)
            optimizer.zero_grad()
            model(torch.randn(32, 20)).pow(2).mean().backward()  # the backward line
            optimizer.step()
        if rank == 0:
            print(f"rank 0: evaluation after epoch {epoch}", flush=True)
            evaluate(model.module)  # rank 0 alone
        dist.barrier()  # the barrier
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
