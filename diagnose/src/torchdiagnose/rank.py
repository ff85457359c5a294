"""What torchdiagnose adds to each process of a job (see diagnose/__init__.py for what it does).

Armed by torchdiagnose.hook (which torchdiagnose-hook.pth imports where the prefix set DIAGNOSE_TIMEOUT), it waits for
torch.distributed to be imported and patches four places, and nothing else:

- init_process_group: as it waits, this rank checks in at the rendezvous store (so that a rank that waits too
  long names the ranks that have not come); once the default group exists, this rank registers its pid and host
  in the group's store, ties its life to its launcher's (a launcher SIGKILLed takes its workers with it), and
  starts one daemon thread, the watchdog, which notices a collective that has waited longer than --timeout and
  answers when another rank asks what this one is doing. destroy_process_group (and the end of the process) stops
  it first. init_process_group that waits longer than --timeout, or fails, is one line too.
- the uncaught-exception hooks (sys.excepthook, threading.excepthook, mp.spawn's wrapper of each process): a
  collective that failed because a peer left becomes the same one line, asked of the other ranks.
- in a launcher that is a Python process (torchrun's agent, mp.spawn's parent), reaping a child: a rank's exit
  code or signal, and the signal that stopped it, are written where the ranks of the node can read them.
- isend and irecv (and through them send, recv, batch_isend_irecv and torch.distributed.pipelining): each op is
  noted, as gloo's flight recorder does not record them (torchdiagnose/parallel.py).

The tool's own frames are taken out of every traceback that passes through its wrappers (_hide_frame): the
user's traceback reads as without the tool.

The watchdog costs, every POLL_S seconds, one call per group (its count of collectives issued) and one look at
the store (a key that is there once a rank asks). Only when a count stands still does it read torch's flight
recorder (a few ms), and only for collectives still running, then the point-to-point op the main thread waits on.
A point-to-point op costs its note (about a microsecond).

Private torch APIs used (PRIVATE_APIS; on a torch that lacks one, one line names it and the job runs untouched):
- torch._C._distributed_c10d._dump_fr_trace: the flight recorder's entries (torch exposes no public reader).
- ProcessGroup._get_sequence_number_for_group: a group's count of collectives issued.
- torch.distributed.distributed_c10d._get_default_store, _world.pg_names and _world.pg_group_ranks: the default
  group's store, the groups, and each group's ranks.
- Store.clone: a client of the group's store of the tool's own, with a timeout of its own.
- torch.multiprocessing.spawn._wrap: the function mp.spawn runs in each process, where an exception is caught.
"""
import atexit
import ctypes
import importlib
import importlib.abc
import importlib.util
import json
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta

import torchdiagnose
from torchdiagnose import address as rendezvous, lines, names, node, parallel

POLL_S = 0.5  # how often the watchdog looks at the groups' counts, and whether another rank asks
LEAVE_S = 2.0  # the longest a rank that ends waits for the others to end too (see _leave)
WAIT_S = 5.0  # the longest the rank that asks waits for the others' answers
STORE_TIMEOUT_S = 5.0
LINGER_S = 2.0
EXIT_WAIT_S = 2.0
SETTLE_S = 0.3  # how long a view waits for a just-finished collective's flight recorder entry to be retired
CPU_SAMPLE_S = 0.3  # how long an answering rank in its own code samples its main thread (busy or idle)
CHECK_IN_S = 1.0  # the connect timeout of a check-in at the rendezvous store, tried again until the group is made
SIGTERM_GRACE_S = 1.0  # how long a rank stopped by its launcher waits for its own error to start the question
EXIT_CODE = 1

PRIVATE_APIS = (
    "torch._C._distributed_c10d._dump_fr_trace",
    "torch.distributed.ProcessGroup._get_sequence_number_for_group",
    "torch.distributed.distributed_c10d._get_default_store",
    "torch.distributed.distributed_c10d._world.pg_names",
    "torch.distributed.distributed_c10d._world.pg_group_ranks",
    "torch.distributed.Store.clone",
    "torch.multiprocessing.spawn._wrap",
)


