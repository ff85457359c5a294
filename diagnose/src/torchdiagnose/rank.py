"""What torchdiagnose adds to each process of a job (see torchdiagnose/__init__.py for what it does).

Armed by torchdiagnose.hook (which torchdiagnose-hook.pth imports where the prefix set DIAGNOSE_TIMEOUT), it waits for
torch.distributed to be imported and patches four places, and nothing else:

- init_process_group: as it waits, this rank checks in at the rendezvous store (so that a rank that waits too
  long names the ranks that have not come); once the default group exists, this rank registers its pid and host
  in the group's store, ties its life to its launcher's (a launcher SIGKILLed takes its workers with it), and
  starts one daemon thread, the watchdog, which notices a collective that has waited longer than --timeout and
  answers when another rank asks what this one is doing. destroy_process_group (and the end of the process) stops
  it first. init_process_group that waits longer than --timeout, or fails, is one line too.
- the uncaught-exception hooks (sys.excepthook, threading.excepthook, mp.spawn's wrapper of each process): a
  collective that failed because a peer left becomes the same one line, asked of the other ranks (ask.uncaught).
- in a launcher that is a Python process (torchrun's agent, mp.spawn's parent), reaping a child: a rank's exit
  code or signal, and the signal that stopped it, are written where the ranks of the node can read them.
- isend and irecv (and through them send, recv, batch_isend_irecv and torch.distributed.pipelining): each op is
  noted, as gloo's flight recorder does not record them (torchdiagnose/parallel.py).

The tool's own frames are taken out of every traceback that passes through its wrappers (state.hide_frame): the
user's traceback reads as without the tool.

The watchdog costs, every watchdog.POLL_S seconds, one call per group (its count of collectives issued) and one look at
the store (a key that is there once a rank asks). Only when a count stands still does it read torch's flight
recorder (a few ms), and only for collectives still running, then the point-to-point op the main thread waits on.
A point-to-point op costs its note (about a microsecond).

The modules, in the order a rank meets them:
- patches.py: the patches, made as torch.distributed and mp.spawn are imported; the wrappers hand on to:
- api.py: the private torch APIs the tool uses (PRIVATE_APIS), checked at the first init_process_group.
- start.py: init_process_group (the check-in, the start-up lines), then watching the rank once the group exists.
- launcher.py: a rank and its launcher (reaping a child, dying with the launcher, its SIGTERM).
- watchdog.py: the thread that notices a collective that waits too long, or a question, and leave().
- recorder.py: the groups' counts and torch's flight recorder, read.
- view.py: what this rank is doing, its answer to the question.
- ask.py: the question, the answers, the line, and the end of the rank.
- state.py: the settings, the shared State, and saying the line.
"""
import sys

from torchdiagnose import launcher, patches
from torchdiagnose.state import STATE


def arm():
    """Called by torchdiagnose.hook: patch torch.distributed, mp.spawn and child reaping once they are imported."""
    if STATE.armed:
        return
    STATE.armed = True
    launcher.record_start()
    patches.PATCHES["torch.distributed.distributed_c10d"] = patches.patch_c10d
    patches.PATCHES["torch.multiprocessing.spawn"] = patches.patch_spawn
    patches.PATCHES["multiprocessing.popen_fork"] = launcher.patch_popen_fork
    sys.meta_path.insert(0, patches.AfterImport())
    launcher.patch_subprocess()
    if "multiprocessing.popen_fork" in sys.modules:  # imported before this ran: patch it where it is
        patches.PATCHES.pop("multiprocessing.popen_fork")(sys.modules["multiprocessing.popen_fork"])
