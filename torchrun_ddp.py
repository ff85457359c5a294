"""A linear classifier trained with DDP under torchrun: loss and accuracy reduced over all ranks each epoch,
gradient accumulation with no_sync, mixed precision, and snapshots to resume from.

    torchrun --nproc_per_node=2 --nnodes=1 --node_rank=0 --master_addr=127.0.0.1 --master_port=29500 \
        torchrun_ddp.py --backend gloo --total_epochs 5 --batch_size 64 --input_size 100
    torchrun --standalone --nproc_per_node=gpu torchrun_ddp.py --total_epochs 5      # every GPU, nccl
    # the same weights as --batch_size 64 (up to float rounding), with a quarter of the activations in memory:
    torchrun --standalone --nproc_per_node=2 torchrun_ddp.py --batch_size 16 --accumulation_steps 4
    # bf16 autocast (fp16 with a GradScaler on GPUs without bf16); started again, it resumes from linear.pt:
    torchrun --standalone --nproc_per_node=2 torchrun_ddp.py --amp

Every rank builds the same dataset from --seed and DistributedSampler hands each rank its own shard, so an
optimizer step sees batch_size * accumulation_steps * world_size samples in all.
"""
import contextlib
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ddp_common import cli, snapshot
from ddp_common.data import classification_dataset
from ddp_common.distributed import check_backend, group_store, require_torchrun, summary_line, synchronize
from ddp_common.models import LinearClassifier

DATASET_SIZE = 4096


def amp_dtype(device):
    """bf16 where the hardware has it: same exponent range as fp32, so no loss scaling is needed."""
    if device.type == "cpu" or torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float16


