"""The directories of sharded checkpoints (fsdp.py): which are complete, whether one fits the model, and who
may write them.

A checkpoint of torch.distributed.checkpoint (DCP) is a directory: a file of shards per rank (`__0_0.distcp`,
`__1_0.distcp`, ...) and `.metadata`, which the coordinator writes last, once every rank has written and
fsynced its file. A save killed midway leaves some of these files, and DCP has no other notion of "complete".
So each checkpoint is written into `epoch_000004.tmp/`; when DCP's save has returned on rank 0, rank 0 writes
a marker (`complete.json`, fsynced) into it and renames it to `epoch_000004/`. Only directories so named with
the marker are loaded, the newest first; leftovers of killed saves are removed at the next start. A checkpoint
taken mid-epoch is `epoch_000004_sample_000001024/`: 4 epochs done, and 1024 samples of the fifth one's order;
the marker holds where training stands (epochs, position, steps, and what the position depends on).
"""
import json
import os
import re
import shutil
import uuid
from concurrent.futures import Future
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, TensorStorageMetadata
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from ddp_common import snapshot
from ddp_common.errors import UsageError, one_line
from ddp_common.teardown import join_save_threads

MARKER = "complete.json"
KEEP = 2  # complete checkpoints kept: the newest, and the one before it
NAME = re.compile(r"epoch_(\d+)(?:_sample_(\d+))?")


