"""Step 2 of the DDP tutorial: one process per GPU (or --world_size CPU processes), started by mp.spawn.

    python multigpu.py 50 10           # every GPU with nccl, or 2 CPU processes with gloo; writes multigpu.pt

Each step is the one before plus its lesson: `diff -u` it against the one before (docs/tutorial.md).
"""
import argparse
import os
import signal
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.nn  # before any process group: docs/failures.md, clean exits
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from models_and_data import MLP, regression_dataset


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path, device):
        self.device = device
        self.model = model.to(device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.epochs_run = 0
        self.rank = dist.get_rank()
        if os.path.exists(snapshot_path):
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model, device_ids=[device.index] if device.type != "cpu" else None)

    def log(self, text):
        if self.rank == 0:  # every rank holds the same model and loss: rank 0 speaks for all
            print(text)

    def _save_snapshot(self, epoch):
        if self.rank != 0:  # every rank holds the same model: rank 0 alone saves it
            return
        state = {
            "model": self.model.module.state_dict(),  # the model inside DDP, without DDP's "module." prefix
            "optimizer": self.optimizer.state_dict(),
            "rng": torch.get_rng_state(),
            "epochs_run": epoch + 1,
        }
        # Written beside it, then renamed over it: a crash mid-save leaves the previous snapshot whole.
        tmp = self.snapshot_path + ".tmp"
        with open(tmp, "wb") as f:
            torch.save(state, f)
            os.fsync(f.fileno())
        os.replace(tmp, self.snapshot_path)
        self.log(f"Epoch {epoch} | Snapshot saved at {self.snapshot_path}")

    def _load_snapshot(self, path):
        try:  # a bad file named in one line, not a traceback; training on would overwrite it
            state = torch.load(path, map_location="cpu")
        except Exception as error:  # noqa: BLE001  whatever a damaged file raises
            sys.exit(f"error: cannot read the snapshot {path} ({type(error).__name__}: truncated, or not a "
                     "snapshot); move it away or pass another --snapshot_path")
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])  # the momentum, without which resuming is not exact
        except (KeyError, RuntimeError, ValueError) as error:
            why = " ".join(str(error).split())[:300]  # torch's message, on one line
            sys.exit(f"error: the snapshot {path} is of another model or optimizer ({why}); move it away or pass "
                     "another --snapshot_path")
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
        self.log(f"Summary: epochs {epochs} | steps {epochs * len(self.train_data)} | final loss {loss:.6f} | "
                 f"samples/s {samples / wall:.1f} | wall {wall:.2f}s | world size {dist.get_world_size()} | "
                 f"backend {dist.get_backend()}")


def load_train_objs(seed):
    torch.manual_seed(seed)
    train_set = regression_dataset(2048, seed=seed)
    model = MLP(input_size=20)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return train_set, model, optimizer


def main(rank, world_size, args, port):
    # mp.spawn numbers the processes 0 to world_size - 1: the number is the rank, and picks the process's GPU.
    # check_available=True: without it, a CUDA build of torch (PyPI's default on Linux) says cuda without a GPU.
    accelerator = torch.accelerator.current_accelerator(check_available=True)  # None without a usable GPU
    if accelerator and world_size > torch.accelerator.device_count():
        accelerator = None  # more processes than devices (a Mac has one mps device): every process on the CPU
    device = torch.device(accelerator.type, rank) if accelerator else torch.device("cpu")
    backend = args.backend or dist.get_default_backend_for_device(device)
    if backend == "nccl" and device.type != "cuda":
        sys.exit("error: --backend nccl needs a CUDA GPU for each process; leave --backend out for gloo on the CPU")
    if rank == 0:  # rank 0 saves; the launcher stops every rank where it cannot
        check_snapshot_path(args.snapshot_path)
    if accelerator:  # before the process group, so NCCL binds this process to its own GPU
        torch.accelerator.set_device_index(device.index)
    # DDP all-reduces the gradients in the backward pass, over this group of world_size processes.
    # They meet at the port the parent picked.
    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timeout, device_id=device if accelerator else None)
    if rank == 0:
        print(f"Training on {world_size} process{'es' * (world_size > 1)} | device {device.type} | backend {backend}")
    dataset, model, optimizer = load_train_objs(args.seed)
    # Every rank builds the same dataset (same seed) and trains on its own shard; the sampler shuffles.
    train_data = DataLoader(dataset, batch_size=args.batch_size, sampler=DistributedSampler(dataset, seed=args.seed))
    trainer = Trainer(model, train_data, optimizer, args.save_every, args.snapshot_path, device)
    trainer.train(args.total_epochs)
    del trainer  # DDP holds the process group: free it first, so destroy_process_group frees the group
    dist.destroy_process_group()


