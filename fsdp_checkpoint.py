"""fsdp.py's checkpoint protocol, beside it as upstream FSDP2's checkpoint.py is beside example.py: which sharded
checkpoints are complete, whether one fits the model, the sampler whose position a mid-epoch checkpoint keeps,
and the bytes each rank holds.

A checkpoint of torch.distributed.checkpoint (DCP) is a directory: a file of shards per rank (`__0_0.distcp`, ...)
and `.metadata`, written last by the coordinator. A save killed midway leaves some of these files, and DCP has no
notion of "complete". So each checkpoint is written into `epoch_000004.tmp/`; once DCP's save has returned, rank 0
writes a marker (`complete.json`, fsynced) into it and renames it `epoch_000004/`. Only directories so named with
the marker are loaded, the newest first; leftovers of killed saves are removed at the next start. A checkpoint
taken mid-epoch is `epoch_000004_sample_000001024/`: 4 epochs done, and 1024 samples of the fifth one's order.

DCP keeps no checksums: flipped bytes in a shard load without a word. So each rank sums the files it wrote (CRC-32,
in the save's thread), and the marker lists every file with its size and sum. At the next start the ranks check
them, each a share, before DCP reads a byte: a damaged checkpoint is one line or, with --skip_damaged, set aside
(renamed `epoch_000004.damaged`) for the newest one that checks out. The marker also records what a resume must
share (the model, the dataset, the seed, the global batch): another is one line, before any training.
"""
import json
import os
import re
import shutil
import sys
import threading
import uuid
import warnings
import zlib
from concurrent.futures import Future
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import (CheckpointException, FileSystemReader, FileSystemWriter,
                                          TensorStorageMetadata, load)
from torch.distributed.tensor import DTensor

MARKER = "complete.json"
KEEP = 2  # complete checkpoints kept: the newest, and the one before it
NAME = re.compile(r"epoch_(\d+)(?:_sample_(\d+))?")
REQUIRED = ("epochs_run", "position", "steps")  # in every marker
SUMS = ".sums-"  # a rank's sums of the files it wrote, left beside them for rank 0 (gathered into the marker)
CHUNK = 4 << 20  # bytes read at a time to sum a file


def first_line(error):
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def check_folder(path):
    """Rank 0 calls it before any work: --snapshot_path is a folder it can write into, made if need be, or one line
    says why not (torchrun then stops every rank)."""
    if os.path.exists(path) and not os.path.isdir(path):
        sys.exit(f"error: --snapshot_path {path} is a file, not a folder: each checkpoint is a folder inside it; "
                 "pass another path, or move the file away")
    probe = os.path.join(path, f".probe-{os.getpid()}")
    try:
        os.makedirs(path, exist_ok=True)
        open(probe, "wb").close()
        os.remove(probe)
    except OSError as error:
        sys.exit(f"error: cannot write the snapshot {path} ({error.filename}: {error.strerror})")


