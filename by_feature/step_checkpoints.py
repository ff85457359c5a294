"""Step checkpoints: a snapshot every N steps that resumes mid-epoch, exactly, or at another world size with every
sample of the epoch used once.

    torchrun --standalone --nproc_per_node=2 --max_restarts=3 by_feature/step_checkpoints.py --save_every_steps 20
    torchrun --standalone --nproc_per_node=3 by_feature/step_checkpoints.py --save_every_steps 20   # resumed on 3

It pays when an epoch is long: a crash then costs at most N steps, not the epoch. Each epoch has one order of the
whole dataset, and a step takes the next global batch of it, split among the ranks; the snapshot holds how far
into that order the epoch is, which means the same at any world size. The checkpoints go where every rank reads
them: on several nodes, a filesystem they share.
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root, for ddp_common
from ddp_common import cli, snapshot
from ddp_common.data import classification_dataset
from ddp_common.devices import check_backend, share_cores
from ddp_common.models import LinearClassifier
from ddp_common.progress import Progress, summary_line
from ddp_common.rendezvous import group_store
from ddp_common.sharding import GlobalOrderSampler

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
        self.sampler, self.save_every_steps, self.async_save = train_data.sampler, args.save_every_steps, args.async_save
        self.position, self.steps_done = 0, 0  # samples of the epoch used; steps since the start of the run
        # Every rank reads the snapshot (None: a fresh start); rank 0, which writes it, checks now that it can.
        state = snapshot.claim(self.snapshot_path, saves=self.rank == 0)
        if state is not None:
            self.load_snapshot(state)
        self.model = DDP(self.model, device_ids=[device.index] if device.type != "cpu" else None)

    def log(self, text):
        if self.rank == 0:
            print(text)

    def load_snapshot(self, state):
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        self.epochs_run, self.position, self.steps_done = state["epochs_run"], state["position"], state["steps"]
        self.sampler.check_snapshot(state, self.snapshot_path)  # its position counts into one dataset's and seed's order
        self.log(f"Resuming from {self.snapshot_path} at epoch {self.epochs_run}, sample {self.position} of "
                 f"{self.sampler.size} (step {self.steps_done}, saved at world size {state['world_size']})")
        if state["global_batch"] != self.sampler.global_batch:
            self.log(f"Note: steps of {self.sampler.global_batch} samples from here on, not {state['global_batch']}")

    def save_snapshot(self, epoch, progress=None):
        state = {
            "model": self.model.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "rng": torch.get_rng_state(),
            "epochs_run": epoch + (self.position == self.sampler.size),  # completed epochs
            "position": self.position % self.sampler.size,  # samples used of the next epoch's order
            "steps": self.steps_done,
            "global_batch": self.sampler.global_batch, "dataset_size": self.sampler.size, "seed": self.sampler.seed,
            "world_size": dist.get_world_size(),
        }
        if self.rank == 0:  # every rank holds the same weights: one copy on disk is enough
            # Atomically: a crash mid-save leaves the previous one whole. --async_save: copied now, written in a thread.
            snapshot.save(state, self.snapshot_path, background=self.async_save)
            where = f"step {progress.done}/{progress.steps}" if progress else "end"
            saved = "being written in the background to" if self.async_save else "saved at"
            (progress or self).log(f"Epoch {epoch} | {where} | Snapshot {saved} {self.snapshot_path}")

    def run_batch(self, source, targets, step_size):
        self.optimizer.zero_grad(set_to_none=True)
        logits = self.model(source)
        loss = F.cross_entropy(logits, targets, reduction="sum")
        # DDP averages the ranks' gradients; scaled by world size / step size, that is the mean over all the step's
        # samples, however many each rank has (pieces differ by one; a rank's may be empty at the epoch's end).
        (loss * dist.get_world_size() / step_size).backward()
        self.optimizer.step()
        return loss.detach(), (logits.argmax(dim=1) == targets).sum()

    def run_epoch(self, epoch):
        self.sampler.set_epoch(epoch, self.position)  # the epoch's order, from where the snapshot left it
        steps = -(-self.sampler.size // self.sampler.global_batch)
        progress = Progress(epoch, steps, done=steps - len(self.sampler), enabled=self.rank == 0)
        # Loss sum, correct, samples: kept on the device and read once an epoch (.item() per step would stall).
        stats = torch.zeros(3, device=self.device)
        for source, targets in self.train_data:
            step_size = min(self.sampler.global_batch, self.sampler.size - self.position)
            loss_sum, correct = self.run_batch(source.to(self.device), targets.to(self.device), step_size)
            stats += torch.stack([loss_sum, correct, torch.tensor(len(targets), device=self.device)])
            self.position, self.steps_done = self.position + step_size, self.steps_done + 1
            progress.update(step_size)
            if self.steps_done % self.save_every_steps == 0 and self.position < self.sampler.size:
                self.save_snapshot(epoch, progress)
        progress.close()
        self.position = self.sampler.size  # the epoch is done (a resume that found it done trains none of it)
        dist.all_reduce(stats)  # the sums of all ranks: every sample of the epoch counted once
        loss_sum, correct, samples = stats.tolist()
        return loss_sum / samples, correct / samples, int(samples)

    def train(self, max_epochs):
        if self.epochs_run >= max_epochs:
            self.log(f"Nothing to do: {self.snapshot_path} already holds {self.epochs_run} epochs "
                     f"(--total_epochs {max_epochs}); raise --total_epochs to train on")
            return
        steps_per_epoch = -(-self.sampler.size // self.sampler.global_batch)
        self.log(f"{dist.get_world_size()} ranks | {steps_per_epoch} steps per epoch of {self.sampler.global_batch} "
                 f"samples in all | a snapshot every {self.save_every_steps} steps | device {self.device}")
        start, loss, samples, first_step = time.perf_counter(), float("nan"), 0, self.steps_done
        for epoch in range(self.epochs_run, max_epochs):
            epoch_start = time.perf_counter()
            loss, accuracy, epoch_samples = self.run_epoch(epoch)  # .tolist() has waited for the device
            samples += epoch_samples
            self.log(f"Epoch {epoch} | loss {loss:.6f} | accuracy {accuracy:.4f} | samples {epoch_samples} | "
                     f"{time.perf_counter() - epoch_start:.2f}s")
            if (epoch + 1) % self.save_every == 0 or epoch + 1 == max_epochs:
                self.save_snapshot(epoch)
            self.position = 0
        snapshot.finish_saves()  # the last one is on disk before the run says it is done
        epochs = max_epochs - self.epochs_run
        self.log(summary_line(epochs, self.steps_done - first_step, loss, samples, time.perf_counter() - start))


def main(args):
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
    # Steps of the global batch (default: --batch_size per rank), split among however many ranks there are.
    sampler = GlobalOrderSampler(len(train_set), rank, world_size, args.global_batch_size or args.batch_size * world_size,
                                 seed=args.seed)
    # The sampler hands out whole batches. The loader gets a generator of its own: each pass draws a seed, else from
    # the global generator, whose state the snapshot keeps (a resumed part of an epoch would draw once more).
    train_data = DataLoader(train_set, sampler=sampler, batch_size=None, generator=torch.Generator())
    trainer = Trainer(model, train_data, optimizer, args, device)
    trainer.train(args.total_epochs)
    del trainer, optimizer  # what holds the process group (DDP, ZeRO) goes first, so destroy_process_group frees it
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = cli.training_parser(__doc__, total_epochs=5, save_every=1, batch_size=64, positional=False,
                                 distributed=True)
    cli.add_linear_args(parser)  # --input_size, --lr
    parser.add_argument("--save_every_steps", type=cli.positive_int, default=20,
                        help="write a snapshot every N steps, mid-epoch too: a crash costs at most N steps (default 20)")
    parser.add_argument("--async_save", action="store_true",
                        help="write snapshots in a thread while training goes on; a crash may then cost up to 2N steps")
    parser.add_argument("--global_batch_size", type=cli.positive_int,
                        help="samples per step over all ranks (default: --batch_size times the world size); keep it "
                             "when resuming at another world size, and the run trains as it would have")
    cli.run(main, parser)
