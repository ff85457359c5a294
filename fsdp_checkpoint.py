"""fsdp.py's checkpoint protocol, beside it as upstream FSDP2's checkpoint.py is beside example.py: which sharded
checkpoints are complete, whether one fits the model, the sampler whose position a mid-epoch checkpoint keeps,
and the bytes each rank holds.

A checkpoint of torch.distributed.checkpoint (DCP) is a directory: a file of shards per rank (`__0_0.distcp`, ...)
and `.metadata`, written last by the coordinator. A save killed midway leaves some of these files, and DCP has no
notion of "complete". So each checkpoint is written into `epoch_000004.tmp/`; once DCP's save has returned, rank 0
writes a marker (`complete.json`, fsynced) into it and renames it `epoch_000004/`. Only directories so named with
the marker are loaded, the newest first; leftovers of killed saves are removed at the next start. A checkpoint
taken mid-epoch is `epoch_000004_sample_000001024/`: 4 epochs done, and 1024 samples of the fifth one's order.
"""
import json
import os
import re
import shutil
import sys
import threading
import uuid
import warnings
from concurrent.futures import Future
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, TensorStorageMetadata, load
from torch.distributed.tensor import DTensor

MARKER = "complete.json"
KEEP = 2  # complete checkpoints kept: the newest, and the one before it
NAME = re.compile(r"epoch_(\d+)(?:_sample_(\d+))?")


def first_line(error):
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


class CheckpointDir:
    """The checkpoints under `root`, the same directory for every rank (on several nodes, a filesystem they share).
    DCP's collectives run in a gloo group of their own: an async save runs them in a thread while training runs
    FSDP's in the default group (two threads' collectives in one group could interleave differently on different
    ranks), and dcp.async_save needs a CPU group when training uses NCCL."""

    def __init__(self, root, log):
        self.root, self.log = root, log  # log: how rank 0 reports a checkpoint complete
        self.group = dist.new_group(backend="gloo")
        self.pending = None  # [where, what dcp.save or dcp.async_save returned] until marked complete

    def path(self, where):
        name = f"epoch_{where['epochs_run']:06d}" + (f"_sample_{where['position']:09d}" if where["position"] else "")
        return os.path.join(self.root, name)

    def complete(self):
        """[((epochs, position), path)] of the complete checkpoints, oldest first."""
        names = os.listdir(self.root) if os.path.isdir(self.root) else []
        found = [((int(m[1]), int(m[2] or 0)), os.path.join(self.root, name)) for name in names
                 if (m := NAME.fullmatch(name))]
        return sorted((key, path) for key, path in found if os.path.isfile(os.path.join(path, MARKER)))

    def newest(self):
        """Every rank calls this at start: (where, path) of the newest complete checkpoint (`where`: its marker), or
        (None, None). Rank 0 removes what killed saves left and decides; every rank checks that it sees rank 0's
        files, so that all write into one checkpoint."""
        choice = None
        if dist.get_rank() == 0:
            for name in os.listdir(self.root):
                if name.endswith(".tmp"):  # no save of this run starts before every rank has passed this point
                    shutil.rmtree(os.path.join(self.root, name))
            probe = f".probe-{uuid.uuid4().hex}"
            open(os.path.join(self.root, probe), "w").close()
            newest = (self.complete() or [(None, None)])[-1][1]
            choice = (probe, (json.load(open(os.path.join(newest, MARKER))) if newest else None, newest))
        box, sees = [choice], [None] * dist.get_world_size()
        dist.broadcast_object_list(box, src=0, group=self.group)
        probe, newest = box[0]
        dist.all_gather_object(sees, os.path.exists(os.path.join(self.root, probe)), group=self.group)
        if dist.get_rank() == 0:
            os.remove(os.path.join(self.root, probe))
        if not all(sees):
            sys.exit(f"error: ranks {[rank for rank, seen in enumerate(sees) if not seen]} do not see the files rank 0 "
                     f"writes in {self.root}: every rank writes its shards into the same checkpoint, so "
                     "--snapshot_path must be on a filesystem all nodes share (NFS, Lustre, ...)")
        return newest

    @contextmanager
    def loading(self, path, state):
        """Around dcp.load(state, ...): a checkpoint of another model, or with a shard missing or unreadable on any
        rank, is one line on every rank."""
        check_fits(path, state)
        try:
            yield
        except CheckpointException as error:  # DCP gathers every rank's failure into this BaseException
            ranks = sorted(error.failures)
            cause = error.failures[ranks[0]][0]
            sys.exit(f"error: checkpoint {path} is damaged: rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))} "
                     f"could not read it ({type(cause).__name__}: {first_line(cause)}); move it away to resume from "
                     "the one before, or pass another --snapshot_path")

    def start(self, where):
        """The directory to save the checkpoint of `where` into, once the save before it is complete (DCP saves one
        at a time)."""
        self.commit(wait=True)
        self.pending = [where, None]
        return self.path(where) + ".tmp"

    def saving(self, result):
        """What dcp.save (metadata: written) or dcp.async_save (a future: being written) returned."""
        self.pending[1] = result

    def commit(self, wait):
        """Mark the checkpoint in flight complete once its save has returned (now, if `wait`): on rank 0 that means
        every rank's shards and the metadata are on disk. Rank 0 writes the marker, renames the directory, and
        removes the oldest beyond the newest KEEP."""
        if self.pending is None or not (wait or not isinstance(self.pending[1], Future) or self.pending[1].done()):
            return
        (where, result), self.pending = self.pending, None
        if isinstance(result, Future):
            result.result()  # raises what the save thread raised
            join_save_threads()
        if dist.get_rank() != 0:
            return
        staging, final = self.path(where) + ".tmp", self.path(where)
        with open(os.path.join(staging, MARKER), "w") as f:
            json.dump({**where, "world_size": dist.get_world_size()}, f)
            f.flush()
            os.fsync(f.fileno())
        os.rename(staging, final)
        directory = os.open(self.root, os.O_RDONLY)  # the rename itself made durable
        os.fsync(directory)
        os.close(directory)
        for _, old in self.complete()[:-KEEP]:
            shutil.rmtree(old)
        if where["position"]:
            self.log(f"Epoch {where['epochs_run']} | sample {where['position']} | Snapshot saved at {final}")
        else:
            self.log(f"Epoch {where['epochs_run'] - 1} | Snapshot saved at {final}")


