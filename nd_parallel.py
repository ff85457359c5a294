"""Step 8: data, tensor and pipeline parallelism at once, on one DeviceMesh with named dimensions.

    torchrun --standalone --nproc_per_node=8 nd_parallel.py --dp 2 --tp 2 --pp 2 --total_epochs 4      # 3-D
    torchrun --standalone --nproc_per_node=4 nd_parallel.py --dp 2 --tp 2 --total_epochs 4             # FSDP2 x TP
    torchrun --standalone --nproc_per_node=4 nd_parallel.py --dp 4 --dp_replicate 2 --total_epochs 4   # HSDP 2 x 2
    torchrun --standalone --nproc_per_node=1 nd_parallel.py --total_epochs 4                           # one process

The mesh is pp x dp_replicate x dp_shard x tp (tp innermost: a tensor-parallel group's ranks are neighbours, on one
machine). Rank r sits at one coordinate of each: the pipeline stage it runs (pipeline_parallel.py: the model
without what the stage does not own), its data-parallel rank (its part of every global batch), and its piece of
each block (tensor_parallel.py: fc1 ColwiseParallel, fc2 RowwiseParallel over the tp group). FSDP2 (fsdp.py) then
shards what the rank holds over the dp_shard group, and with --dp_replicate R (HSDP) keeps R copies of the shards,
their gradients all-reduced over dp_replicate. --dp defaults to the processes over tp x pp. Every axis is always
applied: an axis of size 1 only costs bookkeeping, so one GPU runs the same code. It prints:

    Training on 8 processes | device cpu | backend gloo
    Mesh pp 2 x dp_replicate 1 x dp_shard 2 x tp 2 | 128 samples a data-parallel rank in 2 micro-batches | ...
    Rank 0 | pp 0 dp_replicate 0 dp_shard 0 tp 0 | inp, blocks.0, blocks.1 | 17,376 of 134,401 parameters | ...
    Rank 7 | pp 1 dp_replicate 0 dp_shard 1 tp 1 | blocks.2, blocks.3, norm, out | 16,768 of 134,401 parameters | ...
    Epoch 0 | Batchsize 128 | Steps 8 | Loss 1.031492
    ...
    Epoch 3 | Batchsize 128 | Steps 8 | Loss 0.169379
    Epoch 3 | Snapshot saved at nd_parallel_checkpoints/epoch_000004
    Summary: epochs 4 | steps 32 | final loss 0.169379 | samples/s 439.0 | wall 18.66s | world size 8 | backend gloo

Batchsize is a data-parallel rank's part of the global batch. Checkpoints are keyed by the full model's names (DCP,
with fsdp_checkpoint.py's complete marker): a run resumes from one of any layout, this script's, tensor_parallel.py's
or pipeline_parallel.py's ("Resuming from nd_parallel_checkpoints/epoch_000004 at epoch 4, saved as pp 2 x
dp_replicate 1 x dp_shard 2 x tp 2 on 8 processes"), and trains on as it would have with the same
--global_batch_size. With --dtype float64 the numbers are one process's but for the order of additions
(tests/test_parallelism.py).
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
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader

from fsdp_checkpoint import CheckpointDir, GlobalOrderSampler
from models_and_data import BlockMLP, regression_dataset

# Optimizer state flattened (one key per parameter): each stage saves and loads its own part of the model's state.
STATE_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
DATASET_SIZE = 2048
DIMS = ("pp", "dp_replicate", "dp_shard", "tp")  # the mesh's dimensions, outermost first


class Trainer:
    def __init__(self, model, stage, schedule, microbatches, dp, train_data, optimizer, save_every, snapshot_path,
                 layout, dtype, device):
        self.device, self.dtype = device, dtype
        self.model = model  # this rank's stage, its blocks split over tp, all of it sharded over dp
        self.stage, self.dp = stage, dp
        # scale_grads=False: the schedule adds the micro-batches' gradients as they are; the loss says what they mean.
        self.schedule = schedule(stage, n_microbatches=microbatches, loss_fn=self.loss, scale_grads=False)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.sampler = train_data.sampler
        self.position, self.steps_done = 0, 0
        self.snapshot_path, self.layout = snapshot_path, layout
        self.epochs_run = 0
        self.rank = dist.get_rank()
        self.checkpoints = CheckpointDir(snapshot_path, log=self.log)
        where, path = self.checkpoints.newest()  # complete checkpoints only
        if where:
            state = self.state()  # this rank's pieces: DCP reads them from whichever files hold them
            with self.checkpoints.loading(path, whole_model(state)):  # another model, a missing shard: one line
                dcp.load(state, checkpoint_id=path, process_group=self.checkpoints.group)
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                           options=STATE_OPTIONS)
            self.sampler.check_snapshot(where, path)
            self.epochs_run, self.position, self.steps_done = where["epochs_run"], where["position"], where["steps"]
            self.log(f"Resuming from {path} at epoch {self.epochs_run}, saved as {where.get('layout', '?')} on "
                     f"{where['world_size']} process{'es' * (where['world_size'] > 1)}")

    def log(self, text):
        if self.rank == 0:
            print(text)

    def loss(self, output, targets):
        """The last stage's loss of one micro-batch. FSDP averages the data-parallel ranks' gradients: scaled by
        dp / the step's size, the micro-batches' gradients add up to those of the mean over the step's samples."""
        return F.mse_loss(output, targets, reduction="sum") * self.dp / self.sampler.global_batch

    def where(self):
        return {"epochs_run": self.epochs_run, "position": self.position, "steps": self.steps_done,
                "dataset_size": self.sampler.size, "seed": self.sampler.seed, "global_batch": self.sampler.global_batch,
                "layout": self.layout}

    def state(self):
        """This rank's model and optimizer state, keyed by the full model's parameter names."""
        model, optimizer = get_state_dict(self.model, self.optimizer, options=STATE_OPTIONS)
        return {"model": model, "optimizer": optimizer}

    def _save(self):
        path = self.checkpoints.start(self.where())
        self.checkpoints.saving(dcp.save(self.state(), checkpoint_id=path, process_group=self.checkpoints.group))

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad(set_to_none=True)
        losses = []  # the last stage's, one a micro-batch
        # The first stage feeds the batch in, the last compares with the targets; the schedule cuts both. TP's
        # all-reduces run inside each stage's blocks, FSDP's gathers around them, its reduce-scatters at the end.
        # return_outputs=False: the last stage keeps no outputs, whose autograd graph would hold FSDP's hooks, and
        # through them the modules and the process groups, past destroy_process_group.
        self.schedule.step(*[source] * self.stage.is_first, target=targets if self.stage.is_last else None,
                           losses=losses if self.stage.is_last else None, return_outputs=False)
        self.optimizer.step()  # on this rank's shards of this stage's pieces: no communication
        return sum(losses, torch.zeros((), device=self.device, dtype=self.dtype)).detach()

    def _run_epoch(self, epoch, speaks):
        self.sampler.set_epoch(epoch, self.position)
        trained = self.sampler.size - self.position
        loss_sum = torch.zeros((), device=self.device, dtype=self.dtype)  # read once per epoch, not every step
        for source, targets in self.train_data:
            step_size = self.sampler.global_batch
            source, targets = source.to(self.device, self.dtype), targets.to(self.device, self.dtype)
            loss_sum += self._run_batch(source, targets) * step_size / self.dp  # this rank's squared errors
            self.position, self.steps_done = self.position + step_size, self.steps_done + 1
        # The squared errors of every data-parallel rank's part: the last stage's tp ranks 0 say them, the rest 0.
        if not speaks:
            loss_sum.zero_()
        dist.all_reduce(loss_sum)
        mean_loss = loss_sum.item() / trained
        steps = -(-self.sampler.size // self.sampler.global_batch)
        self.log(f"Epoch {epoch} | Batchsize {self.sampler.global_batch // self.dp} | Steps {steps} | "
                 f"Loss {mean_loss:.6f}")
        self.epochs_run, self.position = epoch + 1, 0
        return mean_loss

    def train(self, max_epochs, speaks):
        if self.epochs_run >= max_epochs:
            self.log(f"Nothing to do: {self.snapshot_path} already holds {self.epochs_run} epochs "
                     f"(--total_epochs {max_epochs}); raise --total_epochs to train on")
            return
        start, first_epoch, first_step = time.perf_counter(), self.epochs_run, self.steps_done
        for epoch in range(self.epochs_run, max_epochs):
            loss = self._run_epoch(epoch, speaks)
            if (epoch + 1) % self.save_every == 0 or epoch + 1 == max_epochs:
                self._save()
            self.checkpoints.commit(wait=True)
        wall = time.perf_counter() - start
        epochs = max_epochs - first_epoch
        samples = epochs * self.sampler.size
        self.log(f"Summary: epochs {epochs} | steps {self.steps_done - first_step} | final loss {loss:.6f} | "
                 f"samples/s {samples / wall:.1f} | wall {wall:.2f}s | world size {dist.get_world_size()} | "
                 f"backend {dist.get_backend()}")


def whole_model(state):
    """The shapes of every rank's tensors together, as meta tensors under DCP's flat keys: what a checkpoint of
    this model holds, to compare with one (a collective: every rank)."""
    def flat(value, prefix=""):
        if isinstance(value, dict):
            for key, item in value.items():
                yield from flat(item, f"{prefix}.{key}" if prefix else key)
        elif isinstance(value, torch.Tensor):
            yield prefix, tuple(value.shape)

    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, dict(flat(state)))
    return {key: torch.empty(shape, device="meta") for shapes in ranks for key, shape in shapes.items()}


