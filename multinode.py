"""Step 4 of the DDP tutorial: the same training over several machines (nodes), one torchrun on each.

    # on every node, HOST being an address of node 0 that all nodes reach:
    torchrun --nnodes=2 --nproc_per_node=gpu --rdzv_id=job42 --rdzv_backend=c10d --rdzv_endpoint=HOST:29603 \
        multinode.py 50 10
    # two "nodes" on one machine, 2 CPU processes each, a snapshot each (README: several machines):
    torchrun --nnodes=2 --nproc_per_node=2 --rdzv_id=job42 --rdzv_backend=c10d --rdzv_endpoint=127.0.0.1:29603 \
        multinode.py 50 10 --snapshot_path node0.pt     # and the same with node1.pt in a second shell
    # elastic: 1 to 2 nodes, which may join and leave while it runs (README: elastic training):
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=1:2 --nproc_per_node=2 --max_restarts=3 --rdzv_id=job43 \
        --rdzv_backend=c10d --rdzv_endpoint=127.0.0.1:29604 multinode.py 50 1 --snapshot_path node0.pt  # node1.pt

Every node keeps a snapshot on its own disk; all ranks resume from the newest one any node holds, at any world size.
Each step is the one before plus its lesson, so read the steps as diffs (README: the DDP tutorial series):
`diff -u singlegpu.py multigpu.py`, then multigpu.py -> multigpu_torchrun.py -> multinode.py.
"""
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ddp_common import cli, snapshot
from ddp_common.data import regression_dataset
from ddp_common.distributed import check_backend, group_store, require_torchrun, summary_line, synchronize
from ddp_common.models import MLP


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path, device):
        self.device = device
        self.model = model.to(device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.logs = dist.get_rank() == 0  # all ranks hold the same model: rank 0 speaks for all
        self.saves = int(os.environ["LOCAL_RANK"]) == 0  # but every node keeps a snapshot on its own disk
        # Each node resumes from its own disk, and all must start from the same state: the newest wins.
        self.epochs_run, notes = snapshot.load_newest(snapshot_path, self.model, self.optimizer)
        for note in notes:  # where it resumes from, and a world size that changed (README: elastic training)
            self.log(note)
        self.model = DDP(self.model, device_ids=[device.index] if device.type != "cpu" else None)

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(self.model(source), targets)
        loss.backward()  # DDP all-reduces the gradients here, overlapped with the backward pass
        self.optimizer.step()
        return loss.detach()

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        # Summed on the device and read once per epoch: a .item() per step would stall every step.
        loss_sum = torch.zeros((), device=self.device)
        for source, targets in self.train_data:
            source, targets = source.to(self.device), targets.to(self.device)
            loss_sum += self._run_batch(source, targets)
        dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)  # the loss of all ranks, not rank 0's alone
        mean_loss = loss_sum.item() / len(self.train_data)
        self.log(f"Epoch {epoch} | Batchsize {self.train_data.batch_size} | Steps {len(self.train_data)} | "
                 f"Loss {mean_loss:.6f}")
        return mean_loss

    def train(self, max_epochs):
        if self.epochs_run >= max_epochs:
            self.log(f"Nothing to do: {self.snapshot_path} already holds {self.epochs_run} epochs "
                     f"(--total_epochs {max_epochs}); raise --total_epochs to train on")
            return
        start = time.perf_counter()
        for epoch in range(self.epochs_run, max_epochs):
            loss = self._run_epoch(epoch)
            epochs_done = epoch + 1
            if self.saves and (epochs_done % self.save_every == 0 or epochs_done == max_epochs):
                snapshot.save(self.snapshot_path, self.model, self.optimizer, epochs_done)
                self.log(f"Epoch {epoch} | Snapshot saved at {self.snapshot_path}")
        synchronize(self.device)  # the GPU runs asynchronously: the clock must wait for it
        wall = time.perf_counter() - start
        epochs = max_epochs - self.epochs_run
        samples = epochs * len(self.train_data.dataset)
        self.log(summary_line(epochs, epochs * len(self.train_data), loss, samples, wall))

    def log(self, text):
        if self.logs:
            print(text)


def load_train_objs(seed):
    torch.manual_seed(seed)
    train_set = regression_dataset(2048, seed=seed)
    model = MLP(input_size=20)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return train_set, model, optimizer


def main(args):
    require_torchrun(__file__)
    # torchrun numbers the processes: RANK across all nodes (rank 0 logs), LOCAL_RANK on this node (the GPU).
    rank, local_rank, world_size = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    accelerator = torch.accelerator.current_accelerator()  # the GPU's kind (cuda, ...); None without one
    device = torch.device(accelerator.type, local_rank) if accelerator else torch.device("cpu")
    local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])  # the processes on this node, each with its own GPU
    backend = check_backend(args.backend or dist.get_default_backend_for_device(device), device, local_world_size)
    if accelerator:  # before the process group, so NCCL binds this process to its own GPU
        torch.accelerator.set_device_index(device.index)
    # A store of this group's own: torchrun's outlives a restart with the old group's keys (README: restarts).
    dist.init_process_group(backend, store=group_store(rank, world_size, args.timeout), rank=rank,
                            world_size=world_size, timeout=args.timeout, device_id=device if accelerator else None)
    dataset, model, optimizer = load_train_objs(args.seed)
    # Every rank builds the same dataset (same seed) and trains on its own shard; the sampler shuffles.
    train_data = DataLoader(dataset, batch_size=args.batch_size, sampler=DistributedSampler(dataset, seed=args.seed))
    trainer = Trainer(model, train_data, optimizer, args.save_every, args.snapshot_path, device)
    trainer.train(args.total_epochs)
    del trainer  # DDP holds the process group: free it first, so destroy_process_group frees the group
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = cli.ArgumentParser(description="Step 4: several nodes, one torchrun per node.")
    cli.add_training_args(parser)
    cli.add_distributed_args(parser)
    cli.run(main, cli.training_args(parser))
