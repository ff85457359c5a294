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
import argparse
import copy
import os
import socket
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.nn  # before any process group: docs/failures.md, clean exits
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

DATASET_SIZE = 4096


# The model and data of models_and_data.py, copied so that this file and each by_feature/ file stand alone.
class LinearClassifier(nn.Module):
    def __init__(self, input_size, num_classes=2):
        super().__init__()
        self.linear = nn.Linear(input_size, num_classes)

    def forward(self, x):
        return self.linear(x)


def classification_splits(size, held_out=0, input_size=100, seed=0, label_noise=0.05):
    """(training set, held-out set): two classes split by a fixed random hyperplane, 5% of the labels flipped (a
    linear classifier reaches about 0.95, chance is 0.5). The same on every rank: one seed, a generator of its own."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(size, input_size, generator=generator)
    direction = torch.randn(input_size, generator=generator)

    def labelled(x):
        labels = (x @ direction > 0).long()
        flip = torch.rand(len(x), generator=generator) < label_noise
        return TensorDataset(x, torch.where(flip, 1 - labels, labels))

    train = labelled(x)
    return train, labelled(torch.randn(held_out, input_size, generator=generator))


class GlobalOrderSampler:
    """One order of the whole dataset per epoch (from seed and epoch, at any world size); a step takes its next
    `global_batch` samples, split among the ranks. `position`: the samples of the epoch that steps have used."""

    def __init__(self, size, rank, world_size, global_batch, seed):
        self.size, self.rank, self.world_size, self.global_batch, self.seed = size, rank, world_size, global_batch, seed
        self.epoch, self.position = 0, 0

    def __len__(self):  # the steps left in the epoch
        return -(-(self.size - self.position) // self.global_batch)

    def __iter__(self):
        order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        for start in range(self.position, self.size, self.global_batch):
            step = order[start:start + self.global_batch]  # a rank's piece may be empty at the epoch's end
            bounds = [len(step) * rank // self.world_size for rank in range(self.world_size + 1)]
            yield step[bounds[self.rank]:bounds[self.rank + 1]].tolist()


def read_snapshot(path):
    """The snapshot at `path`, None if there is none; a bad file is named in one line (training would overwrite it)."""
    if not os.path.exists(path):
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001  whatever a damaged file raises: one line, not a traceback
        sys.exit(f"error: cannot read the snapshot {path} ({type(error).__name__}: truncated, or not a snapshot); "
                 "move it away or pass another --snapshot_path")


def save(state, path):
    # Written beside it, then renamed over it: a crash mid-save leaves the previous snapshot whole.
    with open(path + ".tmp", "wb") as f:
        torch.save(state, f)
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


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
        self.sampler, self.save_every_steps = train_data.sampler, args.save_every_steps
        self.async_save = args.async_save
        self.position, self.steps_done = 0, 0  # samples of the epoch used; steps since the start of the run
        self.writer = None  # --async_save: the thread writing the last snapshot
        state = read_snapshot(self.snapshot_path)  # every rank resumes from it; None: a fresh start
        if state is not None:
            self.load_snapshot(state)
        self.model = DDP(self.model, device_ids=[device.index] if device.type != "cpu" else None)

    def log(self, text):
        if self.rank == 0:
            print(text)

    def load_snapshot(self, state):
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])  # the momentum, without which resuming is not exact
        except (KeyError, RuntimeError, ValueError) as error:
            sys.exit(f"error: the snapshot {self.snapshot_path} is of another model or optimizer "
                     f"({str(error).splitlines()[0]}); move it away or pass another --snapshot_path")
        torch.set_rng_state(state["rng"])
        self.epochs_run, self.position, self.steps_done = state["epochs_run"], state["position"], state["steps"]
        for key, here in (("dataset_size", self.sampler.size), ("seed", self.sampler.seed)):  # the position's order
            if state[key] != here:
                sys.exit(f"error: {self.snapshot_path} was made with another {key.replace('_', ' ')} ({state[key]}, "
                         f"here {here}): its position means nothing here; move it away to start afresh")
        self.log(f"Resuming from {self.snapshot_path} at epoch {self.epochs_run}, sample {self.position} of "
                 f"{self.sampler.size} (step {self.steps_done}, saved at world size {state['world_size']})")
        if state["global_batch"] != self.sampler.global_batch:
            self.log(f"Note: steps of {self.sampler.global_batch} samples from here on, not {state['global_batch']}")

    def save_snapshot(self, epoch, where="end"):
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
            if self.writer is not None:
                self.writer.join()  # one write at a time
            if self.async_save:  # copied now (training changes the tensors next), written in a thread meanwhile
                self.writer = threading.Thread(target=save, args=(copy.deepcopy(state), self.snapshot_path))
                self.writer.start()
            else:
                save(state, self.snapshot_path)
            saved = "being written in the background to" if self.async_save else "saved at"
            self.log(f"Epoch {epoch} | {where} | Snapshot {saved} {self.snapshot_path}")

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
        self.sampler.epoch, self.sampler.position = epoch, self.position  # the epoch's order, from where it was left
        steps = -(-self.sampler.size // self.sampler.global_batch)
        first, start, from_position = steps - len(self.sampler), time.perf_counter(), self.position
        # Loss sum, correct, samples: kept on the device and read once an epoch (.item() per step would stall).
        stats = torch.zeros(3, device=self.device)
        for done, (source, targets) in enumerate(self.train_data, start=first + 1):
            step_size = min(self.sampler.global_batch, self.sampler.size - self.position)
            loss_sum, correct = self.run_batch(source.to(self.device), targets.to(self.device), step_size)
            stats += torch.stack([loss_sum, correct, torch.tensor(len(targets), device=self.device)])
            self.position, self.steps_done = self.position + step_size, self.steps_done + 1
            if done % max(1, steps // 10) == 0:  # a line every tenth of the epoch
                seconds = time.perf_counter() - start
                self.log(f"Epoch {epoch} | step {done}/{steps} | {(self.position - from_position) / seconds:.1f} "
                         f"samples/s | {(steps - done) * seconds / (done - first):.0f}s left in the epoch")
            if self.steps_done % self.save_every_steps == 0 and self.position < self.sampler.size:
                self.save_snapshot(epoch, f"step {done}/{steps}")
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
        if self.writer is not None:
            self.writer.join()  # the last snapshot is on disk before the run says it is done
        epochs, wall = max_epochs - self.epochs_run, time.perf_counter() - start
        self.log(f"Summary: epochs {epochs} | steps {self.steps_done - first_step} | final loss {loss:.6f} | "
                 f"samples/s {samples / wall:.1f} | wall {wall:.2f}s | world size {dist.get_world_size()} | "
                 f"backend {dist.get_backend()}")


def check_snapshot_path(path):
    """Stop now, not after the first epochs, where the snapshot cannot be written."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        open(path + ".tmp", "wb").close()
        os.remove(path + ".tmp")
    except OSError as error:
        sys.exit(f"error: cannot write the snapshot {path} ({error.filename}: {error.strerror})")