class CheckpointDir:
    """The checkpoints under `root`: `epoch_NNNNNN[_sample_NNNNNNNNN]/` once complete, with `.tmp` while written.
    `root` must be the same directory for every rank: on several nodes, a filesystem they all share.

    DCP's collectives run in a gloo group of the checkpoints' own (`group`): an async save runs them in a
    thread while training runs FSDP's in the default group, and two threads' collectives in one group could
    interleave differently on different ranks. dcp.async_save also needs a CPU group when training uses NCCL."""

    def __init__(self, root, log):
        self.root, self.log = root, log  # log: how rank 0 reports a checkpoint complete
        self.group = dist.new_group(backend="gloo")
        self.pending = None  # [where, what dcp.save or dcp.async_save returned] until marked complete

    def path(self, where):
        """The directory of the checkpoint of `where` (a dict: epochs_run, position)."""
        name = f"epoch_{where['epochs_run']:06d}" + (f"_sample_{where['position']:09d}" if where["position"] else "")
        return os.path.join(self.root, name)

    def complete(self):
        """[((epochs, position), path)] of the complete checkpoints, oldest first."""
        names = os.listdir(self.root) if os.path.isdir(self.root) else []
        found = [((int(m[1]), int(m[2] or 0)), os.path.join(self.root, name)) for name in names
                 if (m := NAME.fullmatch(name))]
        return sorted((key, path) for key, path in found if os.path.isfile(os.path.join(path, MARKER)))

    def newest(self):
        """Every rank calls this at start: (where, path) of the newest complete checkpoint, `where` being what its
        marker holds (epochs_run, position, steps, ...); (None, None) if there is none. Rank 0 makes sure it can write under root and that no other live run does (snapshot.check_writable,
        snapshot.lock), removes what killed saves left, and decides; every rank checks that it sees the same root.
        A problem stops every rank with the same line."""
        choice = problem = None
        if dist.get_rank() == 0:
            try:
                snapshot.check_writable(os.path.join(self.root, "checkpoint"))
                snapshot.lock(self.root)  # before the clean-up below: the .tmp of another live run is not litter
                for name in os.listdir(self.root):
                    if name.endswith(".tmp"):  # no save of this run starts before every rank has passed this point
                        shutil.rmtree(os.path.join(self.root, name))
                probe = f".probe-{uuid.uuid4().hex}"
                open(os.path.join(self.root, probe), "w").close()
                newest = (self.complete() or [(None, None)])[-1][1]
                where = json.load(open(os.path.join(newest, MARKER))) if newest else None
                choice = (probe, (where, newest))
            except UsageError as error:
                problem = str(error).replace("the snapshot", "checkpoints in", 1)
        box, sees = [(choice, problem)], [None] * dist.get_world_size()
        dist.broadcast_object_list(box, src=0, group=self.group)
        choice, problem = box[0]
        if problem:
            raise UsageError(problem)
        probe, newest = choice
        dist.all_gather_object(sees, os.path.exists(os.path.join(self.root, probe)), group=self.group)
        if dist.get_rank() == 0:
            os.remove(os.path.join(self.root, probe))
        if not all(sees):
            blind = [rank for rank, seen in enumerate(sees) if not seen]
            raise UsageError(f"ranks {blind} do not see the files rank 0 writes in {self.root}: every rank writes "
                             "its shards into the same checkpoint, so --snapshot_path must be on a filesystem all "
                             "nodes share (NFS, Lustre, ...)")
        return newest

    @contextmanager
    def loading(self, path, state):
        """Around dcp.load(state, ...): a checkpoint of another model, or one with a shard missing or unreadable
        on any rank, becomes one line on every rank."""
        check_fits(path, state)
        try:
            yield
        except CheckpointException as error:  # DCP gathers every rank's failure into this BaseException
            ranks = sorted(error.failures)
            cause = error.failures[ranks[0]][0]
            raise UsageError(f"checkpoint {path} is damaged: rank{'s' * (len(ranks) > 1)} "
                             f"{', '.join(map(str, ranks))} could not read it ({type(cause).__name__}: "
                             f"{one_line(cause)}); move it away to resume from the one before, or pass another "
                             "--snapshot_path") from None

    def start(self, where):
        """The directory to save the checkpoint of `where` (epochs_run, position, steps, ...: what its marker will
        hold) into, once the save before it is complete (DCP saves one at a time). Nothing loads it until it is
        marked complete."""
        self.commit(wait=True)
        self.pending = [where, None]
        return self.path(where) + ".tmp"

    def saving(self, result):
        """What dcp.save (metadata: written) or dcp.async_save (a future: being written) returned."""
        self.pending[1] = result

    def commit(self, wait):
        """Mark the checkpoint in flight complete once its save has returned (now, if `wait`): on rank 0 that
        means every rank's shards and the metadata are on disk. Rank 0 writes the marker (fsynced), renames the
        directory, and removes the oldest beyond the newest KEEP."""
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
        snapshot.fsync_dir(self.root)
        for _, old in self.complete()[:-KEEP]:
            shutil.rmtree(old)
        if where["position"]:
            self.log(f"Epoch {where['epochs_run']} | sample {where['position']} | Snapshot saved at {final}")
        else:
            self.log(f"Epoch {where['epochs_run'] - 1} | Snapshot saved at {final}")


def check_fits(path, state):
    """Stop with one line if the checkpoint at `path` holds other tensors than `state` would load (another
    model, other flags): DCP itself loads a checkpoint with extra tensors without a word."""
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as error:
        raise UsageError(f"checkpoint {path} cannot be read ({type(error).__name__}: {one_line(error)}); move it "
                         "away to resume from the one before, or pass another --snapshot_path") from None
    saved = {key: tuple(item.size) for key, item in metadata.state_dict_metadata.items()
             if isinstance(item, TensorStorageMetadata)}
    ours = {key: tuple(value.shape) for key, value in flatten_state_dict(state)[0].items()
            if isinstance(value, torch.Tensor)}
    differences = ([f"{key} is {list(saved[key])}, here {list(ours[key])}" for key in ours
                    if key in saved and saved[key] != ours[key]]
                   + [f"{key} is missing" for key in ours if key not in saved]
                   + [f"it holds {key}, which this model lacks" for key in saved if key not in ours])
    if differences:
        raise UsageError(f"checkpoint {path} does not fit this model or optimizer ({'; '.join(differences[:3])}"
                         f"{'; ...' if len(differences) > 3 else ''}); it belongs to another model or flags: move it "
                         "away or pass another --snapshot_path")