class CheckpointDir:
    """The checkpoints under `root`, the same directory for every rank (on several nodes, a filesystem they share).
    DCP's collectives run in a gloo group of their own: an async save runs them in a thread while training runs
    FSDP's in the default group (two threads' collectives in one group could interleave differently on different
    ranks), and dcp.async_save needs a CPU group when training uses NCCL. skip_damaged (--skip_damaged): a damaged
    checkpoint is set aside for the one before it, rather than stopping the run."""

    def __init__(self, root, log, skip_damaged=False):
        self.root, self.log = root, log  # log: how rank 0 reports a checkpoint complete
        self.skip_damaged = skip_damaged
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

    def newest(self, here):
        """Every rank calls this at start: (where, path) of the newest complete checkpoint whose files match their
        sums (`where`: its marker), or (None, None). `here`: what this run would write into a marker, for what a
        resume must share. Rank 0 removes what killed saves left and reads the markers; every rank checks that it
        sees rank 0's files, so that all write into one checkpoint, and checks a share of each file's sums."""
        choice = None
        if dist.get_rank() == 0:
            for name in os.listdir(self.root):
                if name.endswith(".tmp"):  # no save of this run starts before every rank has passed this point
                    shutil.rmtree(os.path.join(self.root, name))
            probe = f".probe-{uuid.uuid4().hex}"
            open(os.path.join(self.root, probe), "w").close()
            choice = (probe, [path for _, path in self.complete()])
        box, sees = [choice], [None] * dist.get_world_size()
        dist.broadcast_object_list(box, src=0, group=self.group)
        probe, paths = box[0]
        dist.all_gather_object(sees, os.path.exists(os.path.join(self.root, probe)), group=self.group)
        if dist.get_rank() == 0:
            os.remove(os.path.join(self.root, probe))
        if not all(sees):
            sys.exit(f"error: ranks {[rank for rank, seen in enumerate(sees) if not seen]} do not see the files rank 0 "
                     f"writes in {self.root}: every rank writes its shards into the same checkpoint, so "
                     "--snapshot_path must be on a filesystem all nodes share (NFS, Lustre, ...)")
        for path in reversed(paths):
            box = [read_marker(path) if dist.get_rank() == 0 else None]
            dist.broadcast_object_list(box, src=0, group=self.group)
            where, damage = box[0]
            if where and (line := mismatch(path, where, here)):  # whole, but not this run's: no older one helps
                self.stop(line)
            if where and "files" not in where:
                self.log(f"Checkpoint {path} lists no sums (an older fsdp_checkpoint.py saved it): its files unchecked")
            elif where:
                damage = self.check_files(path, where["files"])
            if not damage:
                return where, path
            if not self.skip_damaged:
                self.stop(f"error: checkpoint {path} is damaged: {damage}; pass --skip_damaged to set it aside and "
                          "resume from the newest checkpoint that checks out, or move it away")
            if dist.get_rank() == 0:
                aside = set_aside(path)
                self.log(f"Checkpoint {path} is damaged ({damage}): set aside as {aside} (--skip_damaged)")
        if paths:
            self.stop(f"error: no checkpoint in {self.root} checks out: each is set aside as *.damaged; start again "
                      "to train from the beginning")
        return None, None

    def check_files(self, path, files):
        """Every rank reads a share of the checkpoint's files (the largest first, dealt round the ranks) and sums
        them: what is wrong with the first file that does not match its marker, or None (a collective)."""
        names = sorted(files, key=lambda name: (-files[name]["bytes"], name))
        mine = [found for name in names[dist.get_rank()::dist.get_world_size()]
                if (found := file_damage(os.path.join(path, name), files[name]))]
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine, group=self.group)
        damage = sorted(found for rank in everyone for found in rank)
        if not damage:
            return None
        return damage[0] + (f" (and {len(damage) - 1} more file{'s' * (len(damage) > 2)})" if len(damage) > 1 else "")

    def stop(self, line):
        """Every rank calls it with the same line: rank 0 says it, and every rank leaves (exit code 1). The line is
        written before any rank leaves, since torchrun stops the others as soon as one has left; the others say
        nothing, so that no two ranks' lines run into one. It leaves as the scripts do where the group lives on:
        at once (os._exit), since Python's own exit can stall in gloo's threads."""
        if dist.get_rank() == 0:
            sys.stdout.flush()
            sys.stderr.flush()
            os.write(2, f"{line}\n".encode())  # one write: no other process's output lands inside the line
        dist.barrier(group=self.group)
        sys.stdout.flush()
        os._exit(1)

    @contextmanager
    def loading(self, path, state):
        """Around dcp.load(state, ...): a checkpoint of another model or optimizer layout, or one DCP cannot read
        on some rank, is one line from rank 0."""
        if line := check_fits(path, state):
            self.stop(line)
        try:
            yield
        except CheckpointException as error:  # DCP gathers every rank's failure into this BaseException
            ranks = sorted(error.failures)
            cause = error.failures[ranks[0]][0]
            self.stop(f"error: checkpoint {path} is damaged: rank{'s' * (len(ranks) > 1)} "
                      f"{', '.join(map(str, ranks))} could not read it ({type(cause).__name__}: {first_line(cause)}); "
                      "move it away to resume from the one before, or pass another --snapshot_path")

    def start(self, where):
        """A writer into the directory to save the checkpoint of `where` in (as dcp.save's storage_writer), once
        the save before it is complete (DCP saves one at a time)."""
        self.commit(wait=True)
        self.pending = [where, None]
        return SummingWriter(self.path(where) + ".tmp")

    def saving(self, result):
        """What dcp.save (metadata: written) or dcp.async_save (a future: being written) returned."""
        self.pending[1] = result

    def commit(self, wait):
        """Mark the checkpoint in flight complete once its save has returned (now, if `wait`): on rank 0 that means
        every rank's shards, their sums and the metadata are on disk. Rank 0 writes the marker with every file's
        sum, renames the directory, and removes the oldest beyond the newest KEEP."""
        if self.pending is None:
            return
        where, result = self.pending
        still_saving = isinstance(result, Future) and not result.done()
        if still_saving and not wait:
            return
        self.pending = None
        if isinstance(result, Future):
            result.result()  # raises what the save thread raised
            join_save_threads()
        if dist.get_rank() != 0:
            return
        staging, final = self.path(where) + ".tmp", self.path(where)
        files = gather_sums(staging)  # before the marker is there
        with open(os.path.join(staging, MARKER), "w") as f:
            json.dump({**where, "world_size": dist.get_world_size(), "saved_by": os.path.basename(sys.argv[0]),
                       "files": files}, f)
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