class State:
    """All that this process knows of the protocol, in one object (STATE). The watchdog thread, the hooks and
    the main thread share it; `lock` is held while the watchdog looks at the process groups."""

    def __init__(self):
        self.armed = False  # the patches are in place
        self.checked = False  # the private APIs were looked for (at the first init_process_group)
        self.off = False  # one is missing: this process is not watched
        self.store = None  # this rank's own client of the default group's store; None: not watching
        self.round = False  # a question is under way: this rank asked, or answers
        self.sigterm = False  # the launcher sent SIGTERM
        self.exiting = False  # the line is being printed: the process ends
        self.closing = False  # the default group goes: the watchdog stops
        self.error = None  # the collective error that reached the top of this rank
        self.lock = threading.Lock()


STATE = State()


def arm():
    """Called by torchdiagnose.hook: patch torch.distributed, mp.spawn and child reaping once they are imported."""
    if STATE.armed:
        return
    STATE.armed = True
    _record_start()
    _PATCHES["torch.distributed.distributed_c10d"] = _patch_c10d
    _PATCHES["torch.multiprocessing.spawn"] = _patch_spawn
    _PATCHES["multiprocessing.popen_fork"] = _patch_popen_fork
    sys.meta_path.insert(0, _AfterImport())
    _patch_subprocess()
    if "multiprocessing.popen_fork" in sys.modules:  # imported before this ran: patch it where it is
        _PATCHES.pop("multiprocessing.popen_fork")(sys.modules["multiprocessing.popen_fork"])


def missing_api():
    """The first of PRIVATE_APIS that this torch lacks, or None."""
    for name in PRIVATE_APIS:
        parts = name.split(".")
        try:
            found = importlib.import_module(parts[0])
            for i in range(1, len(parts)):
                # a module where there is one (torch.multiprocessing.spawn is also the name of a function)
                found = sys.modules.get(".".join(parts[:i + 1])) or getattr(found, parts[i])
        except (ImportError, AttributeError):
            return name
    return None


# ---- settings, from the launch prefix ----

def timeout_s():
    return float(os.environ.get(names.TIMEOUT, "300"))


def keep_waiting():
    return os.environ.get(names.KEEP_WAITING) == "1"


def _hide_frame(error):
    """Take the calling wrapper's own frame out of `error`'s traceback; the wrapper then re-raises it with a bare
    `raise`, which adds no frame (Python 3.11 and later): the user's traceback goes from their line to torch's."""
    tb = error.__traceback__
    if tb is not None and tb.tb_frame is sys._getframe(1):
        error.__traceback__ = tb.tb_next


# ---- patching after import ----

_PATCHES = {}


class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _PATCHES:
            return None
        patch = _PATCHES.pop(name)
        sys.meta_path.remove(self)  # find the real module, not ourselves
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            try:
                execute(module)
            except BaseException as error:
                _hide_frame(error)
                raise
            try:
                patch(module)
            except Exception as error:  # noqa: BLE001  a torch unlike the one tested: the job must run without us
                _say(f"diagnose: not watching this process: patching {name} failed ({lines.one_line(error)})")

        spec.loader.exec_module = exec_module
        return spec


class _Call:
    """The arguments of an init_process_group call that the tool reads, wherever they were given."""
    ORDER = ("backend", "init_method", "timeout", "world_size", "rank", "store")

    def __init__(self, args, kwargs):
        given = dict(zip(self.ORDER, args))
        given.update(kwargs)
        self.init_method = given.get("init_method")
        self.store = given.get("store")
        env = os.environ
        self.world_size = _number(given.get("world_size")) or _number(env.get("WORLD_SIZE"))
        rank = _number(given.get("rank"), allow_zero=True)
        self.rank = rank if rank is not None else _number(env.get("RANK"), allow_zero=True)
        tcp = bool(self.init_method and str(self.init_method).startswith("tcp://"))
        env_method = self.init_method in (None, "env://") and env.get("MASTER_ADDR") and env.get("MASTER_PORT")
        self.endpoint = rendezvous.rank_endpoint(self.init_method, env) if self.store is None and (
            tcp or env_method) else None


def _number(value, allow_zero=False):
    try:
        number = int(value)
    except (TypeError, ValueError):
        return None
    return number if number > 0 or (allow_zero and number == 0) else None


