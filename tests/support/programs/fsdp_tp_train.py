"""A user's FSDP2 x TP script (the shape of the well-known Llama examples): a 2-D mesh dp x tp, the model from
model.py, its linears split over tp, then sharded over dp. STOP_RANK stops itself at step 3."""
import os
import signal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from model import Model

dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
torch.manual_seed(0)
model = Model()
for block in model.layers:
    parallelize_module(block, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    fully_shard(block, mesh=mesh["dp"])
fully_shard(model, mesh=mesh["dp"])
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(10):
    if step == 3 and rank == int(os.environ.get("STOP_RANK", -1)):
        print(f"rank {rank}: stop at step 3", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    loss = model(torch.randn(8, 32)).pow(2).mean()  # the step's line
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
dist.destroy_process_group()
