"""Step 4 of the DDP tutorial: the same training over several machines (nodes), one torchrun on each.

    # on every node; HOST: an address of node 0 that all reach (two nodes on one machine: docs/multinode.md)
    torchrun --nnodes=2 --nproc_per_node=gpu --rdzv_id=job42 --rdzv_backend=c10d --rdzv_endpoint=HOST:29603 \
        --rdzv_conf=join_timeout=120 multinode.py 50 10      # each node keeps multinode.pt on its own disk

Each step is the one before plus its lesson: `diff -u` it against the one before (docs/tutorial.md).
"""
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  imported before any process group: docs/failures.md, clean exits
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ddp_common import cli, snapshot
from ddp_common.data import regression_dataset
from ddp_common.devices import check_backend, share_cores
from ddp_common.models import MLP
from ddp_common.progress import summary_line
from ddp_common.rendezvous import group_store


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path, device):
        self.device = device
        self.model = model.to(device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.epochs_run = 0
        self.rank, self.local_rank = dist.get_rank(), int(os.environ["LOCAL_RANK"])
        # The snapshot, if there is one (None: a fresh start). The process that saves checks now, not at the first
        # save, that it can write it and that no other run is writing it.
        state = self._newest(snapshot.claim(snapshot_path, saves=self.local_rank == 0))  # one file per node
        if state is not None:
            self._load_snapshot(state)
        self.model = DDP(self.model, device_ids=[device.index] if device.type != "cpu" else None)

    def _newest(self, state):
        # Each node read its own file, and they can differ: a node died between two saves, or joined an elastic
        # job late. Every rank says what it holds; the holder of the newest sends it to all.
        held = [None] * dist.get_world_size()
        dist.all_gather_object(held, snapshot.describe(state, self.snapshot_path))  # epochs, run id, world size
        self.run = snapshot.one_run(held)  # snapshots of two different training runs: stop, rather than lose one
        source = max(range(len(held)), key=lambda rank: held[rank][0])  # the lowest rank holding the most epochs
        box = [state]
        dist.broadcast_object_list(box, src=source)  # rank `source`'s snapshot, to every rank
        for line in snapshot.what_changed(held, source, box[0], dist.get_world_size()):
            self.log(line)  # which snapshot won, when the ranks held different ones; a new world size
        return box[0]

    def log(self, text):
        if self.rank == 0:  # every rank holds the same model and loss: rank 0 speaks for all
            print(text)

    def _save_snapshot(self, epoch):
        if self.local_rank != 0:  # every rank holds the same model: each node's first process saves it, on its disk
            return
        state = {
            "model": self.model.module.state_dict(),  # the model inside DDP, without DDP's "module." prefix
            "optimizer": self.optimizer.state_dict(),
            "rng": torch.get_rng_state(),
            "epochs_run": epoch + 1,
            "world_size": dist.get_world_size(),
            "run": self.run,  # the same on every node: snapshots of two runs are never mixed
        }
        snapshot.save(state, self.snapshot_path)  # atomically: a crash mid-save leaves the previous snapshot whole
        self.log(f"Epoch {epoch} | Snapshot saved at {self.snapshot_path}")

    def _load_snapshot(self, state):
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])  # the momentum, without which resuming is not exact
        torch.set_rng_state(state["rng"])  # the shuffle order of the epochs to come
        self.epochs_run = state["epochs_run"]
        self.log(f"Resuming from {self.snapshot_path} at epoch {self.epochs_run}")

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(self.model(source), targets)
        loss.backward()
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
            if (epoch + 1) % self.save_every == 0 or epoch + 1 == max_epochs:
                self._save_snapshot(epoch)
        wall = time.perf_counter() - start  # loss.item() above waited for the device
        epochs = max_epochs - self.epochs_run
        samples = epochs * len(self.train_data.dataset)
        self.log(summary_line(epochs, epochs * len(self.train_data), loss, samples, wall))


def load_train_objs(seed):
    torch.manual_seed(seed)
    train_set = regression_dataset(2048, seed=seed)
    model = MLP(input_size=20)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return train_set, model, optimizer


def main(args):
    # torchrun numbers the processes: RANK in the whole job, LOCAL_RANK on this machine (which picks its GPU).
    rank, local_rank, world_size = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])  # the processes on this machine, each with its own GPU
    # check_available=True: without it, a CUDA build of torch (PyPI's default on Linux) says cuda without a GPU.
    accelerator = torch.accelerator.current_accelerator(check_available=True)  # None without a usable GPU
    device = torch.device(accelerator.type, local_rank) if accelerator else torch.device("cpu")
    backend = check_backend(args.backend or dist.get_default_backend_for_device(device), device, local_world_size)
    if accelerator:  # before the process group, so NCCL binds this process to its own GPU
        torch.accelerator.set_device_index(device.index)
    # DDP all-reduces the gradients in the backward pass, over this group of world_size processes. The group
    # meets in a store of its own: torchrun's outlives a restart with the old group's keys (docs/failures.md).
    dist.init_process_group(backend, store=group_store(rank, world_size, args.timeout), rank=rank,
                            world_size=world_size, timeout=args.timeout, device_id=device if accelerator else None)
    threads = share_cores(device)  # torchrun sets OMP_NUM_THREADS=1 only for 2+ processes a machine: see devices.py
    if rank == 0:
        print(f"Training on {world_size} process{'es' * (world_size > 1)} | device {device.type} | backend {backend}"
              + (f" | {threads}" if threads else ""))
    dataset, model, optimizer = load_train_objs(args.seed)
    # Every rank builds the same dataset (same seed) and trains on its own shard; the sampler shuffles.
    train_data = DataLoader(dataset, batch_size=args.batch_size, sampler=DistributedSampler(dataset, seed=args.seed))
    trainer = Trainer(model, train_data, optimizer, args.save_every, args.snapshot_path, device)
    trainer.train(args.total_epochs)
    del trainer  # DDP holds the process group: free it first, so destroy_process_group frees the group
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = cli.training_parser(__doc__, distributed=True)
    cli.run(main, parser)