def build_stage(model, stage, stages):
    """Drop, in place, what `stage` of `stages` does not own; returns the names of the parts it keeps."""
    depth = len(model.blocks)
    first, end = depth * stage // stages, depth * (stage + 1) // stages
    for i in range(depth):
        if not first <= i < end:
            model.blocks[i] = None  # the slot stays: the kept blocks keep their numbers, blocks.2 stays blocks.2
    if stage > 0:
        model.inp = None
    if stage < stages - 1:
        model.norm = model.out = None
    return ["inp"] * (stage == 0) + [f"blocks.{i}" for i in range(first, end)] + ["norm", "out"] * (stage == stages - 1)


def holdings(model, parts, mesh, total):
    """A line of where this rank sits on the mesh and what it holds: its stage's parts, its share of the
    parameters, and its piece of its first block's fc1.weight (split over tp, then sharded over dp)."""
    coordinates = " ".join(f"{name} {mesh[name].get_local_rank()}" for name in DIMS)
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
    block = next(i for i, b in enumerate(model.blocks) if b is not None)
    weight = model.blocks[block].fc1.weight
    return (f"{coordinates} | {', '.join(parts)} | {local:,} of {total:,} parameters | blocks.{block}.fc1.weight "
            f"{list(weight.to_local().shape)} of {list(weight.shape)}")


