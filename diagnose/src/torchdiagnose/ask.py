"""Asking the others: a rank whose collective waited too long (the watchdog), or failed because a peer left (an
uncaught exception), posts the question in the group's store; every rank posts its view; the asking rank composes
the job's line from the answers and from what this host knows of the silent ranks (gone, stopped); one rank a host
prints it, each writes its flight recorder dump, and the rank ends (unless --keep-waiting)."""
import json
import os
import socket
import time

from torchdiagnose import launcher, lines, names, node
from torchdiagnose.state import STATE, STORE_TIMEOUT_S, declare, exit_now, keep_waiting, this_rank, timeout_s
from torchdiagnose.view import view

WAIT_S = 5.0  # the longest the rank that asks waits for the others' answers
LINGER_S = 2.0  # the longest the asking rank waits for the others to read the line
EXIT_WAIT_S = 2.0  # the longest it waits for a Python launcher to note a silent rank's exit


def uncaught(error):
    """An exception reached the top of a rank: if it is a collective that lost a peer, one line and exit."""
    import torch.distributed as dist
    if STATE.store is None or not dist.is_initialized() or not lines.lost_peer(error):
        return
    STATE.error = error
    if STATE.round:
        # The watchdog asks or answers already, and ends the process: returning now would start the interpreter's
        # shutdown under it (an abort). Before it has answered, its answer gets this error, which says more.
        if not STATE.exiting:
            try:
                STATE.store.set(names.view(this_rank()), json.dumps(view(error)))
            except Exception:  # noqa: BLE001  the store went: the watchdog's answer stands, and it ends the rank
                pass
        time.sleep(WAIT_S + 3 * STORE_TIMEOUT_S)
        return
    question = ask("failed", None, error)
    if question is not None:
        finish(question)


def ask(reason, waited, error=None):
    """Post the question, or find another rank's; post this rank's view. The question, with the line the job
    prints once the asking rank has composed it (None: the store does not answer; this rank said so)."""
    STATE.round = True
    import torch.distributed as dist
    store = STATE.store
    world_size = dist.get_world_size()
    me = view(error)
    question = {"by": me["rank"], "reason": reason, "waited": waited, "timeout": timeout_s(),
                "folder": lines.dump_folder(time.time())}
    try:
        current = store.compare_set(names.ROUND, "", json.dumps(question)).decode()
        question = json.loads(current) if current else question
        store.set(names.view(me["rank"]), json.dumps(me))
    except Exception:  # noqa: BLE001  the store does not answer: its host (rank 0 or the launcher) is gone
        if node.claim(_line_claim()):  # every rank of the node finds it so: one says it
            declare(lines.store_lost(me, reason))
        exit_now()
    if question["by"] != me["rank"]:  # another rank asked first: its line is the job's
        return question
    answers = {me["rank"]: me}
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        for rank in range(world_size):
            if rank not in answers and store.check([names.view(rank)]):
                answers[rank] = json.loads(store.get(names.view(rank)))
        silent = [r for r in range(world_size) if r not in answers]
        if not silent or all(_cannot_answer(r) for r in silent):
            break
        time.sleep(0.05)
    who = {r: _who(r) for r in range(world_size) if r not in answers}
    local = {r: known for r, known in who.items() if known.get("pid") and known.get("host") == me["host"]}
    # A launcher that is a Python process of this job (torchrun's agent, mp.spawn's parent) reports a dead
    # rank's exit within its monitor interval; mpirun and srun do not.
    reported = {r: k for r, k in local.items() if launcher.launcher_reports(k.get("ppid"))}
    deadline = time.monotonic() + EXIT_WAIT_S
    while any(node.exit_of(k["pid"]) is None and not node.alive(k["pid"]) for k in reported.values()) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    for known in local.values():
        known.update(node.describe(known["pid"]), local=True)
    line = lines.compose(question, answers, who, world_size)
    try:
        store.compare_set(names.LINE, "", line)
    except Exception:  # noqa: BLE001  the store went: this rank prints the line itself all the same
        pass
    question["line"], question["answered"] = line, len(answers)
    return question


def answer():
    """Another rank asked: say what this one is doing (its error, if one reached the top), then go with the job."""
    if STATE.round:
        return
    STATE.round = True
    try:
        question = json.loads(STATE.store.get(names.ROUND))
        STATE.store.set(names.view(this_rank()), json.dumps(view(STATE.error)))
    except Exception:  # noqa: BLE001  the store went with the asking rank: nothing to answer, the launcher ends us
        return
    finish(question)


def finish(question):
    """Print the job's line (one rank a host: the first to claim it), write this rank's flight recorder dump,
    and end this rank (unless --keep-waiting)."""
    STATE.exiting = True
    store = STATE.store
    line = question.get("line") or _wait_line()
    if line:
        try:
            claimed = store.compare_set(names.printed(socket.gethostname()), "", str(os.getpid())).decode()
        except Exception:  # noqa: BLE001  no store (or too slow to answer): the node folder alone decides
            claimed = str(os.getpid())
        # The node's claim too: ranks whose store calls failed (a loaded host) would each say the line otherwise.
        if claimed == str(os.getpid()) and node.claim(_line_claim()):
            declare(line + (" (--keep-waiting: the job goes on waiting)" if keep_waiting() else ""))
    lines.write_dump(this_rank(), question["folder"])
    if question.get("answered"):
        # The asking rank may host the store (rank 0 does under mp.spawn and plain launches): stay until the
        # ranks that answered have read the line, or LINGER_S.
        deadline = time.monotonic() + LINGER_S
        try:
            while store.add(names.READ, 0) < question["answered"] - 1 and time.monotonic() < deadline:
                time.sleep(0.05)
        except Exception:  # noqa: BLE001  the others went, and the store with them: nothing to wait for
            pass
    if not keep_waiting():
        exit_now()


def _line_claim():
    """The node's claim of the job's line, one for each of torchrun's restarts (as the group's store is)."""
    return f"line-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _wait_line():
    deadline = time.monotonic() + WAIT_S + 2 * STORE_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if STATE.store.check([names.LINE]):
                line = STATE.store.get(names.LINE).decode()
                STATE.store.add(names.READ, 1)
                return line
        except Exception:  # noqa: BLE001  the asking rank's store went with it: its host printed the line
            return None
        time.sleep(0.05)
    return None


def _who(rank):
    try:
        return json.loads(STATE.store.get(names.who(rank)))
    except Exception:  # noqa: BLE001  never registered, or the store went: the line says it did not answer
        return {}


def _cannot_answer(rank):
    """A rank of this host that is gone or stopped: no use waiting for its answer."""
    known = _who(rank)
    return known.get("host") == socket.gethostname() and (not node.alive(known.get("pid"))
                                                          or node.stopped(known.get("pid")))
