"""Step 5: FSDP2 shards the model, its gradients and its optimizer state over the ranks; each rank saves its shards.

    torchrun --standalone --nproc_per_node=2 fsdp.py 50 10 --amp --async_save   # 2 processes (GPUs, or CPU with gloo)
    torchrun --standalone --nproc_per_node=2 fsdp.py 50 10 --save_every_steps 20   # mid-epoch checkpoints too

A checkpoint is a directory of shards (fsdp_checkpoints/epoch_000010/, fsdp_checkpoint.py); a run resumes from the
newest complete one, at any world size, mid-epoch too. On several nodes, --snapshot_path on a filesystem they share.
Its lesson, as a diff: `diff -u multigpu_torchrun.py fsdp.py` (docs/fsdp.md).
"""
import argparse
import gc
import os
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.nn  # before any process group: docs/failures.md, clean exits
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import distribute_tensor
from torch.utils.data import DataLoader

from fsdp_checkpoint import CheckpointDir, GlobalOrderSampler, check_folder, memory_report
from models_and_data import BlockMLP, regression_dataset


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, save_every_steps, snapshot_path, async_save, device,
                 skip_damaged=False):
        self.device = device
        self.model = model  # sharded by fully_shard, on the device
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.save_every_steps = save_every_steps
        self.sampler = train_data.sampler
        self.position, self.steps_done = 0, 0  # samples of the epoch's order used; steps since the start
        self.snapshot_path = snapshot_path
        self.epochs_run = 0
        self.rank = dist.get_rank()
        self.save = dcp.async_save if async_save else dcp.save  # async: copies the shards, writes them in a thread
        # Every rank saves its own shards there; rank 0 marks a checkpoint complete once all are written, and says so.
        self.checkpoints = CheckpointDir(snapshot_path, log=self.log, skip_damaged=skip_damaged)
        # Complete checkpoints only, their files checked against their sums, made with this model, data and batch.
        where, path = self.checkpoints.newest(self.where())
        if where:
            state = self.state()  # this rank's shards now: DCP reads into them what they cover of the saved ones
            with self.checkpoints.loading(path, state):  # another model or optimizer layout: one line
                dcp.load(state, checkpoint_id=path, process_group=self.checkpoints.group)
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
            self.epochs_run, self.position, self.steps_done = where["epochs_run"], where["position"], where["steps"]
            self.log(f"Resuming from {path} at epoch {self.epochs_run}"
                     + (f", sample {self.position} of {self.sampler.size}" if self.position else ""))

    def log(self, text):
        if self.rank == 0:  # rank 0 speaks for all (and marks checkpoints complete)
            print(text)

    def where(self):
        """What a checkpoint's marker holds besides the shards: where training stands, and what that depends on."""
        return {"epochs_run": self.epochs_run, "position": self.position, "steps": self.steps_done,
                "dataset_size": self.sampler.size, "seed": self.sampler.seed, "global_batch": self.sampler.global_batch,
                "architecture": "BlockMLP"}

    def state(self, options=None):
        """Model and optimizer state keyed by parameter name, not by rank; by default each rank's shards."""
        model, optimizer = get_state_dict(self.model, self.optimizer, options=options)
        return {"model": model, "optimizer": optimizer}

    def _save(self):
        writer = self.checkpoints.start(self.where())  # into its .tmp directory, once the save before it is complete
        # Every rank writes and sums its own shards at once (async: copies them, and writes while training goes on).
        self.checkpoints.saving(self.save(self.state(), storage_writer=writer, process_group=self.checkpoints.group))

    def _run_batch(self, source, targets, step_size):
        self.optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(self.model(source), targets, reduction="sum")
        # FSDP averages the ranks' gradients: scaled by world size / step size, that is the mean over the step's
        # samples, however many each rank has (pieces of a step differ by one at most).
        (loss * dist.get_world_size() / step_size).backward()  # FSDP gathers each block again, reduce-scatters
        self.optimizer.step()
        return loss.detach()

    def _run_epoch(self, epoch):
        self.sampler.set_epoch(epoch, self.position)  # the epoch's order, from where a checkpoint left it
        trained = self.sampler.size - self.position
        # Summed on the device and read once per epoch: a .item() per step would stall every step.
        loss_sum = torch.zeros((), device=self.device)
        for source, targets in self.train_data:
            step_size = min(self.sampler.global_batch, self.sampler.size - self.position)
            source, targets = source.to(self.device), targets.to(self.device)
            loss_sum += self._run_batch(source, targets, step_size)
            self.position, self.steps_done = self.position + step_size, self.steps_done + 1
            mid_epoch = self.position < self.sampler.size
            if self.save_every_steps and self.steps_done % self.save_every_steps == 0 and mid_epoch:
                self._save()  # mid-epoch: the epochs done, and how far into this one's order
            self.checkpoints.commit(wait=False)  # a checkpoint whose save has returned is marked complete now
        dist.all_reduce(loss_sum)  # the squared errors of all ranks
        mean_loss = loss_sum.item() / trained
        steps = -(-self.sampler.size // self.sampler.global_batch)
        self.log(f"Epoch {epoch} | Batchsize {self.sampler.global_batch // dist.get_world_size()} | Steps {steps} | "
                 f"Loss {mean_loss:.6f}")
        self.epochs_run, self.position = epoch + 1, 0
        return mean_loss

    def train(self, max_epochs):
        if self.epochs_run >= max_epochs:
            self.log(f"Nothing to do: {self.snapshot_path} already holds {self.epochs_run} epochs "
                     f"(--total_epochs {max_epochs}); raise --total_epochs to train on")
            return
        start, first_epoch, first_step = time.perf_counter(), self.epochs_run, self.steps_done
        for epoch in range(self.epochs_run, max_epochs):
            loss = self._run_epoch(epoch)
            if epoch == first_epoch:  # measured once gradients and optimizer state exist
                self.log(memory_report(self.model, self.optimizer))
            if (epoch + 1) % self.save_every == 0 or epoch + 1 == max_epochs:
                self._save()
            self.checkpoints.commit(wait=epoch + 1 == max_epochs)  # async: complete once written
        wall = time.perf_counter() - start  # loss.item() above waited for the device
        epochs = max_epochs - first_epoch
        samples = epochs * self.sampler.size
        self.log(f"Summary: epochs {epochs} | steps {self.steps_done - first_step} | final loss {loss:.6f} | "
                 f"samples/s {samples / wall:.1f} | wall {wall:.2f}s | world size {dist.get_world_size()} | "
                 f"backend {dist.get_backend()}")


def load_train_objs(seed, mesh, amp, device, compile=False):
    train_set = regression_dataset(2048, seed=seed)
    with torch.device("meta"):  # shapes without storage: the full model never exists on one rank
        model = BlockMLP(input_size=20)
    # --amp: blocks gathered and computed in bf16; gradients reduced, and weights kept, in fp32.
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    policy = bf16 if amp else MixedPrecisionPolicy()  # by default everything in the weights' dtype
    for block in model.blocks:  # each block is gathered for its forward and its backward, and freed after
        if compile:  # each block compiled in place (its keys stay), before FSDP2 adds its hooks, which run eagerly
            block.compile()
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)  # the rest: input, norm and output layers
    init_shards(model, seed, device)  # storage for this rank's shards alone, and their first weights
    # On the shards, so its state is sharded too; foreach: one call for all of them, not one each.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=True)
    return train_set, model, optimizer


