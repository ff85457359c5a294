"""One rank's answer when the ranks are asked: what it is doing, as a dict that json carries to the others. The
collectives it waits in (from the flight recorder, with their group, module and line) or the point-to-point op;
else its error, or its own code (its line, busy or idle)."""
import os
import socket
import sys
import threading
import time
import traceback

from torchdiagnose import lines, parallel, recorder
from torchdiagnose.state import this_rank

SETTLE_S = 0.3  # how long a view waits for a just-finished collective's flight recorder entry to be retired
CPU_SAMPLE_S = 0.3  # how long an answering rank in its own code samples its main thread (busy or idle)


def _main_thread_running():
    """The share of CPU_SAMPLE_S in which the main thread was running or ready to run (state R: not waiting for a
    lock, a queue, I/O or a sleep), or None (not Linux). Its state, not its CPU time: on a loaded machine a busy
    thread gets little CPU but is still ready to run."""
    samples = []
    try:
        path = f"/proc/self/task/{threading.main_thread().native_id}/stat"
        for _ in range(20):
            with open(path) as f:
                samples.append(f.read().rsplit(")", 1)[1].split()[0])
            time.sleep(CPU_SAMPLE_S / 20)
    except (OSError, IndexError, AttributeError):
        return None
    return samples.count("R") / len(samples)


def main_frame():
    return sys._current_frames().get(threading.main_thread().ident)


def _innermost(tb):
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame if tb is not None else None


def view(error=None):
    """What this rank is doing: a dict that json carries to the others."""
    me = {"rank": this_rank(), "pid": os.getpid(), "host": socket.gethostname(), "error": None}
    if recorder.running_collectives(recorder.read(only_active=True)):
        # gloo's worker thread wakes the waiting caller first and retires the entry after: under load a collective
        # that returned can still look running when the next one fails. Give those threads a moment.
        time.sleep(SETTLE_S)
    dump = recorder.read(with_stacks=True)  # the stacks say where DTensor's collectives come from
    running = recorder.running_collectives(dump)
    me["recorder"] = bool(dump and dump.get("entries"))
    me["running"] = [lines.describe_entry(entry, waited) for waited, entry in running[:3]]
    try:
        groups = recorder.group_ranks()
    except Exception:  # noqa: BLE001  a torch without these tables: the line names no group's ranks
        groups = {}

    def with_group(entry):  # its group's ranks, and a p2p op's group by its description too
        desc, entry["ranks"] = groups.get(entry.get("group_name"), (None, None))
        if entry.get("p2p") and desc:
            entry["group"] = desc
        return entry
    # A wrapper's error (a pipeline stage raises its own from the collective's): the collective's is deeper.
    cause = (lines.lost_peer(error) or error) if error is not None else None
    inner = _innermost(cause.__traceback__) if cause is not None else main_frame()
    try:
        # A point-to-point op: gloo's flight recorder has none, NCCL's names only the ranks (the note says more).
        p2p = None
        if not running or running[0][1].get("is_p2p"):
            p2p = parallel.describe_blocked(inner, failed=error is not None)
        if p2p:
            me["running"] = [p2p[1]]
        if running and not p2p:
            me["running"][0]["origin"] = parallel.origin(running[0][1], inner)
    except Exception:  # noqa: BLE001  a model or schedule unlike torch 2.13's: the line says less
        pass
    me["running"] = [with_group(entry) for entry in me["running"]]
    last = recorder.last_collective(dump) if error is not None and not me["running"] else None
    if last is not None:
        me["last"] = with_group(lines.describe_entry(last))
        try:
            me["last"]["origin"] = parallel.origin(last, inner)
        except Exception:  # noqa: BLE001  a model unlike torch 2.13's: the line says less
            pass
    frames = None
    if error is not None:
        frames = traceback.extract_tb(error.__traceback__)
        if cause is not error:  # the frames the wrapper's traceback does not reach, below where it caught the cause
            frames += traceback.extract_tb(cause.__traceback__)
        me["error"] = lines.short_error(str(cause))
        me["mismatch"] = lines.mismatch(str(cause))
    else:
        if inner is not None:
            frames = traceback.extract_stack(inner)
        if not me["running"]:  # in its own code: busy (a long phase) or idle (waiting for something)
            me["busy"] = _main_thread_running()
    me["where"], me["inner"] = lines.user_site(frames or [])
    me["model"] = lines.model_site(frames or [])
    me["phase"] = lines.phase_site(frames or [])
    me["backward"] = lines.in_backward(frames or [])
    return me
