"""When a collective fails: which rank, which collective, and where to look next (docs/hangs.md).

A collective that a peer never joins fails on the ranks that wait once --timeout runs out (gloo: "Timed out
waiting 5000ms for recv"); a peer that died fails it at once ("Connection closed by peer"). Either way a rank
knows only its own side. explain(error), called by cli.run when a rank lost its peers, asks the others through
the group's key-value store, a side channel that still works when the collective did not:

- Each failing rank publishes what it knows: its collective's number in the sequence (the group's count of the
  collectives it issued), that collective's kind and shapes from torch's flight recorder (on by default in torch
  2.13, 2000 entries; TORCH_FR_BUFFER_SIZE=0 turns it off; without it the kind comes from the error's traceback,
  where it can), and the line that called it, from the traceback.
- It waits at most WAIT_S seconds (--timeout if shorter) for the others' entries, and composes one line: the
  collective, the ranks that did not arrive or called another collective or shape (both sides named), whether
  those that did not answer are gone (their connection closed: killed, crashed or aborted) or alive but stuck in
  their own code (the connection is open), whether this rank is the one that stopped, and where to look next.
  gloo also closes a rank's connections when a collective of its times out: a connection that closed half of
  --timeout or more into this rank's collective may be a live peer's, and is waited for as after a timeout;
  with more than 2 ranks, one closed so late next to an answering rank's timeout is that rank's doing and
  names no rank gone, and one closed early names a silent rank gone only where it is the only one silent.
- It writes this rank's flight recorder dump where torchfrtrace reads it: one folder per failure under
  fr_traces/, or TORCH_FR_DUMP_TEMP_FILE's prefix (torch's variable) followed by the rank.

Nothing here runs before a failure: the happy path pays only for torch's flight recorder (measured by
benchmarks/hang_diagnosis.py). Where the store does not answer, rank 0, which hosts it, is gone or out of reach:
the line says so instead of waiting longer.

With TORCH_DISTRIBUTED_DEBUG=DETAIL torch checks before every collective that all ranks call the same one with
the same shapes, and raises on every rank, naming both sides; mismatch_line() turns that into one line. torch
2.13's DDP crashes (SIGSEGV) in its constructor under DETAIL with gloo: its construction logging casts the gloo
backend, which DETAIL has wrapped, to the gloo class. work_around_detail_crash(), which cli.run calls, skips that
logging call, and only that one.
"""
import json
import os
import pickle
import re
import signal
import socket
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from ddp_common.errors import one_line
from diagnose import lines, rank

WAIT_S = 5.0  # the longest a failing rank waits for the others' entries
LINGER_S = 2.0  # the longest a rank that answered stays for the others that answered to finish their line
STORE_TIMEOUT_S = 3.0  # one store operation, once the collective has failed
KEY = "ddp_examples/hangs/"
DUMP_ROOT = "fr_traces"
DOCS = "docs/hangs.md"
TORCH_DIR = os.path.dirname(torch.__file__)
# torch.distributed's functions whose name is the collective's (the innermost one in a traceback says which)
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
               "all_to_all_single", "barrier", "monitored_barrier", "broadcast", "broadcast_object_list", "gather",
               "gather_object", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter", "scatter_object_list",
               "send", "recv", "isend", "irecv", "batch_isend_irecv", "all_reduce_coalesced"}
OP_NAMES = {"ALLREDUCE": "all_reduce", "ALLGATHER": "all_gather", "_ALLGATHER_BASE": "all_gather_into_tensor",
            "BROADCAST": "broadcast", "REDUCE": "reduce", "REDUCE_SCATTER": "reduce_scatter",
            "_REDUCE_SCATTER_BASE": "reduce_scatter_tensor", "BARRIER": "barrier", "GATHER": "gather",
            "SCATTER": "scatter", "ALLTOALL": "all_to_all", "ALLTOALL_BASE": "all_to_all_single",
            "SEND": "send", "RECV": "recv", "COALESCED": "coalesced collectives",
            "ALLREDUCE_COALESCED": "all_reduce_coalesced", "ALLGATHER_COALESCED": "all_gather_coalesced"}


class _Stopped(Exception):
    """The launcher stopped this process (SIGTERM) while it asked the others."""


def recognizes(error):
    """Whether `error` is a collective that failed for want of a peer, in words cli.run would not know: the
    monitored barrier of TORCH_DISTRIBUTED_DEBUG=DETAIL naming the ranks that did not arrive."""
    return "failed to pass monitoredBarrier" in str(error)


