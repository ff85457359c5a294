"""The DDP side of tests/test_fsdp.py's parity test: fsdp.py's model, data, optimizer and batches, trained in
fp32 with DistributedDataParallel instead of FSDP2. Written apart from fsdp.py on purpose, so the comparison
does not share fsdp.py's code. Rank 0 writes the final model and optimizer state to OUT.

    torchrun --standalone --nproc_per_node=2 tests/support/fsdp_ddp_reference.py OUT EPOCHS BATCH_SIZE
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from ddp_common.data import regression_dataset  # noqa: E402
from ddp_common.models import BlockMLP  # noqa: E402


def main(out, epochs, batch_size, seed=0):
    dist.init_process_group("gloo")
    torch.manual_seed(seed)
    dataset = regression_dataset(2048, seed=seed)
    model = DDP(BlockMLP(input_size=20))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=True)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=DistributedSampler(dataset, seed=seed))
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        for source, targets in loader:
            optimizer.zero_grad(set_to_none=True)
            F.mse_loss(model(source), targets).backward()
            optimizer.step()
    if dist.get_rank() == 0:
        names = [name for name, _ in model.module.named_parameters()]
        momentum = {names[i]: state["momentum_buffer"] for i, state in optimizer.state_dict()["state"].items()}
        torch.save({"model": model.module.state_dict(), "momentum": momentum}, out)
    del model, optimizer
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
