"""Snapshots that resume a run exactly and survive being killed half-way through a save.

A snapshot holds everything the next epoch depends on: model and optimizer state (and scheduler and
gradient scaler where a script uses them), the number of epochs completed, and the RNG states of
python, numpy and torch (CPU and CUDA). It is written to a temporary file, flushed to disk and renamed
over the old one, so a crash leaves either the old or the new snapshot, never half of one.

Two fields say where it comes from without changing what resumes: the world size it was saved at (training
resumes at any size), and the id of its training run, made at a fresh start and handed on by every resume,
so that snapshots of two different runs are never mixed. Snapshots written before either field still load.
"""
import glob
import os
import random
import socket
import uuid

import numpy as np
import torch
import torch.distributed as dist

from ddp_common.errors import UsageError, one_line

FORMAT = "ddp-examples-snapshot-v1"


def savable_numpy_state(state):
    """A numpy generator's get_state() in types that weights_only loading accepts: the MT19937 keys, a numpy
    array, travel as a tensor."""
    name, keys, *rest = state
    return (name, torch.from_numpy(keys.astype(np.int64)), *rest)


def numpy_state(saved):
    """The inverse of savable_numpy_state, for set_state()."""
    name, keys, *rest = saved
    return (name, keys.numpy().astype(np.uint32), *rest)