def _patch_c10d(c10d):
    try:
        parallel.wrap(c10d)
    except Exception as error:  # noqa: BLE001  a torch unlike the one tested: collectives are still watched
        _say(f"diagnose: not watching point-to-point ops ({lines.one_line(error)})")
    init = c10d.init_process_group

    def init_process_group(*args, **kwargs):
        if not STATE.checked:
            STATE.checked = True
            _check_api()
        if STATE.off:
            try:
                return init(*args, **kwargs)
            except BaseException as error:
                _hide_frame(error)
                raise
        call = _Call(args, kwargs)
        if call.store is None:  # a name that does not resolve: torch would retry it until the timeout
            line = rendezvous.check_rank(call.init_method, os.environ)
            if line:
                if node.claim("address"):
                    _declare(line)
                _exit()
        check_in = _CheckIn(call)
        timer = threading.Timer(timeout_s(), _init_waits_too_long, (call, check_in))
        timer.daemon = True
        timer.start()
        try:
            result = init(*args, **kwargs)
        except BaseException as error:
            timer.cancel()
            check_in.stop()
            _startup_failed(error, call)
            _hide_frame(error)
            raise
        timer.cancel()
        check_in.stop()
        try:
            _started(c10d)
        except Exception as error:  # noqa: BLE001  the tool must never break the job it watches
            _say(f"diagnose: not watching this rank ({lines.one_line(error)})")
        return result

    init_process_group.__wrapped__ = init
    init_process_group.__doc__ = init.__doc__
    c10d.init_process_group = init_process_group
    destroy = c10d.destroy_process_group

    def destroy_process_group(group=None):
        # The watchdog must hold no reference to a group as it goes: a group freed late (at exit, or when a
        # thread lets go) can hang or abort the process. Stop it first; it looks at groups only under the lock.
        if group is None:
            _leave()
        try:
            return destroy(group)
        except BaseException as error:
            _hide_frame(error)
            raise

    destroy_process_group.__wrapped__ = destroy
    destroy_process_group.__doc__ = destroy.__doc__
    c10d.destroy_process_group = destroy_process_group


def _check_api():
    missing = missing_api()
    if missing:
        STATE.off = True
        import torch
        if node.claim("api"):
            _say(lines.missing_api(missing, torch.__version__, torchdiagnose.TESTED_TORCH))


def _patch_spawn(spawn):
    wrap = getattr(spawn, "_wrap", None)
    if wrap is None:  # another torch: said at init_process_group (missing_api)
        return

    def _wrap(fn, i, args, *rest):
        node.write(names.STARTED, os.getpid(), str(i), once=True)
        return wrap(_Guarded(fn), i, args, *rest)

    # mp.spawn pickles its target by name: the name must lead to this function in the spawned process too.
    _wrap.__module__, _wrap.__qualname__ = wrap.__module__, wrap.__qualname__
    spawn._wrap = _wrap
    # In the parent, each process as mp.spawn starts it: a child stopped or gone while it still imports the
    # script (before _wrap runs) is then found by its index too, and ended with the job.
    context = getattr(spawn, "ProcessContext", None)
    if context is not None:
        init = context.__init__

        def __init__(self, processes, *args, **kwargs):
            init(self, processes, *args, **kwargs)
            for i, process in enumerate(processes):
                node.write(names.STARTED, process.pid, str(i), once=True)

        context.__init__ = __init__


class _Guarded:
    """mp.spawn's function, with this tool's look at an exception before mp.spawn's wrapper catches it."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        try:
            return self.fn(*args, **kwargs)
        except Exception as error:
            _uncaught(error)
            _hide_frame(error)
            raise


def _record_start():
    """The rank this process was started as, where its launcher says (torchrun, mpirun, srun): a rank that never
    reaches init_process_group can then be found by it."""
    for variable in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        if os.environ.get(variable, "").isdigit():
            node.write(names.STARTED, os.getpid(), os.environ[variable], once=True)
            return


def _patch_subprocess():
    """torchrun's agent starts its workers with subprocess.Popen and reaps them with poll()."""
    if not node.folder():
        return
    node.write(names.LAUNCHERS, os.getpid(), "")
    import subprocess
    for name in ("poll", "wait"):
        method = getattr(subprocess.Popen, name)

        def reaping(self, *args, _method=method, **kwargs):
            try:
                result = _method(self, *args, **kwargs)
            except BaseException as error:
                _hide_frame(error)
                raise
            if self.returncode is not None:
                _record_exit(self.pid, self.returncode)
            else:
                _record_stop(self.pid)
            return result

        setattr(subprocess.Popen, name, reaping)