def is_mismatch(error):
    """TORCH_DISTRIBUTED_DEBUG=DETAIL found ranks calling different collectives, or other shapes."""
    return "Detected mismatch between collectives on ranks" in str(error)


# ---- what this rank knows ----

def _cause(text):
    if "monitoredBarrier" in text:
        return "barrier"
    if re.search(r"[Tt]imed out|[Tt]imeout", text):
        return "timeout"
    if re.search(r"[Cc]onnection (closed|reset)|[Bb]roken pipe|[Cc]onnection refused|EOF", text):
        return "closed"
    return "other"


def _short(text):
    """A gloo message without its source path and its boilerplate."""
    text = re.sub(r"\[[^\]]*\.(cc|cpp|h|hpp):\d+\] ", "", " ".join(text.split()))
    text = text.split(". This is typically caused")[0]
    return one_line(text, 160)


def _site(frames):
    """'file:line' of the innermost frame outside torch, from (filename, line, name) triples, innermost first."""
    for filename, line, _ in frames:
        if not os.path.abspath(filename).startswith(TORCH_DIR):
            if not filename.startswith("<"):
                relative = os.path.relpath(filename)
                filename = os.path.basename(filename) if relative.startswith("..") else relative
            return f"{filename}:{line}"
    return None


def _in_backward(frames):
    return any(name in ("backward", "_engine_run_backward") and os.path.abspath(filename).startswith(TORCH_DIR)
               for filename, _, name in frames)


def _flight_recorder(stacks=False):
    """(the recorder's dump, its entries of the default group), or (None, []) when the recorder is off. With
    `stacks`, each entry holds the Python stack that called it: what torchfrtrace shows, and slow to gather
    (1.4 s for 2000 entries here, against 0.02 s without)."""
    try:
        dump = pickle.loads(torch._C._distributed_c10d._dump_fr_trace(True, stacks, False))
    except Exception:  # noqa: BLE001  a torch without it, or one that refuses: go on without
        return None, []
    if not dump.get("entries"):
        return None, []
    name = dist.distributed_c10d._get_default_group().group_name
    return dump, [e for e in dump["entries"] if str(e.get("process_group", ("",))[0]) == name]


def _shapes(sizes):
    shapes = ["[" + ", ".join(map(str, size)) + "]" for size in sizes or []]
    return ", ".join(shapes[:3]) + (", ..." if len(shapes) > 3 else "")


def local_view(error):
    """What this rank knows of the collective that failed: a dict that json can carry to the others."""
    group = dist.distributed_c10d._get_default_group()
    seq = group._get_sequence_number_for_group()
    text = str(error)
    tb = [(f.filename, f.lineno, f.name) for f in reversed(traceback.extract_tb(error.__traceback__))]
    me = {"rank": dist.get_rank(), "seq": seq, "cause": _cause(text), "error": _short(text), "pid": os.getpid(),
          "host": socket.gethostname(), "time": time.time(), "kind": None, "shapes": None,
          "site": _site(tb), "backward": _in_backward(tb), "gap_s": None, "timeout_s": None}
    dump, entries = _flight_recorder()
    me["recorder"] = dump is not None
    by_seq = {e.get("collective_seq_id"): e for e in entries}
    entry = by_seq.get(seq)
    if entry is not None:
        me["kind"] = str(entry.get("profiling_name", "")).split(":")[-1] or None
        me["shapes"] = _shapes(entry.get("input_sizes"))
        frames = [(f.get("filename", ""), f.get("line"), f.get("name", "")) for f in entry.get("frames", [])]
        me["site"] = _site(frames) or me["site"]
        me["backward"] = _in_backward(frames) or me["backward"]
        if entry.get("timeout_ms"):
            me["timeout_s"] = entry["timeout_ms"] / 1000
        previous = by_seq.get(seq - 1)
        if previous is not None and entry.get("time_created_ns") and previous.get("time_created_ns"):
            me["gap_s"] = (entry["time_created_ns"] - previous["time_created_ns"]) / 1e9
    if me["kind"] is None:  # no flight recorder: the traceback may name the function
        names = [name for _, _, name in tb if name in COLLECTIVES]
        me["kind"] = names[0] if names else ("all_reduce" if me["backward"] else None)
    if me["timeout_s"] is None:
        waited = re.search(r"Timed out waiting (\d+)ms", text) or re.search(r"in (\d+) ms", text)
        me["timeout_s"] = int(waited[1]) / 1000 if waited else None
    # How long ago this rank's last collective (of any group) began: what tells a peer that died (early) from a
    # peer whose collective timed out (about --timeout in), when all this rank saw was a closed connection.
    newest = max((e.get("time_created_ns") or 0 for e in dump["entries"]), default=0) if dump is not None else 0
    me["waited_s"] = me["time"] - newest / 1e9 if newest else None
    barrier = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", text)
    me["absent"] = [int(r) for r in barrier[1].replace(",", " ").split()] if barrier else []
    if barrier and me["waited_s"] is not None and me["timeout_s"]:
        # DETAIL's monitored barrier says "in <timeout> ms" even when a peer's death ended it at once.
        if me["waited_s"] < 0.8 * me["timeout_s"]:
            me["cause"] = "closed"
    return me, dump


