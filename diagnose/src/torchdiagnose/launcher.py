"""A rank and its launcher: what each process notes of the other, and how a rank's life is tied to its launcher's.

In a launcher that is a Python process (torchrun's agent, mp.spawn's parent), reaping a child notes a rank's exit
code or signal, and the signal that stopped it, in the node folder, where the ranks of the node read them. In a
rank: the rank it was started as (a rank that never reaches init_process_group is found by it), its death with its
launcher, and the launcher's SIGTERM held off while this rank asks the others.
"""
import ctypes
import os
import signal
import threading
import time

from torchdiagnose import names, node
from torchdiagnose.state import STATE, hide_frame

SIGTERM_GRACE_S = 1.0  # how long a rank stopped by its launcher waits for its own error to start the question


def record_start():
    """The rank this process was started as, where its launcher says (torchrun, mpirun, srun): a rank that never
    reaches init_process_group can then be found by it."""
    for variable in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        if os.environ.get(variable, "").isdigit():
            node.write(names.STARTED, os.getpid(), os.environ[variable], once=True)
            return


# ---- in a launcher: reaping a child ----

def patch_subprocess():
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
                hide_frame(error)
                raise
            if self.returncode is not None:
                _record_exit(self.pid, self.returncode)
            else:
                _record_stop(self.pid)
            return result

        setattr(subprocess.Popen, name, reaping)


def patch_popen_fork(module):
    """mp.spawn's parent reaps its processes through multiprocessing's Popen.poll."""
    if not node.folder():
        return
    poll = module.Popen.poll

    def reaping(self, *args, **kwargs):
        try:
            result = poll(self, *args, **kwargs)
        except BaseException as error:
            hide_frame(error)
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


def launcher_reports(pid):
    """Whether `pid` is a launcher of this job that is a Python process (it notes its ranks' exits)."""
    return bool(node.folder() and pid and os.path.exists(os.path.join(node.folder(), names.LAUNCHERS, str(pid))))


# ---- in a rank: its launcher dies, or stops it ----

def die_with_launcher():
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


def on_sigterm(signum, frame):
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