class SummingWriter(FileSystemWriter):
    """DCP's file writer, which then sums each file this rank wrote: in the save's own thread (dcp.async_save's
    too), every rank its own files at once, read back from the page cache. The sums go into a file beside them,
    which rank 0 gathers into the marker once every rank has written (DCP's save returns on rank 0 only then)."""

    def write_data(self, plan, planner):
        results = super().write_data(plan, planner).wait()  # FileSystemWriter has written its files by now
        names = sorted({result.storage_data.relative_path for result in results})
        with open(os.path.join(self.path, f"{SUMS}{uuid.uuid4().hex}.json"), "w") as f:
            json.dump({name: file_sum(os.path.join(self.path, name)) for name in names}, f)
        written = torch.futures.Future()
        written.set_result(results)
        return written


def gather_sums(staging):
    """Rank 0, once a save has returned: {file: its size and sum} of every file in the checkpoint being written,
    from the ranks' files of sums (then removed), and summed here for the rest (DCP's .metadata)."""
    files = {}
    for name in os.listdir(staging):
        if name.startswith(SUMS):
            with open(os.path.join(staging, name)) as f:
                files.update(json.load(f))
            os.remove(os.path.join(staging, name))
    for name in set(os.listdir(staging)) - set(files):
        files[name] = file_sum(os.path.join(staging, name))
    return dict(sorted(files.items()))


