"""Step 6: tensor parallelism splits every block's two linear layers over the ranks; each rank computes every sample.

    torchrun --standalone --nproc_per_node=2 tensor_parallel.py 20 5                    # 2 processes, GPUs or CPU
    torchrun --standalone --nproc_per_node=4 tensor_parallel.py --total_epochs 4 --dtype float64

A block of models_and_data.BlockMLP is x + fc2(relu(fc1(norm(x)))). fc1 is split by output columns
(ColwiseParallel: each rank computes hidden/tp of the hidden units, from the whole input) and fc2 by input rows
(RowwiseParallel: each rank's partial sums of the output, all-reduced). So a block runs one all-reduce forward
(fc2's output) and one backward (the gradient of fc1's input); the norms, inp and out are whole on every rank.
At the start it prints, then trains (Loss: the mean squared error of the epoch):

    Training on 2 processes | device cpu | backend gloo
    Mesh tp 2 | global batch 256, all of it on every rank
    Rank 0 holds fc1.weight [128, 64] of [256, 64] | fc1.bias [128] of [256] | fc2.weight [64, 128] of [64, 256] | ...
    Block 0 | forward fc2 all_reduce x1 | backward fc1 all_reduce x1      (counted in the first step: CommDebugMode)
    Outside the blocks | forward none | backward none
    Epoch 0 | Batchsize 256 | Steps 8 | Loss 1.031492
    ...
    Epoch 4 | Snapshot saved at tensor_parallel_checkpoints/epoch_000005
    ...
    Summary: epochs 20 | steps 160 | final loss 0.086537 | samples/s 2504.6 | wall 16.35s | world size 2 | backend gloo

A second run resumes ("Resuming from tensor_parallel_checkpoints/epoch_000020 at epoch 20, saved as tp 2 on 2
processes"). Checkpoints (DCP, with fsdp_checkpoint.py's complete marker) are keyed by the full model's names, as
pipeline_parallel.py's and nd_parallel.py's are: any of the three resumes from any other's, in any layout (the same
--global_batch_size trains on as it would have). --dtype float64 makes the numbers one process's but for the order
of additions (tests/test_parallelism.py).
"""
import argparse
import gc
import os
import socket
import sys
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.nn  # before any process group: docs/failures.md, clean exits
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader

from fsdp_checkpoint import CheckpointDir, GlobalOrderSampler
from models_and_data import BlockMLP, regression_dataset

