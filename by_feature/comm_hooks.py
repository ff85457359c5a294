"""DDP communication hooks: what DDP all-reduces per step instead of the fp32 gradients.

    torchrun --standalone --nproc_per_node=2 by_feature/comm_hooks.py --comm_hook bf16      # half the bytes
    torchrun --standalone --nproc_per_node=2 by_feature/comm_hooks.py --comm_hook powersgd  # rank-1 factors

fp16 and bf16 cast each gradient bucket to 16 bits; PowerSGD sends low-rank factors of each gradient matrix and
feeds what it left out into the next step (its state is in the snapshot). It pays when the network, not compute,
bounds a step: many ranks over slow links, large layers (docs/features.md, comm hooks).
by_feature/X.py is torchrun_ddp.py plus one feature: `diff -u torchrun_ddp.py by_feature/X.py` (docs/features.md).
"""
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  imported before any process group: docs/failures.md, clean exits
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root, for ddp_common
from ddp_common import cli, comm_hooks, snapshot
from ddp_common.data import classification_dataset
from ddp_common.devices import check_backend, share_cores
from ddp_common.models import LinearClassifier
from ddp_common.progress import summary_line
from ddp_common.rendezvous import group_store

DATASET_SIZE = 4096


class Trainer:
    def __init__(self, model, train_data, optimizer, args, device):
        self.rank = dist.get_rank()
        self.device = device
        self.model = model.to(device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = args.save_every
        self.snapshot_path = args.snapshot_path
        self.epochs_run = 0
        # Every rank reads the snapshot (None: a fresh start); rank 0, which writes it, checks now that it can.
        state = snapshot.claim(self.snapshot_path, saves=self.rank == 0)
        if state is not None:
            self.load_snapshot(state)
        self.model = DDP(self.model, device_ids=[device.index] if device.type != "cpu" else None)
        # What DDP hands to all-reduce in place of the fp32 gradients: (state, hook), or None for DDP's own.
        self.comm_hook = comm_hooks.CommHook(args.comm_hook, args.powersgd_rank, args.powersgd_warmup)
        if (hook := self.comm_hook.prepare(self.model)) is not None:
            self.model.register_comm_hook(*hook)
        if state is not None and (note := self.comm_hook.restore(state.get("comm_hook"))):  # PowerSGD goes on
            self.log(f"Note: {note}")

    def log(self, text):
        if self.rank == 0:
            print(text)

    def load_snapshot(self, state):
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        self.epochs_run = state["epochs_run"]
        self.log(f"Resuming from {self.snapshot_path} at epoch {self.epochs_run}")

    def save_snapshot(self, epoch):
        state = {
            "model": self.model.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "rng": torch.get_rng_state(),
            # PowerSGD's error feedback differs between ranks: gathered from every rank (a collective).
            "comm_hook": self.comm_hook.gather_state(),
            "epochs_run": epoch + 1,
        }
        if self.rank == 0:  # every rank holds the same weights: one copy on disk is enough
            snapshot.save(state, self.snapshot_path)  # atomically: a crash mid-save leaves the previous one whole
            self.log(f"Epoch {epoch} | Snapshot saved at {self.snapshot_path}")

    def run_batch(self, source, targets):
        self.optimizer.zero_grad(set_to_none=True)
        logits = self.model(source)
        loss = F.cross_entropy(logits, targets)
        loss.backward()  # DDP all-reduces the gradients here: every rank steps with the mean over all ranks
        self.optimizer.step()
        return loss.detach() * len(targets), (logits.argmax(dim=1) == targets).sum()

    def run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        # Loss sum, correct, samples: kept on the device and read once an epoch (.item() per step would stall).
        stats = torch.zeros(3, device=self.device)
        for source, targets in self.train_data:
            loss_sum, correct = self.run_batch(source.to(self.device), targets.to(self.device))
            stats += torch.stack([loss_sum, correct, torch.tensor(len(targets), device=self.device)])
        dist.all_reduce(stats)  # the sums of all ranks: every sample of the epoch counted once
        loss_sum, correct, samples = stats.tolist()
        return loss_sum / samples, correct / samples, int(samples)

    def train(self, max_epochs):
        if self.epochs_run >= max_epochs:
            self.log(f"Nothing to do: {self.snapshot_path} already holds {self.epochs_run} epochs "
                     f"(--total_epochs {max_epochs}); raise --total_epochs to train on")
            return
        steps_per_epoch = len(self.train_data)
        self.log(f"{dist.get_world_size()} ranks | {steps_per_epoch} steps per epoch of "
                 f"{self.train_data.batch_size} samples per rank | device {self.device}")
        start, loss, samples = time.perf_counter(), float("nan"), 0
        for epoch in range(self.epochs_run, max_epochs):
            epoch_start = time.perf_counter()
            loss, accuracy, epoch_samples = self.run_epoch(epoch)  # .tolist() has waited for the device
            samples += epoch_samples
            self.log(f"Epoch {epoch} | loss {loss:.6f} | accuracy {accuracy:.4f} | samples {epoch_samples} | "
                     f"{time.perf_counter() - epoch_start:.2f}s")
            if (epoch + 1) % self.save_every == 0 or epoch + 1 == max_epochs:
                self.save_snapshot(epoch)
        epochs = max_epochs - self.epochs_run
        self.log(summary_line(epochs, epochs * steps_per_epoch, loss, samples, time.perf_counter() - start))
        self.log(self.comm_hook.report())  # the bytes this rank handed to all-reduce in its last step


def main(args):
    comm_hooks.check(args.comm_hook, args.powersgd_warmup)  # a hook that cannot run: one line, before any process group
    # torchrun numbers the processes: RANK across all nodes, LOCAL_RANK on this node (it picks the GPU).
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size, local_world_size = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    accelerator = torch.accelerator.current_accelerator(check_available=True)  # None without a usable GPU
    device = torch.device(accelerator.type, local_rank) if accelerator else torch.device("cpu")
    backend = check_backend(args.backend or dist.get_default_backend_for_device(device), device, local_world_size)
    if accelerator:  # before the process group, so NCCL binds this process to its own GPU
        torch.accelerator.set_device_index(device.index)
    # A store of this group's own: torchrun's outlives a restart with the old group's keys (docs/failures.md).
    dist.init_process_group(backend, store=group_store(rank, world_size, args.timeout), rank=rank,
                            world_size=world_size, timeout=args.timeout, device_id=device if accelerator else None)
    threads = share_cores(device)  # processes sharing a machine share its cores
    if rank == 0:
        print(f"backend {backend}" + (f" | {threads}" if threads else ""))
    # The same on every rank (same seed): DistributedSampler then gives each rank its own part of it.
    train_set = classification_dataset(DATASET_SIZE, args.input_size, seed=args.seed)
    torch.manual_seed(args.seed)
    model = LinearClassifier(args.input_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    train_data = DataLoader(train_set, batch_size=args.batch_size, sampler=DistributedSampler(train_set, seed=args.seed))
    trainer = Trainer(model, train_data, optimizer, args, device)
    trainer.train(args.total_epochs)
    del trainer, optimizer  # what holds the process group (DDP, ZeRO) goes first, so destroy_process_group frees it
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = cli.training_parser(__doc__, total_epochs=5, save_every=1, batch_size=64, positional=False,
                                 distributed=True)
    cli.add_linear_args(parser)  # --input_size, --lr
    comm_hooks.add_args(parser)  # --comm_hook, --powersgd_rank, --powersgd_warmup
    cli.run(main, parser)