def _patch_popen_fork(module):
    """mp.spawn's parent reaps its processes through multiprocessing's Popen.poll."""
    if not node.folder():
        return
    poll = module.Popen.poll

    def reaping(self, *args, **kwargs):
        try:
            result = poll(self, *args, **kwargs)
        except BaseException as error:
            _hide_frame(error)
            raise
        if result is not None:
            _record_exit(self.pid, result)
        return result

    module.Popen.poll = reaping


def _is_rank(pid):
    return any(os.path.exists(os.path.join(node.folder(), kind, str(pid))) for kind in (names.RANKS, names.STARTED))


def _record_exit(pid, code):
    if _is_rank(pid):
        node.write(names.EXITS, pid, str(code), once=True)


def _record_stop(pid):
    """A launcher polls a child that still runs: if it is a rank and stopped, note the signal (waitid with
    WNOWAIT leaves the stop to be seen by whoever else waits for it)."""
    if not hasattr(os, "waitid") or not _is_rank(pid):
        return
    try:
        seen = os.waitid(os.P_PID, pid, os.WSTOPPED | os.WNOHANG | os.WNOWAIT)
    except OSError:  # not this process's child, or gone
        return
    if seen is not None and seen.si_code in (os.CLD_STOPPED, os.CLD_TRAPPED):
        node.write(names.STOPS, pid, str(seen.si_status))


# ---- a rank starts ----

class _CheckIn:
    """While init_process_group waits: this rank's mark in the rendezvous store, through a client of its own (the
    group's is not made yet), so that a rank that waits too long can name the ranks that have not come. The store
    may not be up yet (rank 0 starts it inside init_process_group): tried again until the group is made."""

    def __init__(self, call):
        self.call, self.client, self.done = call, None, threading.Event()
        self.attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.thread = None
        if call.endpoint and call.rank is not None and call.world_size:
            self.thread = threading.Thread(target=self._run, name="diagnose-check-in", daemon=True)
            self.thread.start()

    def _run(self):
        from torch.distributed import TCPStore
        host, _, port = self.call.endpoint.rpartition(":")
        while not self.done.is_set():
            try:
                client = TCPStore(host.strip("[]"), int(port), is_master=False, wait_for_workers=False,
                                  timeout=timedelta(seconds=CHECK_IN_S))
                client.set(names.checked_in(self.attempt, self.call.rank),
                           json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
                self.client = client
                return
            except Exception:  # noqa: BLE001  not up yet, or not a store: the group's own rendezvous decides
                self.done.wait(0.5)

    def missing(self):
        """The ranks that have not checked in, or None where that cannot be known."""
        client = self.client
        if client is None:
            return None
        try:
            return [r for r in range(self.call.world_size)
                    if not client.check([names.checked_in(self.attempt, r)])]
        except Exception:  # noqa: BLE001  the store went: the line says less
            return None

    def stop(self):
        """The group is made, or init_process_group failed: let go of the client (a thread still connecting is
        waited for, CHECK_IN_S at most, so that none is inside torch when the process ends)."""
        self.done.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(CHECK_IN_S + 0.5)
        self.client = None


def _started(c10d):
    if not c10d.is_initialized() or STATE.store is not None:
        return
    import torch.distributed as dist
    rank = dist.get_rank()
    _die_with_launcher()
    node.write(names.RANKS, os.getpid(), str(rank))
    store = c10d._get_default_store().clone()
    store.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
    store.set(names.who(rank), json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "host": socket.gethostname()}))
    STATE.store = store
    parallel.watching[0] = True
    _install_hooks()
    atexit.register(_leave)
    work_around_detail_crash()
    threading.Thread(target=_watch, name="diagnose-watchdog", daemon=True).start()


