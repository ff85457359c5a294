"""Step 4 of the DDP tutorial: the same training over several machines (nodes).

    # on node 0 (HOST is node 0's address, reachable from node 1) and on node 1, the same command but --node-rank=1:
    torchrun --nnodes=2 --node-rank=0 --nproc_per_node=gpu --rdzv-id=job42 --rdzv-backend=c10d \
        --rdzv-endpoint=HOST:29603 multinode.py --total_epochs 50 --save_every 10
    # two "nodes" on one machine, 2 CPU processes each:
    torchrun --nnodes=2 --node-rank=0 --nproc_per_node=2 --rdzv-id=job42 --rdzv-backend=c10d \
        --rdzv-endpoint=127.0.0.1:29603 multinode.py --total_epochs 50 --save_every 10 --snapshot_path node0.pt &
    torchrun --nnodes=2 --node-rank=1 --nproc_per_node=2 --rdzv-id=job42 --rdzv-backend=c10d \
        --rdzv-endpoint=127.0.0.1:29603 multinode.py --total_epochs 50 --save_every 10 --snapshot_path node1.pt

LOCAL_RANK (0..N-1 on every node) picks the GPU; RANK (0..WORLD_SIZE-1 across nodes) names the process.
Snapshots: local rank 0 of every node writes one, so each node can resume from its own disk without a
shared filesystem (on a shared one, the writers replace the file atomically with the same content).
At start every rank checks that all ranks resume from the same epoch, and refuses to train otherwise.
Compare with step 3: `diff -u multigpu_torchrun.py multinode.py`.
"""
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ddp_common import cli, snapshot
from ddp_common.data import regression_dataset
from ddp_common.distributed import (add_backend_arg, pick_backend_and_device, summary_line, synchronize,
                                     torchrun_ranks)
from ddp_common.models import MLP


def ddp_setup(backend, timeout):
    rank, local_rank, world_size, local_world_size = torchrun_ranks("multinode.py")
    backend, device = pick_backend_and_device(backend, local_rank, local_world_size)
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout))  # reads torchrun's variables
    return rank, local_rank, device


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path, device, rank, local_rank):
        self.rank = rank
        self.local_rank = local_rank
        self.device = device
        self.model = model.to(device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.epochs_run = snapshot.load(snapshot_path, self.model, self.optimizer, device)
        self._check_same_resume_epoch()
        if self.epochs_run and self.local_rank == 0:
            print(f"[RANK {self.rank}] Resuming from {snapshot_path} at epoch {self.epochs_run}")
        self.model = DDP(self.model, device_ids=[device.index] if device.type == "cuda" else None)

    def _check_same_resume_epoch(self):
        # Nodes resume from their own snapshots; if one saved an epoch another did not, DDP would
        # silently average gradients of different models. MAX of (e, -e) gives the largest and smallest.
        epochs = torch.tensor([self.epochs_run, -self.epochs_run], device=self.device)
        dist.all_reduce(epochs, op=dist.ReduceOp.MAX)
        newest, oldest = epochs[0].item(), -epochs[1].item()
        if newest != oldest:
            raise cli.UsageError(
                f"ranks disagree on where to resume: snapshots hold {oldest} to {newest} epochs (this rank: "
                f"{self.epochs_run} from {self.snapshot_path}); copy the newest snapshot to every node, or "
                "remove them all to start afresh")

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(self.model(source), targets)
        loss.backward()  # DDP all-reduces the gradients here, overlapped with the backward pass
        self.optimizer.step()
        return loss.detach()

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        loss_sum = torch.zeros((), device=self.device)
        for source, targets in self.train_data:
            source, targets = source.to(self.device), targets.to(self.device)
            loss_sum += self._run_batch(source, targets)
        dist.all_reduce(loss_sum)  # SUM: gloo has no AVG
        mean_loss = loss_sum.item() / (len(self.train_data) * dist.get_world_size())
        print(f"[RANK {self.rank}] Epoch {epoch} | Batchsize {self.train_data.batch_size} | "
              f"Steps {len(self.train_data)} | Loss {mean_loss:.6f}")
        return mean_loss

    def train(self, max_epochs):
        if self.epochs_run >= max_epochs:
            if self.rank == 0:
                print(f"Nothing to do: {self.snapshot_path} already holds {self.epochs_run} epochs "
                      f"(--total_epochs {max_epochs}); raise --total_epochs to train on")
            return
        start = time.perf_counter()
        for epoch in range(self.epochs_run, max_epochs):
            loss = self._run_epoch(epoch)
            epochs_done = epoch + 1
            # Every rank holds the same weights: one copy per node, for the node to resume from.
            if self.local_rank == 0 and (epochs_done % self.save_every == 0 or epochs_done == max_epochs):
                snapshot.save(self.snapshot_path, self.model, self.optimizer, epochs_done)
                print(f"[RANK {self.rank}] Epoch {epoch} | Snapshot saved at {self.snapshot_path}")
        synchronize(self.device)  # CUDA runs asynchronously: the clock must wait for the GPU
        wall = time.perf_counter() - start
        epochs = max_epochs - self.epochs_run
        steps = epochs * len(self.train_data)
        samples = epochs * len(self.train_data.dataset)
        if self.rank == 0:
            print(summary_line(epochs, steps, loss, samples, wall, dist.get_world_size(), dist.get_backend()))


def load_train_objs(seed):
    torch.manual_seed(seed)
    train_set = regression_dataset(2048, seed=seed)  # the same data on every rank: same seed
    model = MLP(input_size=20)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return train_set, model, optimizer


def main(args):
    rank, local_rank, device = ddp_setup(args.backend, args.timeout)
    try:
        dataset, model, optimizer = load_train_objs(args.seed)
        train_data = DataLoader(dataset, batch_size=args.batch_size,
                                sampler=DistributedSampler(dataset, seed=args.seed))
        trainer = Trainer(model, train_data, optimizer, args.save_every, args.snapshot_path, device, rank,
                          local_rank)
        trainer.train(args.total_epochs)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    parser = cli.ArgumentParser(description="Step 4: several nodes, one torchrun per node.")
    cli.add_training_args(parser)
    add_backend_arg(parser)
    cli.add_timeout_arg(parser)
    cli.run(main, cli.training_args(parser))
