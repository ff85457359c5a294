"""Snapshot files: written atomically, checked when read, and claimed by one run at a time.

What a snapshot holds is each script's own business (a dict in the script: model, optimizer, epochs, RNG
state, ...). This module only makes the file trustworthy:
- save: a temporary file, flushed to disk and renamed over the old one, so a crash mid-save leaves either the
  old or the new snapshot, never half of one; a marker says these scripts wrote it.
- load: a missing file is a fresh start; a truncated, foreign or unreadable one is a one-line error and is left
  alone (training on would overwrite it).
- claim: before the first training step, the rank that saves proves it can create, write and rename a file
  where the snapshot goes, and locks the path against other live runs (the lock dies with its holder, so a
  killed run never blocks its own restart); with a process group, every rank learns of a problem at once.
"""
import atexit
import errno
import fcntl
import glob
import json
import multiprocessing
import multiprocessing.util
import os
import socket
import sys
import threading
import time
import uuid
import zipfile

import torch
import torch.distributed as dist

from ddp_common import launchers
from ddp_common.errors import UsageError, one_line

FORMAT = "ddp-examples-snapshot-v2"
ZIP_MAGIC = b"PK\x03\x04"  # torch.save writes a zip archive
_locks = {}  # path -> open lock file: held for as long as this process lives
_in_flight, _failed = [], []  # the background save being written; what it raised


def save(state, path, background=False):
    """Write the dict `state` to `path` atomically: a reader, or the next start after a crash, sees the old
    snapshot or the new one, whole. With `background`, return once the state is copied, and write it in a thread
    while training goes on (the write, fsync above all, no longer stalls the step); one save at a time, so the
    next one waits for this one, and finish_saves() waits before the process ends."""
    finish_saves()
    if not background:
        write(state, path)
        return
    writer = threading.Thread(target=write_in_background, args=(copied(state), path), name="snapshot-writer")
    _in_flight.append(writer)
    writer.start()