# ---- asking the others ----

def _on_sigterm(signum, frame):
    raise _Stopped()


def _peer_may_have_timed_out(me):
    """Whether the connection that closed under this rank may have been closed by a live peer. gloo closes all
    of a rank's connections when one of its collectives times out, so the peer that waited as long as this rank
    (a skipped or another collective: both wait --timeout) and gave up a moment sooner shows here as "Connection
    closed by peer", although it is alive and about to post its entry. A peer that died (killed, aborted)
    closes them at any moment, mostly long before --timeout. So: closed at least half of --timeout after this
    rank's last collective began, or when the flight recorder (off) cannot say when that was, wait for the peer
    as after a timeout (at most WAIT_S, within the --timeout + WAIT_S the line promises); earlier, it is gone."""
    if me.get("waited_s") is None or not me.get("timeout_s"):
        return True
    return me["waited_s"] >= 0.5 * me["timeout_s"]


def _shows_a_rank_gone(entries):
    """Whether the views of the ranks that answered show that some rank is gone: a connection that closed early
    (_peer_may_have_timed_out: a peer that died), or one that closed later with no answering rank whose own
    timeout could have closed it. With more than 2 ranks, one rank's timeout closes its connections to every
    other rank: a late "Connection closed by peer" next to an answering rank's "Timed out" is that rank's doing,
    and says nothing of the ranks that did not answer."""
    closed = [entry for entry in entries.values() if entry["cause"] == "closed"]
    if any(not _peer_may_have_timed_out(entry) for entry in closed):
        return True
    return bool(closed) and not any(entry["cause"] == "timeout" for entry in entries.values())


def _ask_others(store, me, world_size):
    """Publish `me`, wait for the others' entries (at most WAIT_S, or --timeout if shorter); returns (entries by
    rank, the dump folder the ranks agreed on)."""
    proposal = _new_folder(me["time"])
    folder = store.compare_set(KEY + "dumps", "", proposal).decode() or proposal
    store.append(KEY + "entries", json.dumps(me) + "\n")
    count = store.add(KEY + "count", 1)
    # A connection closed early means a peer is gone for good: it will not answer, so wait for one fewer. One
    # closed about --timeout in may be a live peer's doing (_peer_may_have_timed_out): wait for its entry.
    gone = me["cause"] == "closed" and not _peer_may_have_timed_out(me)
    enough = world_size - (1 if gone else 0) - len(me["absent"])
    deadline = time.monotonic() + min(WAIT_S, me["timeout_s"] or WAIT_S)
    while count < enough and time.monotonic() < deadline:
        time.sleep(0.05)
        count = store.add(KEY + "count", 0)
    entries = {}
    for text in store.get(KEY + "entries").decode().splitlines():
        entry = json.loads(text)
        entries[entry["rank"]] = entry
    return entries, folder


class _Unanswered(Exception):
    """A store operation that did not come back in time: the store's host is out of reach."""