def work_around_detail_crash():
    """Under TORCH_DISTRIBUTED_DEBUG=DETAIL (and only then), DDP's construction logging casts the gloo backend,
    which DETAIL wraps, to the gloo class, and torch 2.13 crashes (SIGSEGV): have DDP skip that one call."""
    import torch.distributed as dist
    if os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() != "DETAIL" or getattr(dist.Logger, "_skips", False):
        return

    class Logger(dist.Logger):
        _skips = True

        def set_construction_data_and_log(self, *args, **kwargs):
            pass

    dist.Logger = Logger


def _die_with_launcher():
    """The kernel ends this process when its parent (the launcher) dies: a worker of an OOM-killed torchrun agent
    would otherwise hold its GPU and its peers. Linux only; elsewhere nothing happens."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        parent = os.getppid()
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the launcher died before the call: nobody would send the signal
        os.kill(os.getpid(), signal.SIGKILL)


def _install_hooks():
    previous = sys.excepthook

    def excepthook(kind, error, tb):
        _uncaught(error)
        previous(kind, error, tb)

    sys.excepthook = excepthook
    previous_thread = threading.excepthook

    def thread_excepthook(hook_args):
        _uncaught(hook_args.exc_value)
        previous_thread(hook_args)

    threading.excepthook = thread_excepthook
    # The launcher stops the other ranks (SIGTERM) as soon as one exits, which may be while this rank is
    # asking the others: hold it off for those seconds. Only where the script left SIGTERM as it was.
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum, frame):
    """The launcher stops this rank. When a peer died, that comes at the same moment as this rank's own error,
    often first (mpirun, mp.spawn): give the error SIGTERM_GRACE_S to start the question, then go as SIGTERM
    would have it."""
    STATE.sigterm = True
    if STATE.round:
        return
    threading.Thread(target=_die_unless_asking, name="diagnose-sigterm", daemon=True).start()


def _die_unless_asking():
    deadline = time.monotonic() + SIGTERM_GRACE_S
    while time.monotonic() < deadline:
        if STATE.round:
            return
        time.sleep(0.02)
    try:  # die of SIGTERM, as without this tool (the launcher's report then says so): reset it in C, resend
        ctypes.CDLL(None).signal(signal.SIGTERM, ctypes.c_void_p(0))
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)
    finally:
        os._exit(128 + signal.SIGTERM)


# ---- the watchdog: a collective that waits too long ----

def _groups():
    from torch.distributed import distributed_c10d as c10d
    return list(c10d._world.pg_names)


def _counts():
    counts = []
    for group in _groups():
        try:
            counts.append(group._get_sequence_number_for_group())
        except Exception:  # noqa: BLE001  a group being destroyed: counted as unknown, the others still watched
            counts.append(None)
    return counts


def _recorder(with_stacks=False, only_active=False):
    """torch's flight recorder, read (a dict with 'entries'); None where it is off or this torch has none."""
    import torch
    try:
        return pickle.loads(torch._C._distributed_c10d._dump_fr_trace(True, with_stacks, only_active))
    except Exception:  # noqa: BLE001  the recorder off, or unreadable: the line says less, the job goes on
        return None


def _group_ranks():
    """{group name: (its description, its global ranks, sorted)}, for this process's live groups: the line names a
    DeviceMesh's group by its dimension ("mesh_tp") and ranks (gloo's flight recorder keeps neither)."""
    from torch.distributed import distributed_c10d as c10d
    world = c10d._world
    return {str(name): (getattr(group, "group_desc", "") or "", sorted(world.pg_group_ranks.get(group) or ()))
            for group, name in list(world.pg_names.items())}


def running_collectives(dump=None):
    """The collectives of this process still running, oldest first: (seconds waited, flight recorder entry)."""
    dump = dump if dump is not None else _recorder(only_active=True)
    now = time.time_ns()
    found = [((now - e["time_created_ns"]) / 1e9, e) for e in (dump or {}).get("entries", [])
             if not e.get("retired") and e.get("time_created_ns")]
    return sorted(found, key=lambda item: -item[0])


def last_collective(dump):
    """The newest collective in the flight recorder, of any group (its entry): where a rank's error came from, its
    last collective (a DeviceMesh's, or the default group's); None without one."""
    entries = [e for e in (dump or {}).get("entries", []) if e.get("time_created_ns")]
    return max(entries, key=lambda e: e["time_created_ns"]) if entries else None


