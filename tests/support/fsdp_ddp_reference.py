"""The DDP side of tests/test_fsdp.py's parity test: fsdp.py's model, data, optimizer and batches (equal pieces
of every step here, so the plain mean loss is fsdp.py's), trained in fp32 with DistributedDataParallel instead of
FSDP2. Written apart from fsdp.py on purpose, so the comparison
does not share fsdp.py's code. Rank 0 writes the final model and optimizer state to OUT.

    torchrun --standalone --nproc_per_node=2 tests/support/fsdp_ddp_reference.py OUT EPOCHS BATCH_SIZE
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn  # before any process group: docs/failures.md, clean exits
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from models_and_data import BlockMLP, regression_dataset


def main(out, epochs, batch_size, seed=0):
    dist.init_process_group("gloo")
    torch.manual_seed(seed)
    dataset = regression_dataset(2048, seed=seed)
    model = DDP(BlockMLP(input_size=20))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=True)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x, y = dataset.tensors
    for epoch in range(epochs):
        # fsdp.py's data, written out here: one order of the whole dataset an epoch (seeded by seed + epoch), each
        # step the next batch_size * world_size samples of it, rank r taking the r-th piece.
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed + epoch))
        for start in range(0, len(x), batch_size * world_size):
            mine = order[start + rank * batch_size:start + (rank + 1) * batch_size]
            optimizer.zero_grad(set_to_none=True)
            F.mse_loss(model(x[mine]), y[mine]).backward()
            optimizer.step()
    if dist.get_rank() == 0:
        names = [name for name, _ in model.module.named_parameters()]
        momentum = {names[i]: state["momentum_buffer"] for i, state in optimizer.state_dict()["state"].items()}
        torch.save({"model": model.module.state_dict(), "momentum": momentum}, out)
    del model, optimizer
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
