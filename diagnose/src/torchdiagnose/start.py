"""A rank starts: its init_process_group. While it waits, this rank checks in at the rendezvous store; if it waits
longer than --timeout, or fails, that is one line. Once the default group exists, this rank registers its pid and
host in the group's store, ties its life to its launcher's, hooks the uncaught exceptions and SIGTERM, and starts
the watchdog."""
import atexit
import json
import os
import signal
import socket
import sys
import threading
from datetime import timedelta

from torchdiagnose import address as rendezvous, ask, launcher, lines, names, node, parallel, watchdog
from torchdiagnose.state import STATE, STORE_TIMEOUT_S, declare, exit_now, keep_waiting, timeout_s

CHECK_IN_S = 1.0  # the connect timeout of a check-in at the rendezvous store, tried again until the group is made


class Call:
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


class CheckIn:
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


# ---- init_process_group returned: watch this rank ----

def started(c10d):
    if not c10d.is_initialized() or STATE.store is not None:
        return
    import torch.distributed as dist
    rank = dist.get_rank()
    launcher.die_with_launcher()
    node.write(names.RANKS, os.getpid(), str(rank))
    store = c10d._get_default_store().clone()
    store.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
    store.set(names.who(rank), json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "host": socket.gethostname()}))
    STATE.store = store
    parallel.watching[0] = True
    _install_hooks()
    atexit.register(watchdog.leave)
    work_around_detail_crash()
    threading.Thread(target=watchdog.watch, name="diagnose-watchdog", daemon=True).start()


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


def _install_hooks():
    previous = sys.excepthook

    def excepthook(kind, error, tb):
        ask.uncaught(error)
        previous(kind, error, tb)

    sys.excepthook = excepthook
    previous_thread = threading.excepthook

    def thread_excepthook(hook_args):
        ask.uncaught(hook_args.exc_value)
        previous_thread(hook_args)

    threading.excepthook = thread_excepthook
    # The launcher stops the other ranks (SIGTERM) as soon as one exits, which may be while this rank is
    # asking the others: hold it off for those seconds. Only where the script left SIGTERM as it was.
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, launcher.on_sigterm)


# ---- init_process_group waits, or fails ----

def init_waits_too_long(call, check_in):
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
        declare(line + (" (--keep-waiting: it goes on waiting)" if keep_waiting() else ""))
    if not keep_waiting():
        exit_now()


def startup_failed(error, call):
    """init_process_group failed: a cause people ask about most, in one line, before torch's traceback."""
    line = lines.startup_cause(error, lambda port: lines.port_advice(port, call.init_method, os.environ))
    if line and node.claim("startup"):
        declare(line)