def _watch():
    """The one thread this tool adds to a rank: every POLL_S it looks whether a collective waits too long, and
    whether another rank has asked (then it answers)."""
    import torch.distributed as dist
    limit = timeout_s()
    counts, next_look, asked = None, 0.0, False
    while not STATE.round:
        time.sleep(POLL_S)
        with STATE.lock:
            if STATE.closing or not dist.is_initialized():
                return
            current = _counts()
            try:
                asked = STATE.store.check([names.ROUND])
            except Exception:  # noqa: BLE001  the store went (its host ended): nothing more to watch, the job goes on
                return
        if asked:
            return _answer_round()
        now = time.monotonic()
        if current != counts:  # collectives complete: nothing to look at
            counts, next_look = current, now + min(limit, 2.0)
            continue
        if now < next_look:
            continue
        running = running_collectives()
        if not running:  # no collective: a point-to-point op (not in gloo's flight recorder) the rank waits on?
            blocked = parallel.blocked(_main_frame())
            if blocked is None:
                # nothing runs: this rank is in its own code until a count moves (or until a p2p op it issued
                # and has not waited on yet holds it)
                next_look = now + min(limit, 2.0) if parallel.pending() else float("inf")
                continue
            running = [blocked]
        waited = running[0][0]
        if waited < limit:
            next_look = now + (limit - waited)
            continue
        question = _ask("timeout", waited)
        if question is not None:
            _finish(question)


def _answer_round():
    """Another rank asked: say what this one is doing (its error, if one reached the top), then go with the job."""
    if STATE.round:
        return
    STATE.round = True
    try:
        question = json.loads(STATE.store.get(names.ROUND))
        STATE.store.set(names.view(_rank()), json.dumps(view(STATE.error)))
    except Exception:  # noqa: BLE001  the store went with the asking rank: nothing to answer, the launcher ends us
        return
    _finish(question)


def _leave():
    """Before the default group goes (destroy_process_group, or the end of the process): stop the watchdog, say
    so in the store, and wait (at most LEAVE_S) until every rank has: the rank that hosts the store must not
    take it away while another still looks at it (TCPStore prints a C++ backtrace for each such look). Then
    let go of this tool's store client before torch tears the group down."""
    parallel.stop()
    with STATE.lock:
        if STATE.closing or STATE.store is None:
            STATE.closing = True
            return
        STATE.closing = True
    import torch.distributed as dist
    try:
        if not STATE.round:
            # The last to arrive posts a key that the store hands to every waiting rank at once: a rank that
            # polled instead could be reading when the store's host, done waiting, takes it away.
            if STATE.store.add(names.LEFT, 1) >= dist.get_world_size():
                STATE.store.set(names.ALL_LEFT, "")
            else:
                STATE.store.wait([names.ALL_LEFT], timedelta(seconds=LEAVE_S))
    except Exception:  # noqa: BLE001  the store is gone already, or the others took too long: leave all the same
        pass
    STATE.store = None


def _rank():
    import torch.distributed as dist
    return dist.get_rank()


# ---- a collective failed: an uncaught exception ----

def _uncaught(error):
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
                STATE.store.set(names.view(_rank()), json.dumps(view(error)))
            except Exception:  # noqa: BLE001  the store went: the watchdog's answer stands, and it ends the rank
                pass
        time.sleep(WAIT_S + 3 * STORE_TIMEOUT_S)
        return
    question = _ask("failed", None, error)
    if question is not None:
        _finish(question)


# ---- asking the others ----

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


def _main_frame():
    return sys._current_frames().get(threading.main_thread().ident)


def _innermost(tb):
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame if tb is not None else None


