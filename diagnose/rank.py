"""What `python -m diagnose` adds to each process of a job (see diagnose/__init__.py for what it does).

Armed by the sitecustomize that the launch prefix puts on PYTHONPATH, it waits for torch.distributed to be
imported and patches three places, and nothing else:

- init_process_group: once the default group exists, this rank registers its pid and host in the group's store,
  ties its life to its launcher's (a launcher SIGKILLed takes its workers with it), and starts one daemon
  thread, the watchdog, which notices a collective that has waited longer than --timeout and answers when
  another rank asks what this one is doing. destroy_process_group (and the end of the process) stops it first.
  init_process_group that waits longer than --timeout, or fails, is one line too.
- the uncaught-exception hooks (sys.excepthook, threading.excepthook, mp.spawn's wrapper of each process): a
  collective that failed because a peer left becomes the same one line, asked of the other ranks.
- in a launcher that is a Python process (torchrun's agent, mp.spawn's parent), reaping a child: a rank's exit
  code or signal is written where the ranks of the node can read it, so that a dead rank is named with it.

The watchdog costs, every POLL_S seconds, one call per group (its count of collectives issued) and one look at
the store (a key that is there once a rank asks). Only when a count stands still does it read torch's flight
recorder (a few ms), and only for collectives still running.

Private torch APIs used (each exercised by tests/test_diagnose.py::test_the_private_torch_apis_it_uses_exist,
which names the one a torch upgrade removed):
- torch._C._distributed_c10d._dump_fr_trace: the flight recorder's entries (torch exposes no public reader).
- ProcessGroup._get_sequence_number_for_group: a group's count of collectives issued.
- torch.distributed.distributed_c10d._get_default_store and _world: the default group's store and the groups.
- torch.multiprocessing.spawn._wrap: the function mp.spawn runs in each process, where an exception is caught.
"""
import atexit
import ctypes
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

from diagnose import address as rendezvous, lines

POLL_S = 0.5  # how often the watchdog looks at the groups' counts, and whether another rank asks
LEAVE_S = 2.0  # the longest a rank that ends waits for the others to end too (see _leave)
WAIT_S = 5.0  # the longest the rank that asks waits for the others' answers
STORE_TIMEOUT_S = 5.0
LINGER_S = 2.0
EXIT_WAIT_S = 2.0
SIGTERM_GRACE_S = 1.0  # how long a rank stopped by its launcher waits for its own error to start the question
KEY = "diagnose/"
EXIT_CODE = 1

_state = {"armed": False, "round": False, "stopped": False, "exiting": False, "closing": False}
_lock = threading.Lock()  # held while the watchdog looks at the process groups
_store = None  # this rank's own client of the default group's store


def arm():
    """Called by the sitecustomize: patch torch.distributed, mp.spawn and child reaping once they are imported."""
    if _state["armed"]:
        return
    _state["armed"] = True
    _PATCHES["torch.distributed.distributed_c10d"] = _patch_c10d
    _PATCHES["torch.multiprocessing.spawn"] = _patch_spawn
    _PATCHES["multiprocessing.popen_fork"] = _patch_popen_fork
    sys.meta_path.insert(0, _AfterImport())
    _patch_subprocess()
    if "multiprocessing.popen_fork" in sys.modules:  # imported before this ran: patch it where it is
        _PATCHES.pop("multiprocessing.popen_fork")(sys.modules["multiprocessing.popen_fork"])


# ---- settings, from the launch prefix ----

def timeout_s():
    return float(os.environ.get("DIAGNOSE_TIMEOUT", "300"))


def keep_waiting():
    return os.environ.get("DIAGNOSE_KEEP_WAITING") == "1"


