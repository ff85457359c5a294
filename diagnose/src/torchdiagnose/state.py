"""What the modules of a watched rank share: the settings from the launch prefix, the one State object, and the
few things every part does (say a line, declare the job failed, end the process, hide its own frame)."""
import os
import sys
import threading

from torchdiagnose import names, node

STORE_TIMEOUT_S = 5.0  # the timeout of this tool's own client of the group's store
EXIT_CODE = 1


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


# ---- settings, from the launch prefix ----

def timeout_s():
    return float(os.environ.get(names.TIMEOUT, "300"))


def keep_waiting():
    return os.environ.get(names.KEEP_WAITING) == "1"


def this_rank():
    import torch.distributed as dist
    return dist.get_rank()


# ---- what every part does ----

def hide_frame(error):
    """Take the calling wrapper's own frame out of `error`'s traceback; the wrapper then re-raises it with a bare
    `raise`, which adds no frame (Python 3.11 and later): the user's traceback goes from their line to torch's."""
    tb = error.__traceback__
    if tb is not None and tb.tb_frame is sys._getframe(1):
        error.__traceback__ = tb.tb_next


def say(line):
    sys.stderr.flush()
    os.write(2, (line + "\n").encode(errors="backslashreplace"))


def declare(line):
    """Say the line that declares the job failed, and leave it for the prefix, which ends the job and says it
    again as the last line of the job's output."""
    node.write(names.VERDICT, "job", line, once=True)
    say(line)


def exit_now():
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_CODE)