def view(error=None):
    """What this rank is doing: a dict that json carries to the others."""
    me = {"rank": _rank(), "pid": os.getpid(), "host": socket.gethostname(), "error": None}
    if running_collectives(_recorder(only_active=True)):
        # gloo's worker thread wakes the waiting caller first and retires the entry after: under load a collective
        # that returned can still look running when the next one fails. Give those threads a moment.
        time.sleep(SETTLE_S)
    dump = _recorder(with_stacks=True)  # the stacks say where DTensor's collectives come from
    running = running_collectives(dump)
    me["recorder"] = bool(dump and dump.get("entries"))
    me["running"] = [lines.describe_entry(entry, waited) for waited, entry in running[:3]]
    try:
        groups = _group_ranks()
    except Exception:  # noqa: BLE001  a torch without these tables: the line names no group's ranks
        groups = {}

    def with_group(entry):  # its group's ranks, and a p2p op's group by its description too
        desc, entry["ranks"] = groups.get(entry.get("group_name"), (None, None))
        if entry.get("p2p") and desc:
            entry["group"] = desc
        return entry
    # A wrapper's error (a pipeline stage raises its own from the collective's): the collective's is deeper.
    cause = (lines.lost_peer(error) or error) if error is not None else None
    inner = _innermost(cause.__traceback__) if cause is not None else _main_frame()
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
    last = last_collective(dump) if error is not None and not me["running"] else None
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


def _ask(reason, waited, error=None):
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
        _declare(lines.store_lost(me, reason))
        _exit()
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
    reported = {r: k for r, k in local.items() if _launcher_reports(k.get("ppid"))}
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


def _finish(question):
    """Print the job's line (one rank a host: the first to claim it), write this rank's flight recorder dump,
    and end this rank (unless --keep-waiting)."""
    STATE.exiting = True
    store = STATE.store
    line = question.get("line") or _wait_line()
    if line:
        try:
            claimed = store.compare_set(names.printed(socket.gethostname()), "", str(os.getpid())).decode()
        except Exception:  # noqa: BLE001  no store: say it here, whoever else does
            claimed = str(os.getpid())
        if claimed == str(os.getpid()):
            _declare(line + (" (--keep-waiting: the job goes on waiting)" if keep_waiting() else ""))
    lines.write_dump(_rank(), question["folder"])
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
        _exit()


def _exit():
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_CODE)


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


def _launcher_reports(pid):
    return bool(node.folder() and pid and os.path.exists(os.path.join(node.folder(), names.LAUNCHERS, str(pid))))


def _say(line):
    sys.stderr.flush()
    os.write(2, (line + "\n").encode(errors="backslashreplace"))


def _declare(line):
    """Say the line that declares the job failed, and leave it for the prefix, which ends the job and says it
    again as the last line of the job's output."""
    node.write(names.VERDICT, "job", line, once=True)
    _say(line)


# ---- init_process_group waits, or fails ----

def _init_waits_too_long(call, check_in):
    """init_process_group has waited --timeout: for the rendezvous address to answer, or for the other ranks."""
    address = call.endpoint or rendezvous.rank_endpoint(call.init_method, os.environ)
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=3):
            answers = True
    except (OSError, ValueError):
        answers = False
    if answers:
        missing = check_in.missing()
        known = None
        if missing:
            known = {}
            for rank in missing:
                pid = node.started_as(rank)
                known[rank] = dict(node.describe(pid), pid=pid, host=socket.gethostname(), local=True) if pid \
                    else None
        line = lines.init_incomplete(timeout_s(), address, call.world_size, known)
        try:
            mine = socket.gethostbyname(socket.gethostname())
        except OSError:
            mine = None
        if mine and mine.startswith("127.") and not host.strip("[]").startswith(("127.", "localhost", "::1")):
            line += (f"; this host's name resolves to {mine}, a loopback address (/etc/hosts): set GLOO_SOCKET_IFNAME "
                     "(or NCCL_SOCKET_IFNAME) to the interface that joins the nodes")
    else:
        pid = node.started_as(0)  # rank 0 opens the store: a process of this host, stopped or gone?
        line = lines.init_unanswered(timeout_s(), address, dict(node.describe(pid), pid=pid, host=socket.gethostname(),
                                                                local=True) if pid else None)
    if node.claim("init"):
        _declare(line + (" (--keep-waiting: it goes on waiting)" if keep_waiting() else ""))
    if not keep_waiting():
        _exit()


def _startup_failed(error, call):
    """init_process_group failed: a cause people ask about most, in one line, before torch's traceback."""
    line = lines.startup_cause(error, lambda port: lines.port_advice(port, call.init_method, os.environ))
    if line and node.claim("startup"):
        _declare(line)