def copied(value):
    """`value` with every tensor in it copied to the CPU: what the training thread may change next is not written."""
    if torch.is_tensor(value):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: copied(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(copied(item) for item in value)
    return value


def write_in_background(state, path):
    try:
        write(state, path)
    except BaseException as error:  # raised in the training thread by the next save or finish_saves()
        _failed.append(error)


def finish_saves():
    """Wait for the snapshot being written in the background, if any; raise what its write raised."""
    while _in_flight:
        _in_flight.pop().join()
    if _failed:
        raise _failed.pop()


def write(state, path):
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    remove_stale_temporaries(path)
    # Unique per writer: on a shared filesystem, one rank per node may save the same path at once.
    tmp_path = f"{path}.tmp.{socket.gethostname()}.{os.getpid()}"
    try:
        with open(tmp_path, "wb") as f:
            torch.save({"format": FORMAT, **state}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    finally:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
    fsync_dir(directory)  # make the rename itself durable


def load(path):
    """The snapshot at `path` as a dict on the CPU, None if there is none. One that is truncated, that these
    scripts did not write, or that cannot be read is a UsageError and is left alone."""
    if not os.path.exists(path):
        return None
    if os.path.isdir(path):
        raise UsageError(f"{path} is a directory, not a snapshot file; pass another --snapshot_path")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise UsageError(f"snapshot {path} {unreadable(path, error)}; move it away to start afresh, or pass another "
                         "--snapshot_path") from None
    if not isinstance(state, dict) or "format" not in state:
        raise UsageError(f"{path} is not a snapshot written by these scripts (torch.save wrote it, but without their "
                         "marker); move it away to start afresh, or pass another --snapshot_path")
    if state["format"] != FORMAT:
        raise UsageError(f"{path} was written by another version of these scripts ({state['format']}, this one reads "
                         f"{FORMAT}); move it away to start afresh, or pass another --snapshot_path")
    return state


def unreadable(path, error):
    """Why torch.load failed, in words a user can act on."""
    with open(path, "rb") as f:
        head = f.read(len(ZIP_MAGIC))
    size = os.path.getsize(path)
    if head == ZIP_MAGIC and not zipfile.is_zipfile(path):
        return (f"is truncated: its {size} bytes stop before the end of the archive torch.save writes (a copy cut "
                "short, or a full disk?)")
    if head != ZIP_MAGIC:
        return f"is not a snapshot: {size} bytes that torch.save did not write"
    return f"cannot be read ({type(error).__name__}: {one_line(error)})"


def claim(path, saves=True):
    """Every rank calls this before training: returns the snapshot at `path` (None for a fresh start) and, on
    the ranks that `saves`, makes sure now, not at the first save, that they can write it and that no other run
    is writing it. A problem on any rank stops every rank with the same UsageError, so that none of them is left
    waiting for one that stopped (and reports a lost peer)."""
    problem, state = None, None
    try:
        if saves:
            check_writable(path)
            lock(path)
        state = load(path)
    except UsageError as error:
        problem = str(error)
    agree(problem)
    return state


def claim_directory(path, saves=True):
    """claim() for a directory that a library fills (the Hugging Face Trainer's output_dir): every rank calls it;
    the ranks that `saves` check that they can create and rename files in it and lock it against other runs."""
    problem = None
    try:
        if saves:
            check_writable(os.path.join(path, "checkpoint"))
            lock(path)
    except UsageError as error:
        problem = str(error).replace("the snapshot", "into", 1)
    agree(problem)


def agree(problem):
    """Every rank calls this with its problem (None if it has none): with a process group, all raise the first
    rank's problem, naming that rank; alone, raise one's own."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        found = [(rank, text) for rank, text in enumerate(problems) if text]
        if found:
            rank, text = found[0]
            raise UsageError(f"{text} (on rank {rank})")
    elif problem:
        raise UsageError(problem)


def check_writable(path):
    """Create, write, fsync and rename a file beside `path`, as every save does; a UsageError naming the path
    and the reason if any of it fails."""
    directory = os.path.dirname(os.path.abspath(path))
    probe = f"{path}.tmp.{socket.gethostname()}.{os.getpid()}"
    doing = f"create the directory {directory}"
    try:
        if os.path.isdir(path):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
        os.makedirs(directory, exist_ok=True)
        doing = f"create a file in {directory}"
        with open(probe, "wb") as f:
            f.write(b"can this run write here?")
            f.flush()
            os.fsync(f.fileno())
        doing = f"rename a file in {directory}"
        os.replace(probe, probe + ".renamed")
        os.remove(probe + ".renamed")
    except OSError as error:
        for leftover in (probe, probe + ".renamed"):
            try:
                os.remove(leftover)
            except OSError:
                pass
        raise UsageError(f"cannot write the snapshot {path}: {why_not(directory, doing, error)}; pass a "
                         "--snapshot_path where this run can create and rename files") from None


def why_not(directory, doing, error):
    blocking = directory
    while blocking and not os.path.exists(blocking):
        blocking = os.path.dirname(blocking)
    if blocking and not os.path.isdir(blocking):
        return f"{blocking} is a file, where a directory should be"
    if isinstance(error, IsADirectoryError):
        return f"{error.filename} is a directory"
    return f"cannot {doing} ({error.strerror})"


def lock(path):
    """Hold `path`.lock (flock) for as long as this process lives; a UsageError naming the holder if another live
    run holds it. The kernel lets go when the holder dies, however it dies; a holder that exits normally also
    removes the file. Two nodes of one job may share a snapshot path (a shared filesystem, or nodes sharing a
    machine): the second finds its own job there and goes on."""
    if path in _locks:
        return
    lock_path = f"{path}.lock"
    while True:
        f = open(lock_path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = read_holder(f)
            f.close()
            if holder.get("job") is not None and holder.get("job") == launchers.job_id():
                return  # this job's other node: it holds the lock for both
            raise UsageError(f"{path} belongs to another run that is still going (pid {holder.get('pid', '?')} on "
                             f"{holder.get('host', '?')}: {holder.get('command', '?')}); let it finish, or give this "
                             "run another --snapshot_path") from None
        # A holder that was exiting may have removed the file between our open and our lock: then we hold a lock
        # on a file nobody else can see. Lock the file that is there now.
        try:
            if os.fstat(f.fileno()).st_ino == os.stat(lock_path).st_ino:
                break
        except FileNotFoundError:
            pass
        f.close()
    f.seek(0)
    f.truncate()
    json.dump({"pid": os.getpid(), "host": socket.gethostname(), "job": launchers.job_id(),
               "command": " ".join(sys.argv)}, f)
    f.flush()
    _locks[path] = f
    atexit.register(unlock, path)
    if multiprocessing.parent_process() is not None:  # mp.spawn's processes end without running atexit
        multiprocessing.util.Finalize(None, unlock, args=(path,), exitpriority=0)


def unlock_all():
    """Let go of every lock this process holds: for an exit that skips atexit (cli.exit_now, os._exit)."""
    for path in list(_locks):
        unlock(path)


def unlock(path):
    """Remove and let go of the lock of `path`, if this process holds it (at exit; again is harmless)."""
    f = _locks.pop(path, None)
    if f is not None:
        try:
            os.remove(f"{path}.lock")  # while still holding it: nobody else can hold it now
        except OSError:
            pass
        f.close()


def read_holder(f, patience_s=2.0):
    """What the holder of a lock wrote into it: it writes just after taking the lock, so wait a moment for it."""
    deadline = time.monotonic() + patience_s
    while True:
        f.seek(0)
        try:
            return json.loads(f.read())
        except ValueError:
            if time.monotonic() > deadline:
                return {}
            time.sleep(0.05)


def remove_stale_temporaries(path):
    """Delete the half-written files that writers on this host left when they were killed mid-save."""
    for tmp_path in glob.glob(f"{glob.escape(path)}.tmp.{glob.escape(socket.gethostname())}.*"):
        pid = tmp_path.rsplit(".", 1)[1]
        if pid.isdigit() and not alive(int(pid)):
            os.remove(tmp_path)


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, but another user's
        return True
    return True


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def describe(state, path):
    """What a rank tells the others of the snapshot it read (multinode.py): (epochs, run id, world size, path, a
    new run id in case every rank starts afresh)."""
    mine = (state["epochs_run"], state.get("run"), state.get("world_size")) if state else (0, None, None)
    return (*mine, path, uuid.uuid4().hex)


def one_run(held):
    """The training run that the ranks' snapshots (`held`: describe() of every rank) belong to: its id, or for a
    fresh start rank 0's new one. Snapshots of two different runs are a mistake (another job's files): resuming
    from either would lose the other, so every rank stops with the same UsageError."""
    runs = {}
    for rank, (epochs, run, _, path, _) in enumerate(held):
        if run is not None:
            runs.setdefault(run, (rank, epochs, path))
    if len(runs) > 1:
        (rank_a, epochs_a, path_a), (rank_b, epochs_b, path_b) = list(runs.values())[:2]
        raise UsageError(f"the snapshots come from two different training runs: {path_a} on rank {rank_a} "
                         f"({epochs_a} epochs) and {path_b} on rank {rank_b} ({epochs_b} epochs); keep this job's "
                         "snapshots and move the others away, or move all away to start afresh")
    return next(iter(runs), held[0][4])


def what_changed(held, source, state, world_size):
    """The lines multinode.py logs once the newest snapshot (rank `source`'s, `state`) reached every rank: which
    one won, when the ranks held different ones, and a change of world size since it was written."""
    epochs = [entry[0] for entry in held]
    lines = []
    if min(epochs) < max(epochs):
        lines.append(f"Newest snapshot: {held[source][3]} of rank {source}, sent to every rank (the ranks held "
                     f"{min(epochs)} to {max(epochs)} epochs)")
    if state and state.get("world_size", world_size) != world_size:
        lines.append(f"World size {state['world_size']} -> {world_size} at epoch {max(epochs)}")
    return lines