def check_fits(path, state):
    """One line if the checkpoint at `path` holds other tensors than `state` would load (another model, other
    flags): DCP itself loads a checkpoint with extra tensors without a word."""
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as error:  # noqa: BLE001  whatever damaged metadata raises: one line
        sys.exit(f"error: checkpoint {path} cannot be read ({type(error).__name__}: {first_line(error)}); move it "
                 "away to resume from the one before, or pass another --snapshot_path")
    saved = {key: tuple(item.size) for key, item in metadata.state_dict_metadata.items()
             if isinstance(item, TensorStorageMetadata)}
    ours = {}

    def shapes(prefix, value):  # DCP's keys: {"model": {"inp.weight": ...}} is "model.inp.weight"
        if isinstance(value, dict):
            for key, item in value.items():
                shapes(f"{prefix}.{key}" if prefix else key, item)
        elif isinstance(value, torch.Tensor):
            ours[prefix] = tuple(value.shape)

    shapes("", state)
    differences = ([f"{key} is {list(saved[key])}, here {list(ours[key])}" for key in ours
                    if key in saved and saved[key] != ours[key]]
                   + [f"{key} is missing" for key in ours if key not in saved]
                   + [f"it holds {key}, which this model lacks" for key in saved if key not in ours])
    if differences:
        sys.exit(f"error: checkpoint {path} does not fit this model or optimizer ({'; '.join(differences[:3])}"
                 f"{'; ...' if len(differences) > 3 else ''}); it belongs to another model or flags: move it away or "
                 "pass another --snapshot_path")


def load_whole_model(model, path):
    """`model` (whole, not split) with the weights of the checkpoint at `path`, saved in any layout, read by this
    process alone: no process group needed. DCP reads each tensor from the shards that hold its pieces."""
    with warnings.catch_warnings():  # DCP's note that it loads in one process: what this function is for
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load({"model": model.state_dict()}, checkpoint_id=path, no_dist=True)  # into the parameters, in place
    return model


def join_save_threads():
    """Wait until DCP's async save thread has exited. Its future is done before the thread lets go of the save's
    arguments (the staged state, whose DTensors hold the device mesh and its groups): a destroy_process_group in
    that moment would leave the groups alive, torn down later by the save thread or at exit (an abort, now and
    then). dcp.async_save shuts its one-thread executor down once the save is done, so the thread ends."""
    for thread in threading.enumerate():
        if thread.name.startswith("AsyncCheckpointExecutor") and thread is not threading.current_thread():
            thread.join()


class GlobalOrderSampler:
    """This rank's batches, cut from one order of the whole dataset per epoch, with a position in that order that
    means the same at any world size: what a mid-epoch checkpoint keeps, to resume exactly, or at another world
    size with every sample once. A step takes the next `global_batch` samples of the epoch's order and gives each
    rank a contiguous piece (sizes differ by one at most; a rank's piece of a short last step may be empty). Use it
    as DataLoader(dataset, sampler=it, batch_size=None) with a dataset that takes a list of indices."""

    def __init__(self, size, rank, world_size, global_batch, seed=0):
        self.size, self.rank, self.world_size = size, rank, world_size
        self.global_batch, self.seed = global_batch, seed
        self.epoch, self.position = 0, 0

    def set_epoch(self, epoch, position=0):
        self.epoch, self.position = epoch, position

    def check_snapshot(self, where, path):
        """A checkpoint's position counts into the order of one dataset size and seed: elsewhere it means nothing."""
        for key, here in (("dataset_size", self.size), ("seed", self.seed)):
            if where.get(key, here) != here:
                sys.exit(f"error: {path} was made with another {key.replace('_', ' ')} ({where[key]}, here {here}): "
                         "its position means nothing here; move it away to start afresh")

    def __len__(self):
        return len(range(self.position, self.size, self.global_batch))

    def __iter__(self):
        order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        for start in range(self.position, self.size, self.global_batch):
            step = order[start:start + self.global_batch]
            pieces = [len(step) // self.world_size + (r < len(step) % self.world_size) for r in range(self.world_size)]
            first = sum(pieces[:self.rank])
            yield step[first:first + pieces[self.rank]].tolist()


def memory_report(model, optimizer):
    """Every rank calls it after a step (a collective); a line per rank: the bytes of parameters, gradients and
    optimizer state the rank holds (a DTensor's local shard with FSDP's padding), beside a DDP rank's full copies."""
    def held(tensors):  # each storage counted once
        locals_ = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in locals_}.values())

    def whole(tensors):
        return sum(t.numel() * t.element_size() for t in tensors)

    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    states = [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)
              and v.dim() > 0]  # scalar entries (Adam's step) are no model-sized state
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, (held(params), held(grads), held(states)))
    full = (whole(params), whole(grads), whole(states))  # what a DDP rank holds
    return "\n".join(f"Rank {rank} holds params {p:,} B | grads {g:,} B | optimizer state {o:,} B; DDP would hold "
                     f"{full[0]:,} | {full[1]:,} | {full[2]:,} B" for rank, (p, g, o) in enumerate(ranks))