class Trainer:
    def __init__(self, model, train_data, optimizer, args, device, rank):
        self.rank = rank
        self.device = device
        self.model = model.to(device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.accumulation_steps = args.accumulation_steps
        self.snapshot_path = args.snapshot_path
        self.save_every = args.save_every
        self.autocast_dtype = amp_dtype(device) if args.amp else None
        # fp16 gradients underflow without loss scaling; with bf16 or fp32 the scaler is a no-op passthrough.
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.autocast_dtype == torch.float16)
        self.epochs_run = snapshot.load(self.snapshot_path, self.model, self.optimizer, scaler=self.scaler)
        if self.epochs_run and rank == 0:
            print(f"Resuming from {self.snapshot_path} at epoch {self.epochs_run}")
        self.model = DDP(self.model, device_ids=[device.index] if device.type != "cpu" else None)

    def _forward(self, source):
        if self.autocast_dtype is None:
            return self.model(source)
        with torch.autocast(self.device.type, dtype=self.autocast_dtype):
            return self.model(source)

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        # [loss sum, correct, samples] stay on the device: reading them every step (.item()) would stall
        # the GPU once per step; one all_reduce at the end of the epoch is all the printout needs.
        stats = torch.zeros(3, device=self.device)
        micro_batches = len(self.train_data)
        samples_per_rank = len(self.train_data.sampler)
        step_samples = self.train_data.batch_size * self.accumulation_steps
        for i, (source, targets) in enumerate(self.train_data):
            source, targets = source.to(self.device), targets.to(self.device)
            first_of_step = i % self.accumulation_steps == 0
            last_of_step = (i + 1) % self.accumulation_steps == 0 or i + 1 == micro_batches
            if first_of_step:
                self.optimizer.zero_grad(set_to_none=True)
            # The loss is averaged over the whole step, not the micro-batch: dividing each micro-batch's
            # sum by the step's sample count is the usual loss / K for a full step, and also weights a
            # short last step exactly as one batch of the same samples would be.
            in_step = min(step_samples, samples_per_rank - (i // self.accumulation_steps) * step_samples)
            # no_sync: backward only adds into .grad; the last micro-batch's backward all-reduces the sum.
            with contextlib.nullcontext() if last_of_step else self.model.no_sync():
                logits = self._forward(source).float()
                loss = F.cross_entropy(logits, targets, reduction="sum")
                self.scaler.scale(loss / in_step).backward()
            if last_of_step:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            stats[0] += loss.detach()
            stats[1] += (logits.argmax(dim=1) == targets).sum()
            stats[2] += len(targets)
        dist.all_reduce(stats)  # sums of loss, correct and samples over all ranks
        loss_sum, correct, samples = stats.tolist()
        return loss_sum / samples, correct / samples, int(samples)

    def train(self, max_epochs):
        if self.epochs_run >= max_epochs:
            if self.rank == 0:
                print(f"Nothing to do: {self.snapshot_path} already holds {self.epochs_run} epochs "
                      f"(--total_epochs {max_epochs}); raise --total_epochs to train on")
            return
        steps_per_epoch = -(-len(self.train_data) // self.accumulation_steps)
        if self.rank == 0:
            print(f"{dist.get_world_size()} ranks | {steps_per_epoch} steps per epoch of {self.accumulation_steps} "
                  f"x {self.train_data.batch_size} samples per rank | "
                  f"amp {self.autocast_dtype or 'off'} | device {self.device}")
        loss, samples = float("nan"), 0
        synchronize(self.device)
        start = time.perf_counter()
        for epoch in range(self.epochs_run, max_epochs):
            epoch_start = time.perf_counter()
            loss, accuracy, epoch_samples = self._run_epoch(epoch)  # .tolist() has waited for the device
            samples += epoch_samples
            if self.rank == 0:
                print(f"Epoch {epoch} | loss {loss:.6f} | accuracy {accuracy:.4f} | samples {epoch_samples} | "
                      f"{time.perf_counter() - epoch_start:.2f}s")
            epochs_done = epoch + 1
            # Every rank holds the same weights: one copy on disk is enough.
            if self.rank == 0 and (epochs_done % self.save_every == 0 or epochs_done == max_epochs):
                snapshot.save(self.snapshot_path, self.model, self.optimizer, epochs_done, scaler=self.scaler)
                print(f"Epoch {epoch} | Snapshot saved at {self.snapshot_path}")
        synchronize(self.device)
        wall = time.perf_counter() - start
        epochs = max_epochs - self.epochs_run
        if self.rank == 0:
            print(summary_line(epochs, epochs * steps_per_epoch, loss, samples, wall))


def main(args):
    require_torchrun(__file__)
    # torchrun numbers the processes: RANK across all nodes, LOCAL_RANK on this node (it picks the GPU).
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size, local_world_size = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    accelerator = torch.accelerator.current_accelerator()  # the GPU's kind (cuda, ...); None without one
    device = torch.device(accelerator.type, local_rank) if accelerator else torch.device("cpu")
    backend = check_backend(args.backend or dist.get_default_backend_for_device(device), device, local_world_size)
    if accelerator:  # before the process group, so NCCL binds this process to its own GPU
        torch.accelerator.set_device_index(device.index)
    # A store of this group's own: torchrun's outlives a restart with the old group's keys (README: restarts).
    dist.init_process_group(backend, store=group_store(rank, world_size, args.timeout), rank=rank,
                            world_size=world_size, timeout=args.timeout, device_id=device if accelerator else None)
    dataset = classification_dataset(DATASET_SIZE, args.input_size, seed=args.seed)  # the same on every rank
    torch.manual_seed(args.seed)
    model = LinearClassifier(args.input_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    train_data = DataLoader(dataset, batch_size=args.batch_size, sampler=DistributedSampler(dataset, seed=args.seed))
    trainer = Trainer(model, train_data, optimizer, args, device, rank)
    trainer.train(args.total_epochs)
    del trainer  # DDP holds the process group: free it first, so destroy_process_group frees the group
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = cli.ArgumentParser(description="A linear classifier with DDP under torchrun.")
    cli.add_training_args(parser, total_epochs=5, save_every=1, batch_size=64, positional=False,
                          snapshot_path="linear.pt")
    cli.add_linear_args(parser)
    parser.add_argument("--accumulation_steps", type=cli.positive_int, default=1,
                        help="micro-batches whose gradients add up before one all-reduce and optimizer step")
    parser.add_argument("--amp", action="store_true",
                        help="autocast to bf16 (fp16 with loss scaling on GPUs without bf16)")
    cli.add_distributed_args(parser)
    cli.run(main, cli.training_args(parser))
