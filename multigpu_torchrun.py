"""Step 3 of the DDP tutorial: torchrun starts the processes, restarts them on failure, and the
snapshot makes a restarted run end exactly where an uninterrupted one would.

    torchrun --standalone --nproc_per_node=gpu multigpu_torchrun.py --total_epochs 50 --save_every 10
    torchrun --standalone --nproc_per_node=2 multigpu_torchrun.py --total_epochs 50 --save_every 10  # CPU
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node=2 --max-restarts=3 \
        multigpu_torchrun.py --total_epochs 50 --save_every 10   # survive a crashed worker (README: restarts)

torchrun sets RANK, LOCAL_RANK and WORLD_SIZE (and the rendezvous address) for every process, so the
script no longer spawns or picks ports. Compare with step 2: `diff -u multigpu.py multigpu_torchrun.py`.
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
    rank, local_rank, world_size, local_world_size = torchrun_ranks("multigpu_torchrun.py")
    backend, device = pick_backend_and_device(backend, local_rank, local_world_size)
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout))  # reads torchrun's variables
    return rank, device


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path, device, rank):
        self.rank = rank
        self.device = device
        self.model = model.to(device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.epochs_run = snapshot.load(snapshot_path, self.model, self.optimizer, device)
        if self.epochs_run and self.rank == 0:
            print(f"Resuming from {snapshot_path} at epoch {self.epochs_run}")
        self.model = DDP(self.model, device_ids=[device.index] if device.type == "cuda" else None)

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
        if self.rank == 0:
            print(f"Epoch {epoch} | Batchsize {self.train_data.batch_size} | Steps {len(self.train_data)} | "
                  f"Loss {mean_loss:.6f}")
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
            # Every rank holds the same weights: one copy on disk is enough.
            if self.rank == 0 and (epochs_done % self.save_every == 0 or epochs_done == max_epochs):
                snapshot.save(self.snapshot_path, self.model, self.optimizer, epochs_done)
                print(f"Epoch {epoch} | Snapshot saved at {self.snapshot_path}")
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
    rank, device = ddp_setup(args.backend, args.timeout)
    try:
        dataset, model, optimizer = load_train_objs(args.seed)
        train_data = DataLoader(dataset, batch_size=args.batch_size,
                                sampler=DistributedSampler(dataset, seed=args.seed))
        trainer = Trainer(model, train_data, optimizer, args.save_every, args.snapshot_path, device, rank)
        trainer.train(args.total_epochs)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    parser = cli.ArgumentParser(description="Step 3: launched by torchrun, with exact resume.")
    cli.add_training_args(parser)
    add_backend_arg(parser)
    cli.add_timeout_arg(parser)
    cli.run(main, cli.training_args(parser))