def node_dir():
    """The folder this node's launch prefix made: ranks' pids, and the exit codes launchers saw."""
    return os.environ.get("DIAGNOSE_DIR")


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
            execute(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


def _patch_c10d(c10d):
    init = c10d.init_process_group

    def init_process_group(*args, **kwargs):
        init_method = kwargs.get("init_method", args[1] if len(args) > 1 else None)
        if kwargs.get("store") is None:  # a name that does not resolve: torch would retry it until the timeout
            line = rendezvous.check_rank(init_method, os.environ)
            if line:
                if _claim("address"):
                    _say(line)
                _exit()
        timer = threading.Timer(timeout_s(), _init_waits_too_long, (init_method,))
        timer.daemon = True
        timer.start()
        try:
            result = init(*args, **kwargs)
        except BaseException as error:
            _startup_failed(error)
            raise
        finally:
            timer.cancel()
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
        # thread lets go) can hang or abort the process. Stop it first; it looks at groups only under _lock.
        if group is None:
            _leave()
        return destroy(group)

    destroy_process_group.__wrapped__ = destroy
    destroy_process_group.__doc__ = destroy.__doc__
    c10d.destroy_process_group = destroy_process_group


def _patch_spawn(spawn):
    wrap = spawn._wrap

    def _wrap(fn, i, args, *rest):
        return wrap(_Guarded(fn), i, args, *rest)

    # mp.spawn pickles its target by name: the name must lead to this function in the spawned process too.
    _wrap.__module__, _wrap.__qualname__ = wrap.__module__, wrap.__qualname__
    spawn._wrap = _wrap


class _Guarded:
    """mp.spawn's function, with this tool's look at an exception before mp.spawn's wrapper catches it."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        try:
            return self.fn(*args, **kwargs)
        except Exception as error:
            _uncaught(error)
            raise


def _patch_subprocess():
    """torchrun's agent starts its workers with subprocess.Popen and reaps them with poll()."""
    if not node_dir():
        return
    _write(os.path.join(node_dir(), "launchers", str(os.getpid())), "")
    import subprocess
    for name in ("poll", "wait"):
        method = getattr(subprocess.Popen, name)

        def reaping(self, *args, _method=method, **kwargs):
            result = _method(self, *args, **kwargs)
            if self.returncode is not None:
                _record_exit(self.pid, self.returncode)
            return result

        setattr(subprocess.Popen, name, reaping)


def _patch_popen_fork(module):
    """mp.spawn's parent reaps its processes through multiprocessing's Popen.poll."""
    if not node_dir():
        return
    poll = module.Popen.poll

    def reaping(self, *args, **kwargs):
        result = poll(self, *args, **kwargs)
        if result is not None:
            _record_exit(self.pid, result)
        return result

    module.Popen.poll = reaping


def _record_exit(pid, code):
    folder = node_dir()
    if folder and os.path.exists(os.path.join(folder, "ranks", str(pid))):
        path = os.path.join(folder, "exits", str(pid))
        if not os.path.exists(path):
            _write(path, str(code))


def _write(path, text):
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)
    except OSError:
        pass


def exit_of(pid):
    """The exit code a launcher of this node saw for `pid` (negative: the signal), or None."""
    folder = node_dir()
    try:
        with open(os.path.join(folder, "exits", str(pid))) as f:
            return int(f.read())
    except (OSError, TypeError, ValueError):
        return None


# ---- a rank starts ----

def _started(c10d):
    global _store
    if not c10d.is_initialized() or _store is not None:
        return
    import torch.distributed as dist
    rank = dist.get_rank()
    _die_with_launcher()
    if node_dir():
        _write(os.path.join(node_dir(), "ranks", str(os.getpid())), str(rank))
    store = c10d._get_default_store()
    _store = store.clone()
    _store.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
    _store.set(f"{KEY}who/{rank}", json.dumps({"pid": os.getpid(), "ppid": os.getppid(),
                                                "host": socket.gethostname()}))
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
    _state["stopped"] = True
    if _state["round"]:
        return
    threading.Thread(target=_die_unless_asking, name="diagnose-sigterm", daemon=True).start()


