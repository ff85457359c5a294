"""Step 4 of the DDP tutorial: the same training over several machines (nodes), one torchrun on each.

    # on every node; HOST: an address of node 0 that all reach (two nodes on one machine: docs/multinode.md)
    torchrun --nnodes=2 --nproc_per_node=gpu --rdzv_id=job42 --rdzv_backend=c10d --rdzv_endpoint=HOST:29603 \
        --rdzv_conf=join_timeout=120 multinode.py 50 10      # each node keeps multinode.pt on its own disk

Each step is the one before plus its lesson: `diff -u` it against the one before (docs/tutorial.md).
"""
import argparse
import os
import socket
import sys
import time
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.nn  # before any process group: docs/failures.md, clean exits
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
        self.rank, self.local_rank = dist.get_rank(), int(os.environ["LOCAL_RANK"])
        self._load_snapshot(snapshot_path)  # on every rank: each node's own file, then the newest of all
        self.model = DDP(self.model, device_ids=[device.index] if device.type != "cpu" else None)

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
        # Written beside it, then renamed over it: a crash mid-save leaves the previous snapshot whole.
        tmp = f"{self.snapshot_path}.{self.rank}.tmp"  # one per node: nodes may share a filesystem
        with open(tmp, "wb") as f:
            torch.save(state, f)
            os.fsync(f.fileno())
        os.replace(tmp, self.snapshot_path)
        self.log(f"Epoch {epoch} | Snapshot saved at {self.snapshot_path}")

    def _newest(self, state, path):
        # Each node read its own file, and they can differ: a node died between two saves, or joined an elastic
        # job late. Every rank says what it holds; the lowest rank holding the most epochs sends its snapshot to all.
        held = [None] * dist.get_world_size()
        dist.all_gather_object(held, (state["epochs_run"], state.get("run"), path) if state else (0, None, path))
        runs = {run: f"{path} on rank {rank}" for rank, (_, run, path) in enumerate(held) if run}
        if len(runs) > 1:  # another run's snapshot (another job's file?): resuming from either would lose the other
            sys.exit(f"error: the snapshots come from {len(runs)} training runs: {', '.join(runs.values())}; keep "
                     "this job's snapshots and move the others away, or move all away to start afresh")
        source = max(range(len(held)), key=lambda rank: held[rank][0])
        box = [state, uuid.uuid4().hex]
        dist.broadcast_object_list(box, src=source)  # rank `source`'s snapshot (and a new run id), to every rank
        state, epochs = box[0], [entry[0] for entry in held]
        self.run = (state or {}).get("run", box[1])  # the run's id, in every snapshot of it
        if min(epochs) < max(epochs):
            self.log(f"Newest snapshot: {held[source][2]} of rank {source}, sent to every rank (the ranks held "
                     f"{min(epochs)} to {max(epochs)} epochs)")
        if state and state.get("world_size", dist.get_world_size()) != dist.get_world_size():
            self.log(f"World size {state['world_size']} -> {dist.get_world_size()} at epoch {state['epochs_run']}")
        return state

    def _load_snapshot(self, path):
        try:  # a bad file named in one line, not a traceback; training on would overwrite it
            state = torch.load(path, map_location="cpu") if os.path.exists(path) else None
        except Exception as error:  # noqa: BLE001  whatever a damaged file raises
            sys.exit(f"error: cannot read the snapshot {path} ({type(error).__name__}: truncated, or not a "
                     "snapshot); move it away or pass another --snapshot_path")
        state = self._newest(state, path)
        if state is None:  # no node holds one: a fresh start
            return
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


def main(args):
    # torchrun numbers the processes: RANK in the whole job, LOCAL_RANK on this machine (which picks its GPU).
    rank, local_rank, world_size = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])  # the processes on this machine, each with its own GPU
    # check_available=True: without it, a CUDA build of torch (PyPI's default on Linux) says cuda without a GPU.
    accelerator = torch.accelerator.current_accelerator(check_available=True)  # None without a usable GPU
    if accelerator and local_world_size > torch.accelerator.device_count():
        accelerator = None  # more processes than devices (a Mac has one mps device): every process on the CPU
    device = torch.device(accelerator.type, local_rank) if accelerator else torch.device("cpu")
    backend = args.backend or dist.get_default_backend_for_device(device)
    if backend == "nccl" and device.type != "cuda":
        sys.exit("error: --backend nccl needs a CUDA GPU for each process; leave --backend out for gloo on the CPU")
    if rank == 0:  # rank 0 saves; the launcher stops every rank where it cannot
        check_snapshot_path(args.snapshot_path)
    if accelerator:  # before the process group, so NCCL binds this process to its own GPU
        torch.accelerator.set_device_index(device.index)
    # DDP all-reduces the gradients in the backward pass, over this group of world_size processes.
    # A framework that calls main() (Ray Train, say) may own the group already.
    timeout = timedelta(seconds=args.timeout)
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group(backend, store=group_store(rank, world_size, timeout), rank=rank,
                                world_size=world_size, timeout=timeout, device_id=device if accelerator else None)
    if rank == 0:
        print(f"Training on {world_size} process{'es' * (world_size > 1)} | device {device.type} | backend {backend}")
    dataset, model, optimizer = load_train_objs(args.seed)
    # Every rank builds the same dataset (same seed) and trains on its own shard; the sampler shuffles.
    train_data = DataLoader(dataset, batch_size=args.batch_size, sampler=DistributedSampler(dataset, seed=args.seed))
    trainer = Trainer(model, train_data, optimizer, args.save_every, args.snapshot_path, device)
    trainer.train(args.total_epochs)
    del trainer  # DDP holds the process group: free it first, so destroy_process_group frees the group
    if owns_group:
        dist.destroy_process_group()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("epochs_arg", nargs="?", type=int, default=50, metavar="total_epochs", help="= --total_epochs")
    parser.add_argument("every_arg", nargs="?", type=int, default=10, metavar="save_every", help="= --save_every")
    parser.add_argument("--total_epochs", "--epochs", type=int, help="epochs in all (default 50)")
    parser.add_argument("--save_every", type=int, help="epochs between snapshots; the last is saved too (default 10)")
    parser.add_argument("--batch_size", type=int, default=32, help="samples per step and process (default 32)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data, the model and the shuffle")
    parser.add_argument("--snapshot_path", default="multinode.pt", help="resume from and save to this file")
    parser.add_argument("--backend", choices=["nccl", "gloo", "mpi"], help="default: nccl on CUDA, gloo on the CPU")
    parser.add_argument("--timeout", type=float, default=300, help="seconds to wait for the other ranks (default 300)")
    args = parser.parse_args(argv)
    args.total_epochs = args.epochs_arg if args.total_epochs is None else args.total_epochs
    args.save_every = args.every_arg if args.save_every is None else args.save_every
    if min(args.total_epochs, args.save_every, args.batch_size, args.timeout) <= 0:
        parser.error("--total_epochs, --save_every, --batch_size and --timeout must be positive")
    if "RANK" not in os.environ:
        parser.error(f"start it with torchrun: torchrun --standalone --nproc_per_node=2 {sys.argv[0]}")
    return args


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