def init_shards(model, seed, device):
    """Each rank's shards of the weights BlockMLP would start with after torch.manual_seed(seed), one layer at a
    time: the layer in full on the CPU, this rank's part of it kept. (Random init on the shards themselves would
    draw other numbers on the CPU, the same on every rank.)"""
    model.to_empty(device=device)
    with torch.device("meta"):
        full_model = BlockMLP(input_size=20)  # a second skeleton: its layers made in full one at a time
    torch.manual_seed(seed)  # layers in the order the constructor makes them, so the same numbers it would draw
    for layer, full in zip(model.modules(), full_model.modules()):
        if next(full.parameters(recurse=False), None) is None:
            continue
        full.to_empty(device="cpu", recurse=False)
        full.reset_parameters()
        with torch.no_grad():
            for shard, weights in zip(layer.parameters(recurse=False), full.parameters(recurse=False)):
                shard.copy_(distribute_tensor(weights.to(device), shard.device_mesh, shard.placements,
                                              src_data_rank=None))  # every rank holds the layer: no sends
        full.to_empty(device="meta", recurse=False)  # freed


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
        check_folder(args.snapshot_path)
    if accelerator:  # before the process group, so NCCL binds this process to its own GPU
        torch.accelerator.set_device_index(device.index)
    # FSDP gathers and reduce-scatters the shards over this group of world_size processes. A framework
    # that calls main() (Ray Train, say) may own the group already.
    timeout = timedelta(seconds=args.timeout)
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group(backend, store=group_store(rank, world_size, timeout), rank=rank,
                                world_size=world_size, timeout=timeout, device_id=device if accelerator else None)
    if rank == 0:
        print(f"Training on {world_size} process{'es' * (world_size > 1)} | device {device.type} | backend {backend}")
    mesh = dist.device_mesh.init_device_mesh(device.type, (world_size,))  # one dimension: shard over all ranks
    dataset, model, optimizer = load_train_objs(args.seed, mesh, args.amp, device, args.compile)
    # Every rank builds the same dataset (same seed). Each step takes the next global batch of the epoch's order and
    # gives every rank a piece; the position in that order is what a mid-epoch checkpoint keeps.
    sampler = GlobalOrderSampler(len(dataset), rank, world_size, args.global_batch_size or args.batch_size * world_size,
                                 seed=args.seed)
    # The sampler hands out whole batches. The loader gets a generator of its own: each pass draws a seed, else from
    # the global generator (a resumed part of an epoch would draw once more than the run it resumes).
    train_data = DataLoader(dataset, sampler=sampler, batch_size=None, generator=torch.Generator())
    trainer = Trainer(model, train_data, optimizer, args.save_every, args.save_every_steps, args.snapshot_path,
                      args.async_save, device, args.skip_damaged)
    trainer.train(args.total_epochs)
    if args.export_path:  # the full state, gathered in rank 0's CPU memory (the others get none), as one file
        full_state = trainer.state(StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save(full_state, args.export_path)
    del trainer, model, optimizer  # they hold the process group: free them, so destroy_process_group frees it
    gc.collect()  # FSDP2's modules sit in reference cycles (hooks hold FSDP's state, which holds the module)
    mesh._pg_registry.clear()  # DTensor's caches keep the mesh for good, and it its groups (private: no public way)
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
    parser.add_argument("--snapshot_path", default="fsdp_checkpoints", help="the checkpoints' directory")
    parser.add_argument("--skip_damaged", action="store_true", help="set a damaged checkpoint aside (renamed "
                        ".damaged) and resume from the newest one that checks out")
    parser.add_argument("--backend", choices=["nccl", "gloo", "mpi"], help="default: nccl on CUDA, gloo on the CPU")
    parser.add_argument("--timeout", type=float, default=300, help="seconds to wait for the other ranks (default 300)")
    parser.add_argument("--amp", action="store_true", help="bf16 compute; fp32 gradient reduction and weights")
    parser.add_argument("--compile", action="store_true", help="torch.compile each block (resumes either way)")
    parser.add_argument("--async_save", action="store_true", help="write checkpoints while training goes on")
    parser.add_argument("--export_path", help="at the end, write the full state to this file (torch.save)")
    parser.add_argument("--save_every_steps", type=int, help="also a checkpoint every N steps, mid-epoch")
    parser.add_argument("--global_batch_size", type=int, help="samples per step over all ranks (default: --batch_size "
                        "times the world size); keep it when resuming at another world size")
    args = parser.parse_args(argv)
    args.total_epochs = args.epochs_arg if args.total_epochs is None else args.total_epochs
    args.save_every = args.every_arg if args.save_every is None else args.save_every
    if min(args.total_epochs, args.save_every, args.batch_size, args.timeout) <= 0:
        parser.error("--total_epochs, --save_every, --batch_size and --timeout must be positive")
    if any(value is not None and value <= 0 for value in (args.save_every_steps, args.global_batch_size)):
        parser.error("--save_every_steps and --global_batch_size must be positive")
    if "RANK" not in os.environ:
        parser.error(f"start it with torchrun: torchrun --standalone --nproc_per_node=2 {sys.argv[0]}")
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
        if isinstance(error, SystemExit):  # sys.exit("error: ...")
            print(error.code, file=sys.stderr)
        else:  # the traceback, through any hook a tool installed
            sys.excepthook(*sys.exc_info())
        sys.stdout.flush()
        os._exit(1)