def _die_unless_asking():
    deadline = time.monotonic() + SIGTERM_GRACE_S
    while time.monotonic() < deadline:
        if _state["round"]:
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
        except Exception:  # noqa: BLE001  a group being destroyed
            counts.append(None)
    return counts


def running_collectives():
    """The collectives of this process still running, oldest first: (seconds waited, flight recorder entry)."""
    import torch
    try:
        dump = pickle.loads(torch._C._distributed_c10d._dump_fr_trace(True, False, True))
    except Exception:  # noqa: BLE001  the recorder off, or a torch without it
        return []
    now = time.time_ns()
    found = [((now - e["time_created_ns"]) / 1e9, e) for e in dump.get("entries", [])
             if not e.get("retired") and e.get("time_created_ns")]
    return sorted(found, key=lambda item: -item[0])


def last_collective():
    """The newest collective of the default group in the flight recorder, described; None without one."""
    import torch
    from torch.distributed import distributed_c10d as c10d
    try:
        dump = pickle.loads(torch._C._distributed_c10d._dump_fr_trace(True, False, False))
        name = str(c10d._get_default_group().group_name)
    except Exception:  # noqa: BLE001
        return None
    entries = [e for e in dump.get("entries", []) if str(e.get("process_group", ("",))[0]) == name]
    return lines.describe_entry(entries[-1]) if entries else None


def _watch():
    """The one thread this tool adds to a rank: every POLL_S it looks whether a collective waits too long, and
    whether another rank has asked (then it answers)."""
    import torch.distributed as dist
    limit = timeout_s()
    counts, next_look, asked = None, 0.0, False
    while not _state["round"]:
        time.sleep(POLL_S)
        with _lock:
            if _state["closing"] or not dist.is_initialized():
                return
            current = _counts()
            try:
                asked = _store.check([KEY + "round"])
            except Exception:  # noqa: BLE001  the store went (its host ended): nothing more to watch
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
        if not running:
            next_look = float("inf")  # nothing runs: this rank is in its own code until a count moves
            continue
        waited = running[0][0]
        if waited < limit:
            next_look = now + (limit - waited)
            continue
        question = _ask("timeout", waited)
        if question is not None:
            _finish(question)


def _answer_round():
    """Another rank asked: say what this one is doing (its error, if one reached the top), then go with the job."""
    if _state["round"]:
        return
    _state["round"] = True
    try:
        question = json.loads(_store.get(KEY + "round"))
        _store.set(f"{KEY}view/{_rank()}", json.dumps(view(_state.get("error"))))
    except Exception:  # noqa: BLE001  the store went with the asking rank: nothing to answer
        return
    _finish(question)


def _leave():
    """Before the default group goes (destroy_process_group, or the end of the process): stop the watchdog, say
    so in the store, and wait (at most LEAVE_S) until every rank has: the rank that hosts the store must not
    take it away while another still looks at it (TCPStore prints a C++ backtrace for each such look). Then
    let go of this tool's store client before torch tears the group down."""
    global _store
    with _lock:
        if _state["closing"] or _store is None:
            _state["closing"] = True
            return
        _state["closing"] = True
    import torch.distributed as dist
    try:
        if not _state["round"]:
            # The last to arrive posts a key that the store hands to every waiting rank at once: a rank that
            # polled instead could be reading when the store's host, done waiting, takes it away.
            if _store.add(KEY + "left", 1) >= dist.get_world_size():
                _store.set(KEY + "all left", "")
            else:
                _store.wait([KEY + "all left"], timedelta(seconds=LEAVE_S))
    except Exception:  # noqa: BLE001  the store is gone already
        pass
    _store = None


def _rank():
    import torch.distributed as dist
    return dist.get_rank()


# ---- a collective failed: an uncaught exception ----