def group_store(rank, world_size, timeout):
    """Under torchrun, a store of this group's own: torchrun's outlives a restart with the dead group's keys, and a
    restarted rank can read a dead peer's address and burn the restart (pytorch/pytorch#135712, torch 2.13 too)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    host = os.environ["MASTER_ADDR"]
    torchrun_store = dist.TCPStore(host, int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    if rank == 0:  # a fresh store, listening at the rendezvous address alone; its port posted in torchrun's
        listener = socket.create_server((host, 0), family=socket.getaddrinfo(host, 0)[0][0])
        store = dist.TCPStore(host, listener.getsockname()[1], world_size, is_master=True, timeout=timeout,
                              wait_for_workers=False, master_listen_fd=listener.detach())
        torchrun_store.set("group_store_port", str(store.port))
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while time.monotonic() < deadline:  # where nothing answers at the posted port, the post is the dead group's
        port = int(torchrun_store.get("group_store_port"))
        try:
            socket.create_connection((host, port), timeout=3).close()  # refused at once where rank 0 died
            return dist.TCPStore(host, port, is_master=False, timeout=timeout)
        except OSError:
            time.sleep(0.1)
    sys.exit(f"error: rank 0 opened no store for this group within --timeout {timeout.total_seconds():g}s")


def main(args):
    # torchrun numbers the processes: RANK across all nodes, LOCAL_RANK on this node (it picks the GPU).
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size, local_world_size = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    accelerator = torch.accelerator.current_accelerator(check_available=True)  # None without a usable GPU
    if accelerator and local_world_size > torch.accelerator.device_count():
        accelerator = None  # more processes than devices (a Mac has one mps device): every process on the CPU
    device = torch.device(accelerator.type, local_rank) if accelerator else torch.device("cpu")
    backend = args.backend or dist.get_default_backend_for_device(device)
    if backend == "nccl" and device.type != "cuda":
        sys.exit("error: --backend nccl needs a CUDA GPU for each process; leave --backend out for gloo on the CPU")
    if rank == 0:  # the snapshot's folder checked now, not after the first epochs; torchrun then stops every rank
        check_snapshot_path(args.snapshot_path)
    if accelerator:  # before the process group, so NCCL binds this process to its own GPU
        torch.accelerator.set_device_index(device.index)
    # A framework that calls main() (Ray Train, say) may own the process group already.
    timeout = timedelta(seconds=args.timeout)
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group(backend, store=group_store(rank, world_size, timeout), rank=rank,
                                world_size=world_size, timeout=timeout, device_id=device if accelerator else None)
    # The same on every rank (same seed): the sampler then gives each rank its own part of it.
    train_set, _ = classification_splits(DATASET_SIZE, 0, args.input_size, seed=args.seed)
    torch.manual_seed(args.seed)
    model = LinearClassifier(args.input_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # Steps of the global batch (default: --batch_size per rank), split among however many ranks there are.
    global_batch = args.global_batch_size or args.batch_size * world_size
    sampler = GlobalOrderSampler(len(train_set), rank, world_size, global_batch, seed=args.seed)
    # Whole batches from the sampler; a generator of the loader's own (each pass draws a seed from it, not from the
    # global one, whose state the snapshot keeps: a resumed part of an epoch would draw once more).
    train_data = DataLoader(train_set, sampler=sampler, batch_size=None, generator=torch.Generator())
    trainer = Trainer(model, train_data, optimizer, args, device)
    trainer.train(args.total_epochs)
    del trainer, optimizer  # what holds the process group (DDP, ZeRO) goes first, so destroy_process_group frees it
    if owns_group:
        dist.destroy_process_group()


def positive_int(text):
    if not text.lstrip("-").isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return int(text)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--total_epochs", "--epochs", type=positive_int, default=5, help="epochs in all (default 5)")
    parser.add_argument("--save_every", type=positive_int, default=1, help="epochs between snapshots (default 1)")
    parser.add_argument("--batch_size", type=positive_int, default=64, help="samples per step and rank (default 64)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data, the model and the shuffle")
    parser.add_argument("--snapshot_path", default=os.path.splitext(os.path.basename(__file__))[0] + ".pt",
                        help="resume from and save to this file (default: the script's name, .pt)")
    parser.add_argument("--backend", choices=["nccl", "gloo", "mpi"], help="default: nccl on CUDA, gloo on the CPU")
    parser.add_argument("--timeout", type=float, default=300, help="seconds to wait for the other ranks (default 300)")
    parser.add_argument("--input_size", type=positive_int, default=100, help="features per sample (default 100)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate, momentum 0.9 (default 0.05)")
    parser.add_argument("--save_every_steps", type=positive_int, default=20,
                        help="write a snapshot every N steps, mid-epoch too: a crash costs at most N steps "
                             "(default 20)")
    parser.add_argument("--async_save", action="store_true",
                        help="write snapshots in a thread while training goes on; a crash may then cost up to 2N steps")
    parser.add_argument("--global_batch_size", type=positive_int,
                        help="samples per step over all ranks (default: --batch_size times the world size); keep "
                             "it to resume at another world size as the run would have trained")
    args = parser.parse_args(argv)
    if min(args.timeout, args.lr) <= 0:
        parser.error("--timeout and --lr must be positive")
    if "RANK" not in os.environ:
        parser.error(f"start it with torchrun: torchrun --standalone --nproc_per_node=2 {sys.argv[0]}")
    return args


if __name__ == "__main__":
    try:
        main(parse_args())
    except (Exception, SystemExit) as error:
        if not dist.is_initialized():  # no process group: Python's own exit is safe
            raise
        # The group lives on: Python's exit can stall or abort in gloo's threads. Say why as Python would; leave now.
        if isinstance(error, SystemExit):  # sys.exit("error: ...")
            print(error.code, file=sys.stderr)
        else:  # the traceback, through any hook a tool installed
            sys.excepthook(*sys.exc_info())
        sys.stdout.flush()
        os._exit(1)