def file_sum(path):
    """A file's size and CRC-32: zlib's, about 2 GB/s on a core, twice SHA-256's (benchmarks/checkpoint_sums.py)."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return {"bytes": size, "crc32": f"{crc:08x}"}


def file_damage(path, listed):
    """What is wrong with the file at `path` against its entry in the marker, or None."""
    name = os.path.basename(path)
    try:
        found = file_sum(path)
    except FileNotFoundError:
        return f"{name} is missing"
    except OSError as error:
        return f"{name} cannot be read ({error.strerror})"
    if found["bytes"] != listed["bytes"]:
        return f"{name} holds {found['bytes']:,} bytes, {MARKER} says {listed['bytes']:,}"
    if found["crc32"] != listed["crc32"]:
        return f"{name} does not match its sum (CRC-32 {found['crc32']}, {MARKER} says {listed['crc32']})"
    return None


def read_marker(path):
    """(the marker of the checkpoint at `path`, None), or (None, why it cannot be read)."""
    try:
        with open(os.path.join(path, MARKER)) as f:
            where = json.load(f)
        if not isinstance(where, dict) or not all(isinstance(where.get(key), int) for key in REQUIRED):
            raise ValueError(f"it lacks {', '.join(REQUIRED)}")
        files = where.get("files", {})
        if not isinstance(files, dict) or not all(isinstance(entry, dict) and isinstance(entry.get("bytes"), int)
                                                  and isinstance(entry.get("crc32"), str) for entry in files.values()):
            raise ValueError("its files lack their sizes or sums")
    except (OSError, ValueError) as error:  # JSONDecodeError is a ValueError
        return None, f"its {MARKER} cannot be read ({type(error).__name__}: {first_line(error)})"
    return where, None


def mismatch(path, saved, here):
    """The line that says why this run cannot go on from a checkpoint whose marker is `saved` (`here`: this run's
    marker), or None. Entries that either marker lacks are not compared."""
    def differs(key):
        return key in saved and key in here and saved[key] != here[key]

    if differs("architecture"):
        by = f", saved by {saved['saved_by']}" if "saved_by" in saved else ""
        return (f"error: checkpoint {path} holds another model ({saved['architecture']}{by}); this script trains a "
                f"{here['architecture']}: pass another --snapshot_path")
    for key in ("dataset_size", "seed"):  # a position counts into one dataset size's and seed's order
        if differs(key):
            return (f"error: checkpoint {path} was made with another {key.replace('_', ' ')} ({saved[key]}, here "
                    f"{here[key]}): its position means nothing here; move it away to start afresh")
    if differs("global_batch"):
        return (f"error: checkpoint {path} was made with a global batch of {saved['global_batch']}, here "
                f"{here['global_batch']}: pass --global_batch_size {saved['global_batch']} to train on as it would "
                "have, or another --snapshot_path to start afresh")
    return None


def set_aside(path):
    """Rename a damaged checkpoint out of the way (kept, never loaded, never removed): path.damaged, or
    path.damaged2, ... where one is there already."""
    aside, count = path + ".damaged", 1
    while os.path.exists(aside):
        count += 1
        aside = f"{path}.damaged{count}"
    os.rename(path, aside)
    return aside


def dcp_keys(state, prefix=""):
    """{key: shape, or None for what is no tensor (an optimizer's settings)} of a state under DCP's flat keys, as
    its traverse_state_dict makes them: {"model": {"inp.weight": ...}} is "model.inp.weight", and a list that holds
    dicts or tensors counts its items ("optimizer.param_groups.0.lr")."""
    if isinstance(state, dict):
        items = state.items()
    elif isinstance(state, list) and any(isinstance(item, (dict, torch.Tensor)) for item in state):
        items = enumerate(state)
    else:
        return {prefix: tuple(state.shape) if isinstance(state, torch.Tensor) else None}
    found = {}
    for key, value in items:
        found.update(dcp_keys(value, f"{prefix}.{key}" if prefix else str(key)))
    return found


def check_fits(path, state):
    """The line that says why the checkpoint at `path` does not fit `state` (another model, other sizes, another
    optimizer or layout of its state), or None: DCP itself loads a checkpoint with extra tensors without a word,
    and calls one whose keys it lacks unreadable."""
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as error:  # noqa: BLE001  whatever damaged metadata raises: one line
        return (f"error: checkpoint {path} cannot be read ({type(error).__name__}: {first_line(error)}); move it "
                "away to resume from the one before, or pass another --snapshot_path")
    saved = {key: tuple(item.size) if isinstance(item, TensorStorageMetadata) else None
             for key, item in metadata.state_dict_metadata.items()}
    ours = dcp_keys(state)
    theirs_model, our_model = ({key for key in keys if key.startswith("model.")} for keys in (saved, ours))
    if len(theirs_model & our_model) < len(our_model) / 2:  # most names unknown: another model, not other sizes
        def some(keys):
            return f"{', '.join(sorted(keys)[:2])}, ... {len(keys)} tensors"
        return (f"error: checkpoint {path} holds another model ({some(theirs_model)}), not this script's "
                f"({some(our_model)}): pass another --snapshot_path")
    tensors = [key for key, shape in ours.items() if shape is not None]
    differences = ([f"{key} is {list(saved[key])}, here {list(ours[key])}" for key in tensors
                    if saved.get(key) is not None and saved[key] != ours[key]]
                   + [f"{key} is missing" for key in tensors if saved.get(key) is None]
                   + [f"it holds {key}, which this model lacks" for key, shape in saved.items()
                      if shape is not None and ours.get(key) is None])
    if differences:
        return (f"error: checkpoint {path} does not fit this model or optimizer ({'; '.join(differences[:3])}"
                f"{'; ...' if len(differences) > 3 else ''}); it belongs to another model or flags: move it away or "
                "pass another --snapshot_path")
    settings = sorted(key for key, shape in ours.items() if shape is None and key not in saved)
    if not settings:
        return None
    theirs, here = optimizer_layout(saved), optimizer_layout(ours)  # the same tensors: the settings under other keys
    if theirs != here:
        return (f"error: checkpoint {path} keeps its optimizer state {theirs}, and this script keeps it {here}: "
                "another layout; pass another --snapshot_path")
    return (f"error: checkpoint {path} does not fit this optimizer ({settings[0]} is missing): it belongs to another "
            "optimizer: move it away or pass another --snapshot_path")


def optimizer_layout(keys):
    """How a state keys its optimizer's settings, said for a line: one group after another, or by parameter."""
    if any(re.fullmatch(r"optimizer\.param_groups\.\d+\.lr", key) for key in keys):
        return "nested (optimizer.param_groups.0.lr: get_state_dict's default)"
    return "flattened (optimizer.param_groups.<parameter>.lr: flatten_optimizer_state_dict=True)"


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