# Optimizer state flattened (one key per parameter): any subset of the model saves and loads its own part.
STATE_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path, layout, dtype, device):
        self.device, self.dtype = device, dtype
        self.model = model  # its blocks split over the ranks by parallelize_module
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.sampler = train_data.sampler
        self.position, self.steps_done = 0, 0  # samples of the epoch's order used; steps since the start
        self.snapshot_path, self.layout = snapshot_path, layout
        self.epochs_run = 0
        self.rank = dist.get_rank()
        self.checkpoints = CheckpointDir(snapshot_path, log=self.log)
        where, path = self.checkpoints.newest()  # complete checkpoints only
        if where:
            state = self.state()  # this rank's pieces now: DCP reads into them what they cover of the saved ones
            with self.checkpoints.loading(path, state):  # another model, a missing shard: one line
                dcp.load(state, checkpoint_id=path, process_group=self.checkpoints.group)
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                           options=STATE_OPTIONS)
            self.sampler.check_snapshot(where, path)
            self.epochs_run, self.position, self.steps_done = where["epochs_run"], where["position"], where["steps"]
            self.log(f"Resuming from {path} at epoch {self.epochs_run}, saved as {where.get('layout', '?')} on "
                     f"{where['world_size']} process{'es' * (where['world_size'] > 1)}")

    def log(self, text):
        if self.rank == 0:  # every rank computes the same loss: rank 0 speaks for all (and marks checkpoints)
            print(text)

    def where(self):
        return {"epochs_run": self.epochs_run, "position": self.position, "steps": self.steps_done,
                "dataset_size": self.sampler.size, "seed": self.sampler.seed, "global_batch": self.sampler.global_batch,
                "layout": self.layout}

    def state(self):
        """Model and optimizer state keyed by the full model's parameter names; each rank's pieces (DTensors)."""
        model, optimizer = get_state_dict(self.model, self.optimizer, options=STATE_OPTIONS)
        return {"model": model, "optimizer": optimizer}

    def _save(self):
        path = self.checkpoints.start(self.where())
        self.checkpoints.saving(dcp.save(self.state(), checkpoint_id=path, process_group=self.checkpoints.group))

    def _run_batch(self, source, targets, step_size):
        self.optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(self.model(source), targets, reduction="sum")
        (loss / step_size).backward()  # the mean over the step's samples: each rank has all of them
        self.optimizer.step()
        return loss.detach()

    def _first_step_counted(self, source, targets, step_size):
        """The run's first step under CommDebugMode, which counts the collectives DTensor issues, module by module."""
        with warnings.catch_warnings():  # its module hooks warn that the model's input needs no gradient
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            with CommDebugMode() as counted:
                loss = self._run_batch(source, targets, step_size)
        self.log(collective_lines(counted.comm_module_counts, self.model))
        return loss

    def _run_epoch(self, epoch):
        self.sampler.set_epoch(epoch, self.position)
        trained = self.sampler.size - self.position
        loss_sum = torch.zeros((), device=self.device, dtype=self.dtype)  # read once per epoch, not every step
        for source, targets in self.train_data:
            step_size = len(source)
            source, targets = source.to(self.device, self.dtype), targets.to(self.device, self.dtype)
            run = self._first_step_counted if self.steps_done == self.first_step else self._run_batch
            loss_sum += run(source, targets, step_size)
            self.position, self.steps_done = self.position + step_size, self.steps_done + 1
        mean_loss = loss_sum.item() / trained  # the same on every rank: no reduction needed
        steps = -(-self.sampler.size // self.sampler.global_batch)
        self.log(f"Epoch {epoch} | Batchsize {self.sampler.global_batch} | Steps {steps} | Loss {mean_loss:.6f}")
        self.epochs_run, self.position = epoch + 1, 0
        return mean_loss

    def train(self, max_epochs):
        if self.epochs_run >= max_epochs:
            self.log(f"Nothing to do: {self.snapshot_path} already holds {self.epochs_run} epochs "
                     f"(--total_epochs {max_epochs}); raise --total_epochs to train on")
            return
        start, first_epoch, self.first_step = time.perf_counter(), self.epochs_run, self.steps_done
        for epoch in range(self.epochs_run, max_epochs):
            loss = self._run_epoch(epoch)
            if (epoch + 1) % self.save_every == 0 or epoch + 1 == max_epochs:
                self._save()
            self.checkpoints.commit(wait=True)
        wall = time.perf_counter() - start
        epochs = max_epochs - first_epoch
        samples = epochs * self.sampler.size
        self.log(f"Summary: epochs {epochs} | steps {self.steps_done - self.first_step} | final loss {loss:.6f} | "
                 f"samples/s {samples / wall:.1f} | wall {wall:.2f}s | world size {dist.get_world_size()} | "
                 f"backend {dist.get_backend()}")


def holdings(model):
    """A line of what this rank holds: its piece of each split parameter of a block (every block is split alike),
    and its share of all the parameters."""
    pieces = [f"{name} {list(p.to_local().shape)} of {list(p.shape)}" for name, p in model.blocks[0].named_parameters()
              if isinstance(p, DTensor)]
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    return f"{' | '.join(pieces)} in each block; the rest whole: {local:,} of {total:,} parameters"


def collective_lines(counts, model):
    """Block by block, the collectives each sublayer issued forward and backward (CommDebugMode's counts, keyed
    by the module's path from the model's class name), and what the rest of the model issued."""
    root = type(model).__name__

    def issued(prefix, phase):
        found = [f"{name[len(prefix) + 1:]} {str(op).split('.')[-1]} x{n}" for name, phases in counts.items()
                 if name.startswith(prefix + ".") for op, n in phases[phase].items() if n]
        return ", ".join(found) or "none"

    def total(name, phase):
        return sum(counts.get(name, {}).get(phase, {}).values())

    lines = [f"Block {i} | forward {issued(f'{root}.blocks.{i}', 'forward')} | backward "
             f"{issued(f'{root}.blocks.{i}', 'backward')}" for i in range(len(model.blocks))]
    rest = {phase: total("Global", phase) - sum(total(f"{root}.blocks.{i}", phase) for i in range(len(model.blocks)))
            for phase in ("forward", "backward")}
    lines.append(f"Outside the blocks | forward {rest['forward'] or 'none'} | backward {rest['backward'] or 'none'}")
    return "\n".join(lines)


def load_train_objs(args, mesh, dtype, device):
    torch.manual_seed(args.seed)
    train_set = regression_dataset(2048, seed=args.seed)
    # The same weights on every rank (same seed); parallelize_module keeps each rank's piece of the split ones.
    model = BlockMLP(input_size=20, width=args.width, hidden=args.hidden, depth=args.depth).to(device, dtype)
    for block in model.blocks:  # fc1's output columns and fc2's input rows: the hidden units, split over the ranks
        parallelize_module(block, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    # foreach=False: the parameters are DTensors (split) and plain tensors (whole), which one foreach call cannot mix.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=False)
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
    if rank == 0:  # the snapshot's folder checked now, not after the first epochs; torchrun then stops every rank
        probe = os.path.join(args.snapshot_path, f".probe-{os.getpid()}")
        try:
            os.makedirs(args.snapshot_path, exist_ok=True)
            open(probe, "wb").close()
            os.remove(probe)
        except OSError as error:
            sys.exit(f"error: cannot write the snapshot {args.snapshot_path}: {error.strerror}")
    if accelerator:  # before the process group, so NCCL binds this process to its own GPU
        torch.accelerator.set_device_index(device.index)
    # The blocks' all-reduces run over this group of world_size processes, through the device mesh made of it.
    # A framework that calls main() (Ray Train, say) may own the group already.
    timeout = timedelta(seconds=args.timeout)
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group(backend, store=group_store(rank, world_size, timeout), rank=rank,
                                world_size=world_size, timeout=timeout, device_id=device if accelerator else None)
    if rank == 0:
        print(f"Training on {world_size} process{'es' * (world_size > 1)} | device {device.type} | backend {backend}")
    mesh = dist.device_mesh.init_device_mesh(device.type, (world_size,), mesh_dim_names=("tp",))
    dtype = getattr(torch, args.dtype)
    dataset, model, optimizer = load_train_objs(args, mesh, dtype, device)
    layout = f"tp {world_size}"
    holds = [None] * world_size
    dist.all_gather_object(holds, holdings(model))
    if rank == 0:
        print(f"Mesh {layout} | global batch {args.global_batch_size}, all of it on every rank")
        print("\n".join(f"Rank {r} holds {line}" for r, line in enumerate(holds)))
    # Every rank takes every step's whole batch (rank 0 of a data-parallel world of 1): one order of the dataset
    # per epoch, whose position a checkpoint keeps.
    sampler = GlobalOrderSampler(len(dataset), 0, 1, args.global_batch_size, seed=args.seed)
    train_data = DataLoader(dataset, sampler=sampler, batch_size=None, generator=torch.Generator())
    trainer = Trainer(model, train_data, optimizer, args.save_every, args.snapshot_path, layout, dtype, device)
    trainer.train(args.total_epochs)
    del trainer, model, optimizer  # they hold the process group: free them, so destroy_process_group frees it
    gc.collect()
    mesh._pg_registry.clear()  # DTensor's caches keep the mesh for good, and it its groups (private: no public way)
    if owns_group:
        dist.destroy_process_group()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("epochs_arg", nargs="?", type=int, default=50, metavar="total_epochs", help="= --total_epochs")
    parser.add_argument("every_arg", nargs="?", type=int, default=10, metavar="save_every", help="= --save_every")
    parser.add_argument("--total_epochs", "--epochs", type=int, help="epochs in all (default 50)")
    parser.add_argument("--save_every", type=int, help="epochs between snapshots; the last is saved too (default 10)")
    parser.add_argument("--global_batch_size", type=int, default=256, help="samples per step (default 256); every "
                        "rank computes all of them")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data, the model and the shuffle")
    parser.add_argument("--snapshot_path", default="tensor_parallel_checkpoints", help="the checkpoints' directory")
    parser.add_argument("--backend", choices=["nccl", "gloo", "mpi"], help="default: nccl on CUDA, gloo on the CPU")
    parser.add_argument("--timeout", type=float, default=300, help="seconds to wait for the other ranks (default 300)")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                        help="of the weights and the data; float64 to compare with one process tightly")
    parser.add_argument("--width", type=int, default=64, help="the blocks' width (default 64)")
    parser.add_argument("--hidden", type=int, default=256, help="each block's hidden units, split over the ranks "
                        "(default 256)")
    parser.add_argument("--depth", type=int, default=4, help="blocks (default 4)")
    args = parser.parse_args(argv)
    args.total_epochs = args.epochs_arg if args.total_epochs is None else args.total_epochs
    args.save_every = args.every_arg if args.save_every is None else args.save_every
    if min(args.total_epochs, args.save_every, args.global_batch_size, args.timeout) <= 0:
        parser.error("--total_epochs, --save_every, --global_batch_size and --timeout must be positive")
    if min(args.width, args.hidden, args.depth) <= 0:
        parser.error("--width, --hidden and --depth must be positive")
    if "RANK" not in os.environ:
        parser.error(f"start it with torchrun: torchrun --standalone --nproc_per_node=2 {sys.argv[0]}")
    tp = int(os.environ["WORLD_SIZE"])
    if args.hidden % tp:
        parser.error(f"{tp} processes (tp {tp}) do not divide --hidden {args.hidden}: each rank takes an equal "
                     "share of every block's hidden units")
    return args


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
        print(error.code, file=sys.stderr) if isinstance(error, SystemExit) else sys.excepthook(*sys.exc_info())
        sys.stdout.flush()
        os._exit(1)