def spawn(args):
    world_size = args.world_size or torch.accelerator.device_count() or 2  # every GPU, or 2 CPU processes
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does: else each process takes every core
    with socket.socket() as sock:  # a port free now, for the processes to meet at
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.start_processes(worker, args=(world_size, args, port), nprocs=world_size, join=False)
    try:  # mp.spawn(worker, ...), keeping the processes: worker(rank, ...) in each, until all end or one fails
        while not context.join():
            pass
    except mp.ProcessExitedException as error:  # one ended early (it said why, or a signal killed it) and mp.spawn
        # stopped the others (SIGTERM). A killed rank fails its peers' collectives and a peer may end first: name it.
        killed = [(rank, p.exitcode) for rank, p in enumerate(context.processes)
                  if p.exitcode < 0 and p.exitcode != -signal.SIGTERM]
        rank, code = killed[0] if killed else (error.error_index, error.exit_code)
        sys.exit(code if code > 0 else f"process {rank} terminated with signal {signal.Signals(-code).name}; mp.spawn "
                 "stopped the others. Start again to resume from the last snapshot")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("epochs_arg", nargs="?", type=int, default=50, metavar="total_epochs", help="= --total_epochs")
    parser.add_argument("every_arg", nargs="?", type=int, default=10, metavar="save_every", help="= --save_every")
    parser.add_argument("--total_epochs", "--epochs", type=int, help="epochs in all (default 50)")
    parser.add_argument("--save_every", type=int, help="epochs between snapshots; the last is saved too (default 10)")
    parser.add_argument("--batch_size", type=int, default=32, help="samples per step and process (default 32)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data, the model and the shuffle")
    parser.add_argument("--snapshot_path", default="multigpu.pt", help="resume from and save to this file")
    parser.add_argument("--backend", choices=["nccl", "gloo", "mpi"], help="default: nccl on CUDA, gloo on the CPU")
    parser.add_argument("--timeout", type=float, default=300, help="seconds to wait for the other ranks (default 300)")
    parser.add_argument("--world_size", type=int, help="processes to start (default: one per GPU, or 2 on the CPU)")
    args = parser.parse_args(argv)
    args.total_epochs = args.epochs_arg if args.total_epochs is None else args.total_epochs
    args.save_every = args.every_arg if args.save_every is None else args.save_every
    if min(args.total_epochs, args.save_every, args.batch_size, args.timeout) <= 0:
        parser.error("--total_epochs, --save_every, --batch_size and --timeout must be positive")
    if args.world_size is not None and args.world_size <= 0:
        parser.error("--world_size must be positive")
    return args


def check_snapshot_path(path):
    """Stop now, not after the first epochs, where the snapshot cannot be written."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        open(path + ".tmp", "wb").close()
        os.remove(path + ".tmp")
    except OSError as error:
        sys.exit(f"error: cannot write the snapshot {path} ({error.filename}: {error.strerror})")


def worker(rank, *args):  # what mp.spawn runs in each process
    try:
        main(rank, *args)
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


if __name__ == "__main__":
    spawn(parse_args())
