"""The node folder the prefix makes (names.FOLDER) and the processes of this host: what launchers and ranks
write there for each other, and what /proc says of a process."""
import os
import signal

from torchdiagnose import names


def folder():
    return os.environ.get(names.FOLDER)


def write(kind, key, text, once=False):
    """Write kind/key whole (write, then rename); with `once`, only if it is not there yet. Whether it was written.
    A folder that cannot be written costs the job nothing: the tool says less."""
    base = folder()
    if not base:
        return False
    path = os.path.join(base, kind, str(key))
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if once and os.path.exists(path):
            return False
        with open(f"{path}.{os.getpid()}.tmp", "w") as f:
            f.write(text)
        os.replace(f"{path}.{os.getpid()}.tmp", path)
    except OSError:
        return False
    return True


def read(kind, key):
    base = folder()
    try:
        with open(os.path.join(base, kind, str(key))) as f:
            return f.read()
    except (OSError, TypeError):
        return None


def records(kind):
    """{pid: text} of kind/ (the pids of processes that wrote there)."""
    base = folder()
    found = {}
    try:
        entries = os.listdir(os.path.join(base, kind))
    except (OSError, TypeError):
        return found
    for name in entries:
        if name.isdigit():
            text = read(kind, name)
            if text is not None:
                found[int(name)] = text
    return found


def claim(what):
    """Whether this process is the first of its node to say `what`."""
    base = folder()
    if not base:
        return True
    try:
        os.makedirs(os.path.join(base, names.CLAIMS), exist_ok=True)
        os.close(os.open(os.path.join(base, names.CLAIMS, what), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False
    except OSError:
        return True


def exit_of(pid):
    """The exit code a launcher of this node saw for `pid` (negative: the signal), or None."""
    try:
        return int(read(names.EXITS, pid))
    except (TypeError, ValueError):
        return None


def state(pid):
    """The state letter /proc gives `pid` (R, S, D: running or waiting; T: stopped; t: stopped by a debugger;
    Z: ended, not yet reaped), or None where it is gone or not of this host."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError, TypeError):
        return None


def alive(pid):
    return state(pid) not in (None, "Z", "X")


def stopped(pid):
    return state(pid) in ("T", "t")


def parent(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def tracer(pid):
    """The pid of the debugger attached to `pid`, or None."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("TracerPid:"):
                    return int(line.split()[1]) or None
    except (OSError, ValueError, IndexError):
        pass
    return None


def stop_signal(pid):
    """'SIGSTOP' (or another), the signal that stopped `pid` as its launcher saw it, or None."""
    try:
        return signal.Signals(int(read(names.STOPS, pid))).name
    except (TypeError, ValueError):
        return None


def describe(pid):
    """What is known of a process of this host: {"state", "exit", "stop_signal", "tracer"}."""
    found = {"state": state(pid), "exit": exit_of(pid)}
    if found["state"] == "T":
        found["stop_signal"] = stop_signal(pid)
    if found["state"] == "t":
        found["tracer"] = tracer(pid)
    return found


def started_as(rank):
    """The pid of the process of this node started as `rank` (one whose parent was not started as it too: a data
    loader's worker inherits its rank's variables), a live one first; None if none was."""
    started = records(names.STARTED)
    mine = [pid for pid, text in started.items() if text == str(rank)]
    mine = [pid for pid in mine if started.get(parent(pid)) != str(rank)] or mine
    mine.sort(key=lambda pid: (not alive(pid), pid))
    return mine[0] if mine else None


def belongs(pid):
    """Whether `pid` is a process of this job (it carries this node folder in its environment)."""
    base = folder()
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{names.FOLDER}={base}".encode() in f.read().split(b"\0")
    except OSError:
        return False


def job_processes():
    """The ranks of this node (started or registered), still alive."""
    pids = set(records(names.STARTED)) | set(records(names.RANKS))
    return sorted(pid for pid in pids if alive(pid) and belongs(pid))