def _uncaught(error):
    """An exception reached the top of a rank: if it is a collective that lost a peer, one line and exit."""
    import torch.distributed as dist
    if _store is None or not dist.is_initialized() or not lines.lost_peer(error):
        return
    _state["error"] = error
    if _state["round"]:
        # The watchdog asks or answers already, and ends the process: returning now would start the interpreter's
        # shutdown under it (an abort). Before it has answered, its answer gets this error, which says more.
        if not _state["exiting"]:
            try:
                _store.set(f"{KEY}view/{_rank()}", json.dumps(view(error)))
            except Exception:  # noqa: BLE001
                pass
        time.sleep(WAIT_S + 3 * STORE_TIMEOUT_S)
        return
    question = _ask("failed", None, error)
    if question is not None:
        _finish(question)


# ---- asking the others ----

def view(error=None):
    """What this rank is doing: a dict that json carries to the others."""
    me = {"rank": _rank(), "pid": os.getpid(), "host": socket.gethostname(), "error": None}
    running = running_collectives()
    me["running"] = [lines.describe_entry(entry, waited) for waited, entry in running[:3]]
    if error is not None and not running:
        me["last"] = last_collective()
    frames = None
    if error is not None:
        frames = traceback.extract_tb(error.__traceback__)
        me["error"] = lines.short_error(str(error))
        me["mismatch"] = lines.mismatch(str(error))
    else:
        main = sys._current_frames().get(threading.main_thread().ident)
        if main is not None:
            frames = traceback.extract_stack(main)
    me["where"], me["inner"] = lines.user_site(frames or [])
    me["backward"] = lines.in_backward(frames or [])
    return me


