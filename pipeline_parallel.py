"""Step 7: pipeline parallelism gives each rank some of the blocks (a stage); micro-batches flow through the stages.

    torchrun --standalone --nproc_per_node=2 pipeline_parallel.py 20 5                  # 2 stages, GPUs or CPU
    torchrun --standalone --nproc_per_node=4 pipeline_parallel.py --schedule gpipe --microbatches 8 --dtype float64

Every rank builds models_and_data.BlockMLP and drops (sets to None) what its stage does not own, as torchtitan
does: stage s keeps blocks depth*s//pp to depth*(s+1)//pp - 1, the first stage also inp, the last norm and out, all
under the full model's names. torch.distributed.pipelining runs a step: each global batch is cut into
--microbatches; a stage receives a micro-batch's activations from the one before (send/recv), sends its output on,
and the gradients come back the same way. GPipe runs every forward, then every backward; 1F1B alternates one of
each once the pipeline is full, so that fewer micro-batches' activations wait in memory. Either way a stage waits
while the pipeline fills and drains: the bubble, (p-1)/(m+p-1) of a step for p stages and m micro-batches, if
every stage took the same time. It prints:

    Training on 2 processes | device cpu | backend gloo
    Mesh pp 2 | schedule 1F1B | 4 micro-batches of 64 | global batch 256
    Stage 0 (rank 0) holds inp, blocks.0, blocks.1: 67,776 of 134,401 parameters
    Stage 1 (rank 1) holds blocks.2, blocks.3, norm, out: 66,625 of 134,401 parameters
    Epoch 0 | Batchsize 256 | Steps 8 | Loss 1.031492
    ...
    Epoch 4 | Snapshot saved at pipeline_parallel_checkpoints/epoch_000005
    ...
    Stage 0 | idle 84.2% of a step, measured | bubble (p-1)/(m+p-1) = 20.0%, textbook
    Stage 1 | idle 82.7% of a step, measured | bubble (p-1)/(m+p-1) = 20.0%, textbook
    Summary: epochs 20 | steps 160 | final loss 0.086533 | samples/s 2947.3 | wall 13.90s | world size 2 | backend gloo

Idle is measured per stage: 1 - (time in its forward, backward and loss) / (time of the step), over the run's
steps but the first (which also infers the shapes sent between stages). At this size a micro-batch's compute is
shorter than a send over gloo, so the stages mostly wait for messages; with --hidden 4096 the compute dominates and
the measure nears the textbook (37.5% and 37.9% on 2 busy cores). On a CPU with fewer cores than processes the
stages also wait for a core. A second run resumes ("Resuming from pipeline_parallel_checkpoints/epoch_000020 at
epoch 20, saved as pp 2 on 2 processes"). Checkpoints: each stage writes its own parameters under their full names,
so any layout of tensor_parallel.py, this script or nd_parallel.py resumes from them.
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
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.utils.data import DataLoader

from fsdp_checkpoint import CheckpointDir, GlobalOrderSampler
from models_and_data import BlockMLP, regression_dataset

# Optimizer state flattened (one key per parameter): each stage saves and loads its own part of the model's state.
STATE_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
DATASET_SIZE = 2048


class Trainer:
    def __init__(self, model, stage, schedule, microbatches, train_data, optimizer, save_every, snapshot_path,
                 layout, dtype, device):
        self.device, self.dtype = device, dtype
        self.model = model  # this stage's part of the model, under the full model's names
        self.stage, self.microbatches = stage, microbatches
        # scale_grads=False: the schedule adds the micro-batches' gradients as they are; the loss says what they mean.
        self.schedule = schedule(stage, n_microbatches=microbatches, loss_fn=self.timed(self.loss), scale_grads=False)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.sampler = train_data.sampler
        self.position, self.steps_done = 0, 0
        self.snapshot_path, self.layout = snapshot_path, layout
        self.epochs_run = 0
        self.rank = dist.get_rank()
        self.busy, self.step_times = [0.0], []  # this stage's compute seconds; (busy, wall) of each step
        for name in ("forward_one_chunk", "backward_one_chunk"):  # what the schedule calls for each micro-batch
            setattr(stage, name, self.timed(getattr(stage, name)))
        self.checkpoints = CheckpointDir(snapshot_path, log=self.log)
        where, path = self.checkpoints.newest()  # complete checkpoints only
        if where:
            state = self.state()  # this stage's tensors: DCP reads them from whichever files hold them
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

    def timed(self, work):
        """`work`, its seconds added to this stage's busy time (on a GPU, once its kernels have finished)."""
        def run(*args, **kwargs):
            self.synchronize()
            start = time.perf_counter()
            try:
                return work(*args, **kwargs)
            finally:
                self.synchronize()
                self.busy[0] += time.perf_counter() - start
        return run

    def synchronize(self):
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def loss(self, output, targets):
        """The last stage's loss of one micro-batch: its squared errors over the step's size, so that the micro-batches'
        gradients add up to those of the step's mean (scale_grads=False: the schedule adds them as they are)."""
        return F.mse_loss(output, targets, reduction="sum") / self.sampler.global_batch

    def where(self):
        return {"epochs_run": self.epochs_run, "position": self.position, "steps": self.steps_done,
                "dataset_size": self.sampler.size, "seed": self.sampler.seed, "global_batch": self.sampler.global_batch,
                "layout": self.layout}

    def state(self):
        """This stage's model and optimizer state, keyed by the full model's parameter names."""
        model, optimizer = get_state_dict(self.model, self.optimizer, options=STATE_OPTIONS)
        return {"model": model, "optimizer": optimizer}

    def _save(self):
        path = self.checkpoints.start(self.where())
        self.checkpoints.saving(dcp.save(self.state(), checkpoint_id=path, process_group=self.checkpoints.group))

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad(set_to_none=True)
        losses = []  # the last stage's, one a micro-batch
        self.synchronize()
        busy, start = self.busy[0], time.perf_counter()
        # The first stage feeds the batch in, the last compares with the targets; the schedule cuts both.
        # return_outputs=False: the last stage keeps no outputs (and their autograd graph) after the step.
        self.schedule.step(*[source] * self.stage.is_first, target=targets if self.stage.is_last else None,
                           losses=losses if self.stage.is_last else None, return_outputs=False)
        self.synchronize()
        self.step_times.append((self.busy[0] - busy, time.perf_counter() - start))
        self.optimizer.step()  # each stage steps its own parameters: no communication
        return sum(losses, torch.zeros((), device=self.device, dtype=self.dtype)).detach()

    def _run_epoch(self, epoch):
        self.sampler.set_epoch(epoch, self.position)
        trained = self.sampler.size - self.position
        loss_sum = torch.zeros((), device=self.device, dtype=self.dtype)  # read once per epoch, not every step
        for source, targets in self.train_data:
            step_size = len(source)
            source, targets = source.to(self.device, self.dtype), targets.to(self.device, self.dtype)
            loss_sum += self._run_batch(source, targets) * step_size  # the step's squared errors (last stage)
            self.position, self.steps_done = self.position + step_size, self.steps_done + 1
        dist.all_reduce(loss_sum)  # the last stage's, to rank 0 (the other stages add zero)
        mean_loss = loss_sum.item() / trained
        steps = -(-self.sampler.size // self.sampler.global_batch)
        self.log(f"Epoch {epoch} | Batchsize {self.sampler.global_batch} | Steps {steps} | Loss {mean_loss:.6f}")
        self.epochs_run, self.position = epoch + 1, 0
        return mean_loss

    def idle_lines(self):
        """Each stage's measured idle fraction of a step, beside the textbook bubble (a collective: every rank)."""
        measured = self.step_times[1:] or self.step_times  # the first step also inferred the shapes
        busy, wall = (sum(column) for column in zip(*measured))
        idle = [None] * dist.get_world_size()
        dist.all_gather_object(idle, 1 - busy / wall)
        p, m = dist.get_world_size(), self.microbatches
        return "\n".join(f"Stage {s} | idle {100 * fraction:.1f}% of a step, measured | bubble (p-1)/(m+p-1) = "
                         f"{100 * (p - 1) / (m + p - 1):.1f}%, textbook" for s, fraction in enumerate(idle))

    def train(self, max_epochs):
        if self.epochs_run >= max_epochs:
            self.log(f"Nothing to do: {self.snapshot_path} already holds {self.epochs_run} epochs "
                     f"(--total_epochs {max_epochs}); raise --total_epochs to train on")
            return
        start, first_epoch, first_step = time.perf_counter(), self.epochs_run, self.steps_done
        for epoch in range(self.epochs_run, max_epochs):
            loss = self._run_epoch(epoch)
            if (epoch + 1) % self.save_every == 0 or epoch + 1 == max_epochs:
                self._save()
            self.checkpoints.commit(wait=True)
        wall = time.perf_counter() - start
        self.log(self.idle_lines())
        epochs = max_epochs - first_epoch
        samples = epochs * self.sampler.size
        self.log(f"Summary: epochs {epochs} | steps {self.steps_done - first_step} | final loss {loss:.6f} | "
                 f"samples/s {samples / wall:.1f} | wall {wall:.2f}s | world size {dist.get_world_size()} | "
                 f"backend {dist.get_backend()}")


def whole_model(state):
    """The shapes of every stage's tensors together, as meta tensors under DCP's flat keys: what a checkpoint of
    this model holds, to compare with one (a collective: every rank)."""
    def flat(value, prefix=""):
        if isinstance(value, dict):
            for key, item in value.items():
                yield from flat(item, f"{prefix}.{key}" if prefix else key)
        elif isinstance(value, torch.Tensor):
            yield prefix, tuple(value.shape)

    stages = [None] * dist.get_world_size()
    dist.all_gather_object(stages, dict(flat(state)))
    return {key: torch.empty(shape, device="meta") for shapes in stages for key, shape in shapes.items()}


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


def load_train_objs(args, mesh, dtype, device):
    torch.manual_seed(args.seed)
    train_set = regression_dataset(DATASET_SIZE, seed=args.seed)
    # The whole model on every rank (same seed, same weights), then each keeps its stage: fine at this size; a
    # large model would be built on the meta device and each stage's part initialized.
    model = BlockMLP(input_size=20, width=args.width, hidden=args.hidden, depth=args.depth).to(dtype)
    stage_index, stages = mesh.get_local_rank(), mesh.size()
    parts = build_stage(model, stage_index, stages)
    model.to(device)
    stage = PipelineStage(model, stage_index, stages, device, group=mesh.get_group())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=True)
    return train_set, model, stage, optimizer, parts


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
    # The stages send activations forward and gradients back over this group of world_size processes.
    # A framework that calls main() (Ray Train, say) may own the group already.
    timeout = timedelta(seconds=args.timeout)
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group(backend, store=group_store(rank, world_size, timeout), rank=rank,
                                world_size=world_size, timeout=timeout, device_id=device if accelerator else None)
    if rank == 0:
        print(f"Training on {world_size} process{'es' * (world_size > 1)} | device {device.type} | backend {backend}")
    mesh = dist.device_mesh.init_device_mesh(device.type, (world_size,), mesh_dim_names=("pp",))
    dtype = getattr(torch, args.dtype)
    dataset, model, stage, optimizer, parts = load_train_objs(args, mesh, dtype, device)
    layout = f"pp {world_size}"
    m = args.microbatches
    # Every stage takes every step's whole batch; the first feeds it in, the last compares with its targets.
    sampler = GlobalOrderSampler(len(dataset), 0, 1, args.global_batch_size, seed=args.seed)
    train_data = DataLoader(dataset, sampler=sampler, batch_size=None, generator=torch.Generator())
    held = sum(p.numel() for p in model.parameters())
    total = sum(p.numel() for p in BlockMLP(input_size=20, width=args.width, hidden=args.hidden,
                                            depth=args.depth).parameters())
    holds = [None] * world_size
    dist.all_gather_object(holds, f"holds {', '.join(parts)}: {held:,} of {total:,} parameters")
    if rank == 0:
        print(f"Mesh {layout} | schedule {SCHEDULES[args.schedule].__name__[8:]} | {m} micro-batches of "
              f"{args.global_batch_size // m} | global batch {args.global_batch_size}")
        print("\n".join(f"Stage {s} (rank {s}) {line}" for s, line in enumerate(holds)))
    trainer = Trainer(model, stage, SCHEDULES[args.schedule], m, train_data, optimizer, args.save_every,
                      args.snapshot_path, layout, dtype, device)
    trainer.train(args.total_epochs)
    del trainer, model, stage, optimizer  # they hold the process group: free them, so destroy_process_group frees it
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
    parser.add_argument("--global_batch_size", type=int, default=256, help="samples per step (default 256); it must "
                        f"divide the {DATASET_SIZE} samples and --microbatches must divide it")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches a step (default 4)")
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b", help="default 1f1b")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data, the model and the shuffle")
    parser.add_argument("--snapshot_path", default="pipeline_parallel_checkpoints", help="the checkpoints' directory")
    parser.add_argument("--backend", choices=["nccl", "gloo", "mpi"], help="default: nccl on CUDA, gloo on the CPU")
    parser.add_argument("--timeout", type=float, default=300, help="seconds to wait for the other ranks (default 300)")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                        help="of the weights and the data; float64 to compare with one process tightly")
    parser.add_argument("--width", type=int, default=64, help="the blocks' width (default 64)")
    parser.add_argument("--hidden", type=int, default=256, help="each block's hidden units (default 256)")
    parser.add_argument("--depth", type=int, default=4, help="blocks, shared out among the stages (default 4)")
    args = parser.parse_args(argv)
    args.total_epochs = args.epochs_arg if args.total_epochs is None else args.total_epochs
    args.save_every = args.every_arg if args.save_every is None else args.save_every
    if min(args.total_epochs, args.save_every, args.global_batch_size, args.microbatches, args.timeout) <= 0:
        parser.error("--total_epochs, --save_every, --global_batch_size, --microbatches and --timeout must be positive")
    if min(args.width, args.hidden, args.depth) <= 0:
        parser.error("--width, --hidden and --depth must be positive")
    if "RANK" not in os.environ:
        parser.error(f"start it with torchrun: torchrun --standalone --nproc_per_node=2 {sys.argv[0]}")
    stages = int(os.environ["WORLD_SIZE"])
    if stages > args.depth:
        parser.error(f"{stages} processes make {stages} stages, more than the {args.depth} blocks (--depth)")
    if DATASET_SIZE % args.global_batch_size or args.global_batch_size % args.microbatches:
        parser.error(f"--microbatches {args.microbatches} must divide --global_batch_size {args.global_batch_size}, "
                     f"and it the {DATASET_SIZE} samples: every micro-batch has one shape, which the stages agree on")
    if args.schedule == "1f1b" and args.microbatches < stages:
        parser.error(f"1F1B needs at least one micro-batch a stage: --microbatches {args.microbatches} < "
                     f"{stages} stages")
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