def _bounded(function, seconds):
    """function() in a thread of its own, for at most `seconds`: a store whose host is out of reach (a link
    down, no reset) can block a call for longer than any timeout the store was given. Raises what the call
    raised, or _Unanswered; the launcher's SIGTERM still interrupts the wait (_Stopped)."""
    result = {}

    def call():
        try:
            result["value"] = function()
        except BaseException as error:  # noqa: BLE001  handed to the waiting thread
            result["error"] = error

    thread = threading.Thread(target=call, name="ddp-examples-hangs", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise _Unanswered()
    if "error" in result:
        raise result["error"]
    return result["value"]


def _linger(store, published):
    """Stay until the ranks that published have read the others' entries and written their dumps (or LINGER_S).
    Every rank does, not only rank 0 (which hosts the store, and must not take it away while the others read):
    under torchrun, the first rank to exit has the others stopped (SIGTERM) at once, and a rank stopped in its
    wait would say that a peer had not answered whose entry was already there (a line unlike the first rank's, seen
    in a third of the runs of hangs.py --fault skip), and leave its dump unwritten."""
    deadline = time.monotonic() + LINGER_S
    try:
        while store.add(KEY + "read", 0) < published and time.monotonic() < deadline:
            time.sleep(0.05)
    except (_Stopped, Exception):  # noqa: BLE001  stopped, or the store went: nothing more to wait for
        pass


def _new_folder(when):
    """fr_traces/<date-time>: a folder of its own for each failure, so that no dump of an earlier run mixes in."""
    return os.path.join(DUMP_ROOT, time.strftime("%Y%m%d-%H%M%S", time.localtime(when)))


def _dump_folder(folder):
    """Where this rank's dump goes: TORCH_FR_DUMP_TEMP_FILE's prefix followed by the rank, as torch names its own
    dumps, or FOLDER/rank_<rank>. (the prefix, the folder to give torchfrtrace)."""
    prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or os.path.join(folder, "rank_")
    return prefix, os.path.dirname(prefix) or "."


def _write_dump(rank, folder):
    """This rank's flight recorder dump, with the stacks, where torchfrtrace reads it (diagnose.lines.write_dump);
    whether it was written."""
    return lines.write_dump(rank, folder)


# ---- the line ----

def _collective(entry, number=True):
    """'#37 (all_reduce of [5569], DDP's gradients in backward(), at hangs.py:92)', with what is known; without
    the number, 'all_reduce of [5569], DDP's gradients in backward(), at hangs.py:92'."""
    parts = []
    if entry.get("kind"):
        parts.append(entry["kind"] + (f" of {entry['shapes']}" if entry.get("shapes") else ""))
    if entry.get("backward"):
        parts.append("DDP's gradients in backward()")
    described = ", ".join(parts)
    if entry.get("site"):
        described += (" " if described else "") + f"at {entry['site']}"
    if not number:
        return described or "a collective"
    return f"#{entry['seq']}" + (f" ({described})" if described else "")


def _timeout(entry):
    return f"--timeout {entry['timeout_s']:g}s" if entry.get("timeout_s") else "--timeout"


def _signature(entry):
    """What must be the same on every rank at a collective: its number, kind, shapes and calling line."""
    return entry["seq"], entry.get("kind"), entry.get("shapes"), entry.get("site"), entry.get("backward")


def compose(me, entries, world_size, stopped=False, store_lost=False, dumps=None):
    """The one line, from this rank's view `me` and the entries of the ranks that answered (`me` included)."""
    parts, head = [], "lost contact with the other ranks"
    if store_lost:
        head += f" at collective {_collective(me)}"
        parts.append(f"it failed ({me['error']}) and the group's store does not answer either: rank 0, which "
                     "hosts it, is gone (killed, crashed, or it gave up and exited) or out of reach (the network "
                     "between is down), so the other ranks could not be asked")
    else:
        silent = sorted(set(range(world_size)) - set(entries))
        groups = {}
        for rank, entry in sorted(entries.items()):
            groups.setdefault(_signature(entry), []).append(rank)
        first = entries[min(groups[max(groups, key=lambda s: len(groups[s]))])]
        if len(groups) == 1:
            head = f"lost contact with the other ranks at collective {_collective(first)}"
        else:
            seqs = {signature[0] for signature in groups}
            sides = "; ".join(f"{lines.ranks_text(ranks)} {_collective(entries[ranks[0]], number=len(seqs) > 1)}"
                              for _, ranks in sorted(groups.items(), key=lambda item: item[1]))
            sizes = sorted(len(ranks) for ranks in groups.values())
            odd = ""
            if len(sizes) == 2 and sizes[0] < sizes[1]:
                odd = f": {lines.ranks_text(min(groups.values(), key=len))} is the odd one out"
            if len(seqs) == 1:
                parts.append(f"the ranks called different collectives at #{first['seq']}: {sides}{odd} (a rank "
                             "skipped a collective or called another, or another shape, in its place)")
            else:
                parts.append(f"the ranks wait at different collectives: {sides}{odd} (the ranks behind skipped a "
                             "collective, or those ahead called one more)")
        if silent:
            absent = sorted(set(silent) | {r for entry in entries.values() for r in entry.get("absent", [])})
            who, what = lines.ranks_text(silent), "its" if len(silent) == 1 else "their"
            if _shows_a_rank_gone(entries) and len(silent) == 1:
                parts.append(f"{who} did not answer: gone, {what} connection closed (killed, crashed, aborted or "
                             "finished; the launcher's report says how it ended, and its own output why)")
            elif _shows_a_rank_gone(entries):
                # A closed connection shows one rank gone, not which: the others may be alive, slow to answer
                # or stopped by the launcher before they could.
                parts.append(f"{who} did not answer: at least one of them is gone, a connection closed (killed, "
                             "crashed, aborted or finished; the launcher's report says which and how it ended)"
                             + ("; the launcher stopped this rank before all had answered" if stopped else ""))
            elif stopped:
                parts.append(f"{who} had not answered when the launcher stopped this rank")
            else:
                parts.append(f"{who} did not arrive within {_timeout(me)} and did not answer either: alive ({what} "
                             f"connection is open) but stuck in {what} own code before that collective (a slow "
                             "data loader, a deadlock, a branch that only some ranks take); see where it waits with "
                             "`py-spy dump --pid PID` while it hangs, or faulthandler")
            if absent != silent:
                parts.append(f"TORCH_DISTRIBUTED_DEBUG=DETAIL's monitored barrier missed {lines.ranks_text(absent)}")
        elif len(groups) == 1:
            if not first.get("kind"):
                parts.append("every rank waited there and none arrived at the others': they called different "
                             "collectives (the flight recorder, off here, would say which: unset "
                             "TORCH_FR_BUFFER_SIZE or set it to 2000)")
            else:
                parts.append(f"every rank reached it and it still failed ({me['error']}): the link between the "
                             f"ranks failed or is too slow for {_timeout(me)}")
        if me.get("gap_s") and me.get("timeout_s") and me["gap_s"] > me["timeout_s"]:
            parts.append(f"this rank ({me['rank']}) is the one that stopped: it spent {me['gap_s']:.0f}s in its own "
                         f"code before this collective, longer than {_timeout(me)}")
        if len(groups) > 1:
            parts.append("TORCH_DISTRIBUTED_DEBUG=DETAIL reports such a mismatch at once, on every rank")
    if dumps:
        incomplete = "" if store_lost is False and len(entries) == world_size else " --allow-incomplete-ranks"
        parts.append(f"flight recorder: `torchfrtrace {dumps}{incomplete}`")
    elif not me.get("recorder"):
        parts.append("set TORCH_FR_BUFFER_SIZE=2000 (torch's default) to know each rank's collectives")
    parts.append(f"see {DOCS}")
    return head + ": " + "; ".join(parts)


def explain(error):
    """The line for a rank that lost its peers in a collective, after asking the others (see the module's
    docstring); "lost contact with the other ranks (<error>)" where no process group is there to ask about.
    The launcher may stop this rank (SIGTERM) at any moment, once another rank has exited: the line then says
    what this rank knew by then."""
    if not dist.is_initialized():
        return f"lost contact with the other ranks ({one_line(error)})"
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if _main_thread() else None
    me, line = None, None
    world_size = dist.get_world_size()
    entries, stopped, store_lost, folder = {}, False, False, None
    try:
        me, recorder = local_view(error)
        entries = {me["rank"]: me}
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
        try:
            entries, folder = _bounded(lambda: _ask_others(store, me, world_size), WAIT_S + 2 * STORE_TIMEOUT_S)
        except _Stopped:
            stopped = True
        except Exception:  # noqa: BLE001  the store does not answer: its host, rank 0, is gone or out of reach
            store_lost = me["rank"] != 0
        entries.setdefault(me["rank"], me)
        folder = _dump_folder(folder or _new_folder(me["time"]))[1] if recorder is not None else None
        line = compose(me, entries, world_size, stopped, store_lost, folder)
        if folder is not None and not _write_dump(me["rank"], folder or ""):
            line = compose(me, entries, world_size, stopped, store_lost, None)
        if not (stopped or store_lost):
            try:
                _bounded(lambda: store.add(KEY + "read", 1), STORE_TIMEOUT_S)
                _bounded(lambda: _linger(store, len(entries)), LINGER_S + STORE_TIMEOUT_S)
            except Exception:  # noqa: BLE001
                pass
        return line
    except _Stopped:
        if line is not None:
            return line
        if me is None:
            # Stopped before it even looked at its own collective (torchrun stops the others as soon as one
            # rank exits, as a rank that aborted does): what it knows alone takes milliseconds and needs no
            # peer, and the launcher waits before it kills, so finish that, with SIGTERM held off.
            try:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                me, _ = local_view(error)
            except Exception:  # noqa: BLE001
                return f"lost contact with the other ranks ({one_line(error)}); the launcher stopped this rank " \
                       f"before it could ask the others (see {DOCS})"
        return compose(me, entries or {me["rank"]: me}, world_size, stopped=True)
    except Exception:  # noqa: BLE001  a group too broken to describe: say what we have
        return line or f"lost contact with the other ranks ({one_line(error)})"
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _main_thread():
    return threading.current_thread() is threading.main_thread()


# ---- TORCH_DISTRIBUTED_DEBUG=DETAIL ----

FINGERPRINT = re.compile(r"Rank (\d+) is running collective: CollectiveFingerPrint\((.*?)\)\)")


def _fingerprint(text):
    fields = dict(re.findall(r"(SequenceNumber|OpType|TensorShape|TensorDtypes)=([^,]*(?:\[[^\]]*\])?)", text))
    op = fields.get("OpType", "?")
    return {"seq": fields.get("SequenceNumber"), "kind": OP_NAMES.get(op, op.lower()),
            "shape": fields.get("TensorShape", "?"), "dtype": fields.get("TensorDtypes", "?")}


def mismatch_line(error):
    """One line for TORCH_DISTRIBUTED_DEBUG=DETAIL's 'Detected mismatch between collectives', both sides named."""
    text = " ".join(str(error).split())
    sides = [(int(rank), _fingerprint(fields)) for rank, fields in FINGERPRINT.findall(text)]
    tb = [(f.filename, f.lineno, f.name) for f in reversed(traceback.extract_tb(error.__traceback__))]
    site = _site(tb)
    differ = re.search(r"differ in the following aspects: (.*)$", text)
    if len(sides) < 2:
        return f"the ranks called different collectives ({one_line(error)}); see {DOCS}"
    described = "; ".join(f"rank {rank} {fp['kind']} of {fp['shape']} ({fp['dtype']})" for rank, fp in sides[:2])
    aspects = differ[1].replace("vs", " vs").replace("Tensor Tensor", "tensor").strip() if differ else None
    line = (f"the ranks called different collectives at #{sides[0][1]['seq']}: {described}"
            + (f" (they differ in {aspects})" if aspects else "")
            + "; TORCH_DISTRIBUTED_DEBUG=DETAIL stopped them before any waited"
            + (f"; this rank ({sides[0][0]}) called it at {site}" if site else ""))
    if not dist.is_initialized() or _flight_recorder()[0] is None:
        return line + f"; see {DOCS}"
    # Every rank raises at once: the first to exit has the launcher stop the others, maybe while they write.
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if _main_thread() else None
    try:
        folder = _new_folder(time.time())
        try:  # one folder for all ranks, agreed in the store (still there: nobody has left yet)
            store = dist.distributed_c10d._get_default_store()
            store.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
            folder = _bounded(lambda: store.compare_set(KEY + "dumps", "", folder).decode(), STORE_TIMEOUT_S) \
                or folder
        except _Stopped:
            raise
        except Exception:  # noqa: BLE001
            pass
        if _write_dump(dist.get_rank(), folder):
            line += f"; flight recorder: `torchfrtrace {_dump_folder(folder)[1]}`"
    except _Stopped:
        pass
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return line + f"; see {DOCS}"


def work_around_detail_crash():
    """Under TORCH_DISTRIBUTED_DEBUG=DETAIL (and only then), have DDP skip its construction logging, which crashes
    torch 2.13 with gloo (see the module's docstring); the diagnosis tool does the same (diagnose/rank.py). cli.run
    calls this at start; without DETAIL it changes nothing."""
    if dist.is_available():
        rank.work_around_detail_crash()