def _ask(reason, waited, error=None):
    """Post the question, or find another rank's; post this rank's view. The question, with the line the job
    prints once the asking rank has composed it (None: the store does not answer; this rank said so)."""
    _state["round"] = True
    import torch.distributed as dist
    world_size = dist.get_world_size()
    me = view(error)
    question = {"by": me["rank"], "reason": reason, "waited": waited, "timeout": timeout_s(),
                "folder": lines.dump_folder(time.time())}
    try:
        current = _store.compare_set(KEY + "round", "", json.dumps(question)).decode()
        question = json.loads(current) if current else question
        _store.set(f"{KEY}view/{me['rank']}", json.dumps(me))
    except Exception:  # noqa: BLE001  the store does not answer: its host (rank 0 or the launcher) is gone
        _say(lines.store_lost(me, reason))
        _exit()
    if question["by"] != me["rank"]:  # another rank asked first: its line is the job's
        return question
    answers = {me["rank"]: me}
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        for rank in range(world_size):
            if rank not in answers and _store.check([f"{KEY}view/{rank}"]):
                answers[rank] = json.loads(_store.get(f"{KEY}view/{rank}"))
        silent = [r for r in range(world_size) if r not in answers]
        if not silent or all(_gone(r) for r in silent):
            break
        time.sleep(0.05)
    who = {r: _who(r) for r in range(world_size) if r not in answers}
    local = {r: known for r, known in who.items() if known.get("pid") and known.get("host") == me["host"]}
    # A launcher that is a Python process of this job (torchrun's agent, mp.spawn's parent) reports a dead
    # rank's exit within its monitor interval; mpirun and srun do not.
    reported = {r: k for r, k in local.items() if _launcher_reports(k.get("ppid"))}
    deadline = time.monotonic() + EXIT_WAIT_S
    while any(exit_of(k["pid"]) is None and not _alive(k) for k in reported.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    for known in local.values():
        known["exit"], known["alive"] = exit_of(known["pid"]), _alive(known)
    line = lines.compose(question, answers, who, world_size)
    try:
        _store.compare_set(KEY + "line", "", line)
    except Exception:  # noqa: BLE001
        pass
    question["line"], question["answered"] = line, len(answers)
    return question


def _finish(question):
    """Print the job's line (one rank a host: the first to claim it), write this rank's flight recorder dump,
    and end this rank (unless --keep-waiting)."""
    _state["exiting"] = True
    line = question.get("line") or _wait_line()
    if line:
        try:
            claimed = _store.compare_set(f"{KEY}printed/{socket.gethostname()}", "", str(os.getpid())).decode()
        except Exception:  # noqa: BLE001  no store: say it here
            claimed = str(os.getpid())
        if claimed == str(os.getpid()):
            _say(line + (" (--keep-waiting: the job goes on waiting)" if keep_waiting() else ""))
    lines.write_dump(_rank(), question["folder"])
    if question.get("answered"):
        # The asking rank may host the store (rank 0 does under mp.spawn and plain launches): stay until the
        # ranks that answered have read the line, or LINGER_S.
        deadline = time.monotonic() + LINGER_S
        try:
            while _store.add(KEY + "read", 0) < question["answered"] - 1 and time.monotonic() < deadline:
                time.sleep(0.05)
        except Exception:  # noqa: BLE001
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
            if _store.check([KEY + "line"]):
                line = _store.get(KEY + "line").decode()
                _store.add(KEY + "read", 1)
                return line
        except Exception:  # noqa: BLE001  the asking rank's store went with it
            return None
        time.sleep(0.05)
    return None


def _who(rank):
    try:
        return json.loads(_store.get(f"{KEY}who/{rank}"))
    except Exception:  # noqa: BLE001
        return {}


def _alive(known):
    """Whether the process `known` describes still runs (not a zombie), on this host."""
    try:
        with open(f"/proc/{known['pid']}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, KeyError, IndexError):
        return False


def _gone(rank):
    known = _who(rank)
    return known.get("host") == socket.gethostname() and not _alive(known)


def _launcher_reports(pid):
    folder = node_dir()
    return bool(folder and pid and os.path.exists(os.path.join(folder, "launchers", str(pid))))


def _say(line):
    sys.stderr.flush()
    os.write(2, (line + "\n").encode(errors="backslashreplace"))


def _init_waits_too_long(init_method):
    """init_process_group has waited --timeout: for the rendezvous address to answer, or for the other ranks."""
    address = rendezvous.rank_endpoint(init_method, os.environ)
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=3):
            answers = True
    except (OSError, ValueError):
        answers = False
    rank, size = os.environ.get("RANK", "?"), os.environ.get("WORLD_SIZE", "?")
    if answers:
        line = (f"diagnose: init_process_group has waited {timeout_s():g}s: the store at {address} answers, but the "
                f"group of {size} ranks is not complete: a rank has not started (check WORLD_SIZE and each rank's "
                "RANK), or the ranks cannot reach the addresses they advertise to each other")
        try:
            mine = socket.gethostbyname(socket.gethostname())
        except OSError:
            mine = None
        if mine and mine.startswith("127.") and not host.strip("[]").startswith(("127.", "localhost", "::1")):
            line += (f"; this host's name resolves to {mine}, a loopback address (/etc/hosts): set GLOO_SOCKET_IFNAME "
                     "(or NCCL_SOCKET_IFNAME) to the interface that joins the nodes")
    else:
        line = (f"diagnose: init_process_group has waited {timeout_s():g}s: nothing answers at {address} (the "
                "rendezvous address: MASTER_ADDR and MASTER_PORT, or init_method): start rank 0 (or the first "
                "node) there, or give the address of the machine it runs on; a firewall can drop the connection")
    if _claim("init"):
        _say(line + (" (--keep-waiting: it goes on waiting)" if keep_waiting() else ""))
    if not keep_waiting():
        _exit()


def _claim(what):
    """Whether this process is the first of its node to say `what` (the node's folder keeps the claim)."""
    folder = node_dir()
    if not folder:
        return True
    try:
        os.close(os.open(os.path.join(folder, f"said-{what}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False
    except OSError:
        return True


def _startup_failed(error):
    """init_process_group failed: a cause people ask about most, in one line, before torch's traceback."""
    line = lines.startup_cause(error)
    if line and _claim("startup"):
        _say(line)