def rng_states():
    return {
        "python": random.getstate(),
        "numpy": savable_numpy_state(np.random.get_state()),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_states(states):
    random.setstate(states["python"])
    np.random.set_state(numpy_state(states["numpy"]))
    torch.set_rng_state(states["torch"])
    if states["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


_run_id = None  # this process's training run: adopted from the snapshot it resumed, or made at its first save


def run_id():
    global _run_id
    if _run_id is None:
        _run_id = uuid.uuid4().hex
    return _run_id


def unwrap(model):
    """The model inside DDP or DataParallel, so snapshot keys carry no `module.` prefix."""
    return getattr(model, "module", model)


def save(path, model, optimizer, epochs_run, scheduler=None, scaler=None, **extra):
    """Write a snapshot atomically: a reader, or the next start after a crash, sees the old or the new one.
    `extra` entries (a script's own state, e.g. its communication hook's) are stored beside the others."""
    state = {
        "format": FORMAT,
        "epochs_run": epochs_run,
        "model": unwrap(model).state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "rng": rng_states(),
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "run": run_id(),
        **extra,
    }
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    remove_stale_temporaries(path)
    # Unique per writer: on a shared filesystem, one rank per node may save the same path at once.
    tmp_path = f"{path}.tmp.{socket.gethostname()}.{os.getpid()}"
    try:
        with open(tmp_path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    finally:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def remove_stale_temporaries(path):
    """Delete the half-written files that writers on this host left when they were killed mid-save."""
    for tmp_path in glob.glob(f"{glob.escape(path)}.tmp.{glob.escape(socket.gethostname())}.*"):
        pid = tmp_path.rsplit(".", 1)[1]
        if pid.isdigit() and not _alive(int(pid)):
            os.remove(tmp_path)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, but another user's
        return True
    return True


def read(path):
    """The snapshot at `path` as a dict on the CPU, None if there is none. An unreadable file, or one these
    scripts did not write, is a UsageError and is left alone: training on would overwrite it."""
    if not os.path.exists(path):
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise UsageError(f"snapshot {path} cannot be read ({type(error).__name__}: {one_line(error)}); "
                         "move it away to start afresh, or pass another --snapshot_path") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UsageError(f"{path} is not a snapshot written by these scripts; "
                         "move it away to start afresh, or pass another --snapshot_path")
    return state


def restore(state, path, model, optimizer, scheduler=None, scaler=None):
    """Put a snapshot read from `path` into model, optimizer (and scheduler, scaler) and the RNGs; return the
    epochs it completed. One of another model or other flags is a UsageError. The next saves carry on its run."""
    global _run_id
    try:
        unwrap(model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if scheduler is not None and state["scheduler"] is not None:
            scheduler.load_state_dict(state["scheduler"])
        if scaler is not None and state["scaler"] is not None:
            scaler.load_state_dict(state["scaler"])
    except (RuntimeError, ValueError, KeyError) as error:
        raise UsageError(f"snapshot {path} does not fit this model or optimizer ({one_line(error)}); "
                         "it belongs to another model or flags: move it away or pass another --snapshot_path"
                         ) from None
    set_rng_states(state["rng"])
    _run_id = state.get("run") or _run_id  # a snapshot older than the field: its next save starts a run id
    return state["epochs_run"]


def load(path, model, optimizer, scheduler=None, scaler=None):
    """Resume from the snapshot at `path`: the epochs it completed, 0 if there is none (a fresh start)."""
    state = read(path)
    return 0 if state is None else restore(state, path, model, optimizer, scheduler, scaler)


def load_newest(path, model, optimizer, scheduler=None, scaler=None):
    """Every rank calls this, each with the snapshot on its own node's disk at `path`: all ranks resume from
    the newest snapshot that any of them holds, sent by its holder to the others. Returns (epochs, notes):
    lines for rank 0 to print, saying where training resumes from and whether the world size changed.

    Snapshots of one run differ when a node died between two saves, or joins an elastic job with an older
    snapshot or none (README: elastic training): training on from each node's own would average gradients
    of different models. Snapshots of two different runs are a mistake, never mixed: every rank stops with
    the same error, and so it does for an unreadable snapshot on any rank (one rank alone stopping would
    leave the others waiting in the next collective until the timeout)."""
    global _run_id
    try:
        state, problem = read(path), None
    except UsageError as error:
        state, problem = None, str(error)
    mine = (state["epochs_run"], state.get("run"), state.get("world_size")) if state else (0, None, None)
    held = [None] * dist.get_world_size()
    # uuid4: a run id for a fresh start, rank 0's for all, so that every node's saves carry the same one.
    dist.all_gather_object(held, (*mine, path, problem, uuid.uuid4().hex))
    problems = [(rank, text) for rank, (*_, text, _) in enumerate(held) if text]
    if problems:
        rank, text = problems[0]
        raise UsageError(f"{text} (on rank {rank})")
    check_one_run(held)
    epochs = [count for count, *_ in held]
    newest, notes = max(epochs), []
    if newest == 0:
        _run_id = held[0][-1]
        return 0, notes
    source = epochs.index(newest)
    if min(epochs) == newest:
        notes.append(f"Resuming from {path} at epoch {newest}")
    else:
        box = [state if dist.get_rank() == source else None]
        dist.broadcast_object_list(box, src=source)
        state = box[0]
        oldest = min(epochs) or "none"
        notes.append(f"Resuming from {held[source][3]} of rank {source} at epoch {newest}, the newest snapshot, sent "
                     f"to every rank (the ranks held from {oldest} to {newest} epochs)")
    epochs_run = restore(state, path, model, optimizer, scheduler, scaler)
    _run_id = state.get("run") or held[0][-1]
    saved_at, world_size = held[source][2], dist.get_world_size()
    if saved_at is not None and saved_at != world_size:
        notes.append(f"World size {saved_at} -> {world_size} at epoch {epochs_run}")
    return epochs_run, notes


def check_one_run(held):
    """Stop if the ranks hold snapshots of different training runs; `held`: each rank's (epochs, run, world
    size, path, ...)."""
    runs = {}
    for rank, (epochs, run, _, path, *_) in enumerate(held):
        if run is not None:
            runs.setdefault(run, (rank, epochs, path))
    if len(runs) > 1:
        (rank_a, epochs_a, path_a), (rank_b, epochs_b, path_b) = list(runs.values())[:2]
        raise UsageError(f"the snapshots come from two different training runs: {path_a} on rank {rank_a} "
                         f"({epochs_a} epochs) and {path_b} on rank {rank_b} ({epochs_b} epochs); keep this job's "
                         "snapshots and move the others away, or move all away to start afresh")
