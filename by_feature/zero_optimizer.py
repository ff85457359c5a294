"""A sharded optimizer (ZeroRedundancyOptimizer): each rank keeps the optimizer state of its share of the parameters.

    torchrun --standalone --nproc_per_node=2 by_feature/zero_optimizer.py

It pays when the optimizer state (Adam's two moments: twice the model) is what does not fit: each rank holds 1 /
world size of it. The snapshot holds the whole state, consolidated on rank 0.
by_feature/X.py is torchrun_ddp.py plus one feature: `diff -u torchrun_ddp.py by_feature/X.py` (docs/features.md).
"""
import argparse
import os
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.nn  # before any process group: docs/failures.md, clean exits
import torch.nn.functional as F
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

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
        self.epochs_run = state["epochs_run"]
        self.log(f"Resuming from {self.snapshot_path} at epoch {self.epochs_run}")

    def save_snapshot(self, epoch):
        self.optimizer.consolidate_state_dict(to=0)  # every rank sends its shard: rank 0 gets the whole state
        state = {
            "model": self.model.module.state_dict(),
            "optimizer": self.optimizer.state_dict() if self.rank == 0 else None,  # only rank 0 has it whole
            "rng": torch.get_rng_state(),
            "epochs_run": epoch + 1,
        }
        if self.rank == 0:  # every rank holds the same weights: one copy on disk is enough
            save(state, self.snapshot_path)
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
        epochs, wall = max_epochs - self.epochs_run, time.perf_counter() - start
        self.log(f"Summary: epochs {epochs} | steps {epochs * steps_per_epoch} | final loss {loss:.6f} | "
                 f"samples/s {samples / wall:.1f} | wall {wall:.2f}s | world size {dist.get_world_size()} | "
                 f"backend {dist.get_backend()}")
        held = [None] * dist.get_world_size()  # the bytes of optimizer state each rank holds: its shard (a collective)
        shard = [v for s in self.optimizer.optim.state.values() for v in s.values() if torch.is_tensor(v)]  # local
        dist.all_gather_object(held, sum(v.numel() * v.element_size() for v in shard))
        self.log(f"Optimizer state | {', '.join(map(str, held))} bytes on ranks 0 to {len(held) - 1} "
                 f"({sum(held)} in all) | ZeroRedundancyOptimizer")


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
    # The same on every rank (same seed): DistributedSampler then gives each rank its own part of it.
    train_set, _ = classification_splits(DATASET_SIZE, 0, args.input_size, seed=args.seed)
    torch.manual_seed(args.seed)
    model = LinearClassifier(args.input_size)
    # Each rank keeps the momentum of its share of the parameters only, steps them, and broadcasts them.
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=args.lr, momentum=0.9)
    sampler = DistributedSampler(train_set, seed=args.seed)
    train_data = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
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