def load_train_objs(args, mesh, dtype, device):
    torch.manual_seed(args.seed)
    train_set = regression_dataset(DATASET_SIZE, seed=args.seed)
    # The whole model on every rank (same seed, same weights), then each keeps its part: fine at this size; a
    # large model would be built on the meta device and each rank's shards initialized (fsdp.py).
    model = BlockMLP(input_size=20, width=args.width, hidden=args.hidden, depth=args.depth).to(dtype)
    total = sum(p.numel() for p in model.parameters())
    # 1. Pipeline: this rank's stage, under the full model's names.
    stage_index = mesh["pp"].get_local_rank()
    parts = build_stage(model, stage_index, args.pp)
    model.to(device)
    # 2. Tensor parallel over the tp group: fc1's output columns and fc2's input rows split, in every block kept.
    for block in filter(None, model.blocks):
        parallelize_module(block, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    # 3. FSDP2 over the data-parallel ranks: each block sharded on its own, then the rest; with HSDP, sharded over
    # dp_shard and replicated over dp_replicate (a 2-D mesh: FSDP all-reduces the shards' gradients over the first).
    dp_mesh = mesh["dp_replicate", "dp_shard"] if args.dp_replicate > 1 else mesh["dp_shard"]
    for block in filter(None, model.blocks):
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    # 4. The stage that sends activations to the next stage's ranks of the same dp and tp coordinates, and back.
    stage = PipelineStage(model, stage_index, args.pp, device, group=mesh["pp"].get_group())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=True)
    return train_set, model, stage, optimizer, holdings(model, parts, mesh, total)


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
    # The mesh's groups are made from this group of world_size processes: one group per row of each dimension.
    # A framework that calls main() (Ray Train, say) may own the group already.
    timeout = timedelta(seconds=args.timeout)
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group(backend, store=group_store(rank, world_size, timeout), rank=rank,
                                world_size=world_size, timeout=timeout, device_id=device if accelerator else None)
    if rank == 0:
        print(f"Training on {world_size} process{'es' * (world_size > 1)} | device {device.type} | backend {backend}")
    sizes = dict(zip(DIMS, (args.pp, args.dp_replicate, args.dp // args.dp_replicate, args.tp)))
    mesh = dist.device_mesh.init_device_mesh(device.type, tuple(sizes.values()), mesh_dim_names=DIMS)
    dtype = getattr(torch, args.dtype)
    dataset, model, stage, optimizer, holds = load_train_objs(args, mesh, dtype, device)
    layout = " x ".join(f"{name} {size}" for name, size in sizes.items())
    everyone = [None] * world_size
    dist.all_gather_object(everyone, holds)
    m = args.microbatches
    if rank == 0:
        print(f"Mesh {layout} | {args.global_batch_size // args.dp} samples a data-parallel rank in {m} "
              f"micro-batch{'es' * (m > 1)} | global batch {args.global_batch_size} | "
              f"schedule {SCHEDULES[args.schedule].__name__[8:]}")
        print("\n".join(f"Rank {r} | {line}" for r, line in enumerate(everyone)))
    # Each step's global batch is cut into dp pieces: the ranks of one data-parallel coordinate (all their stages
    # and tp pieces) take the same piece.
    dp_rank = mesh["dp_replicate"].get_local_rank() * sizes["dp_shard"] + mesh["dp_shard"].get_local_rank()
    sampler = GlobalOrderSampler(len(dataset), dp_rank, args.dp, args.global_batch_size, seed=args.seed)
    train_data = DataLoader(dataset, sampler=sampler, batch_size=None, generator=torch.Generator())
    trainer = Trainer(model, stage, SCHEDULES[args.schedule], m, args.dp, train_data, optimizer, args.save_every,
                      args.snapshot_path, layout, dtype, device)
    trainer.train(args.total_epochs, speaks=stage.is_last and mesh["tp"].get_local_rank() == 0)
    del trainer, model, stage, optimizer  # they hold the process group: free them, so destroy_process_group frees it
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
    parser.add_argument("--dp", type=int, help="data-parallel ranks (default: the processes over tp x pp)")
    parser.add_argument("--dp_replicate", type=int, default=1, help="HSDP: replicas of the shards, of --dp (default 1)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: each block split over them")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages")
    parser.add_argument("--global_batch_size", type=int, default=256, help="samples per step over all ranks (default "
                        f"256); it must divide the {DATASET_SIZE} samples, dp x --microbatches must divide it")
    parser.add_argument("--microbatches", type=int, help="micro-batches a step (default: --pp)")
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b", help="default 1f1b")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data, the model and the shuffle")
    parser.add_argument("--snapshot_path", default="nd_parallel_checkpoints", help="the checkpoints' directory")
    parser.add_argument("--backend", choices=["nccl", "gloo", "mpi"], help="default: nccl on CUDA, gloo on the CPU")
    parser.add_argument("--timeout", type=float, default=300, help="seconds to wait for the other ranks (default 300)")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                        help="of the weights and the data; float64 to compare with one process tightly")
    parser.add_argument("--width", type=int, default=64, help="the blocks' width (default 64)")
    parser.add_argument("--hidden", type=int, default=256, help="each block's hidden units, over tp (default 256)")
    parser.add_argument("--depth", type=int, default=4, help="blocks, shared out among the stages (default 4)")
    args = parser.parse_args(argv)
    args.total_epochs = args.epochs_arg if args.total_epochs is None else args.total_epochs
    args.save_every = args.every_arg if args.save_every is None else args.save_every
    args.microbatches = args.pp if args.microbatches is None else args.microbatches
    sizes = (args.dp_replicate, args.tp, args.pp, args.microbatches, args.global_batch_size, args.width, args.hidden,
             args.depth)
    if min(args.total_epochs, args.save_every, args.timeout, *sizes) <= 0 or (args.dp is not None and args.dp <= 0):
        parser.error("--total_epochs, --save_every, --timeout, the mesh's sizes, --microbatches, --global_batch_size, "
                     "--width, --hidden and --depth must be positive")
    if "RANK" not in os.environ:
        parser.error(f"start it with torchrun: torchrun --standalone --nproc_per_node=2 {sys.argv[0]}")
    world_size = int(os.environ["WORLD_SIZE"])
    if args.dp is None and world_size % (args.tp * args.pp) == 0:
        args.dp = world_size // (args.tp * args.pp)
    if args.dp is None or args.dp * args.tp * args.pp != world_size:
        parser.error(f"--dp {args.dp or '?'} x --tp {args.tp} x --pp {args.pp} must be the {world_size} processes "
                     "torchrun started (WORLD_SIZE)")
    if args.dp % args.dp_replicate:
        parser.error(f"--dp_replicate {args.dp_replicate} must divide --dp {args.dp}: dp = dp_replicate x dp_shard")
    if args.hidden % args.tp:
        parser.error(f"--tp {args.tp} does not divide --hidden {args.hidden}: each tp rank takes an equal share of "
                     "every block's hidden units")
    if args.pp > args.depth:
        parser.error(f"--pp {args.pp} stages are more than the {args.depth} blocks (--depth)")
    if DATASET_SIZE % args.global_batch_size or args.global_batch_size % (args.dp * args.microbatches):
        parser.error(f"--dp {args.dp} x --microbatches {args.microbatches} must divide --global_batch_size "
                     f"{args.global_batch_size}, and it the {DATASET_SIZE} samples: every micro-batch has one shape, "
                     "which the stages agree on")
    if args.schedule == "1f1b" and args.microbatches < args.pp:
        parser.error(f"1F1B needs at least one micro-batch a stage: --microbatches {args.microbatches} < --pp "
                     f"{args.pp}")
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
