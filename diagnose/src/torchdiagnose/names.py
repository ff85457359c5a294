"""The names the processes of a job share, in one place: the variables the launch prefix sets, the files of its
node folder, and the keys this tool keeps in the process group's store."""

# ---- the environment the prefix gives every process of the job ----
TIMEOUT = "DIAGNOSE_TIMEOUT"  # --timeout; set only under the prefix: torchdiagnose-hook.pth imports the hook then
FOLDER = "DIAGNOSE_DIR"  # this node's folder (below), made by the prefix and removed when the job ends
KEEP_WAITING = "DIAGNOSE_KEEP_WAITING"  # "1": print the line, do not end the job
LAUNCH_MASTER_PORT = "DIAGNOSE_LAUNCH_MASTER_PORT"  # MASTER_PORT as the launch command had it ("" when unset)

# ---- the node folder: one small file per process, each written whole (write, then rename) ----
STARTED = "started"  # started/<pid>: the rank a process was started as (RANK and the like, mp.spawn's index)
RANKS = "ranks"  # ranks/<pid>: the rank of a process whose init_process_group returned
EXITS = "exits"  # exits/<pid>: the exit code a launcher of this node saw (negative: the signal)
STOPS = "stops"  # stops/<pid>: the signal that stopped a process, as its launcher saw it
LAUNCHERS = "launchers"  # launchers/<pid>: a Python launcher of the job (torchrun's agent, mp.spawn's parent)
VERDICT = "verdict"  # the line of the rank that declared the job failed: the prefix ends the job and repeats it
CLAIMS = "said"  # said/<what>: made by the first process of the node to say <what>, so that it is said once

# ---- the process group's store: every key under one prefix ----
PREFIX = "diagnose/"
ROUND = PREFIX + "round"  # the question: which rank asked, why (a collective waited, or failed), where dumps go
LINE = PREFIX + "line"  # the line the asking rank composed from the answers
READ = PREFIX + "read"  # a count: the ranks that have read the line (the asking rank waits for them)
LEFT = PREFIX + "left"  # a count: the ranks that left the group (destroy_process_group, or the end)
ALL_LEFT = PREFIX + "all left"  # set by the last rank to leave: the others may go


def who(rank):
    """A rank's pid, parent's pid and host, set once its init_process_group returned."""
    return f"{PREFIX}who/{rank}"


def view(rank):
    """What a rank is doing, its answer to the question."""
    return f"{PREFIX}view/{rank}"


def printed(host):
    """The pid that prints the line on `host` (the first to set it)."""
    return f"{PREFIX}printed/{host}"


def checked_in(attempt, rank):
    """Set in the rendezvous store by a rank as it enters init_process_group (per torchrun restart)."""
    return f"{PREFIX}checked-in/{attempt}/{rank}"
