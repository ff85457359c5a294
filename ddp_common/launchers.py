"""What the launcher told this process: which launcher started it (torchrun, mp.spawn, mpirun or none), its
place on its node, whether the job is elastic, and what happens after a failure.

torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/MASTER_PORT and TORCHELASTIC_*;
mp.spawn passes the process index as the first argument; mpirun sets its implementation's variables.
"""
import ctypes
import os
import signal

from torch.distributed.run import get_args_parser, parse_min_max_nnodes

from ddp_common.errors import UsageError

TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
# Each MPI implementation names the rank within the node, and its launch, differently.
MPI_LOCAL_RANK_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK")
MPI_LAUNCH_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE")
ELASTIC_FIX = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"

_spawn_index = None  # set by cli.rank_main in a process that mp.spawn started


def launched_by_torchrun():
    return "TORCHELASTIC_RUN_ID" in os.environ


def launched_by_mpirun():
    return any(name in os.environ for name in MPI_LAUNCH_VARIABLES)


def spawned_as(index):
    """Record that mp.spawn started this process as number `index`."""
    global _spawn_index
    _spawn_index = index


def launched():
    """Whether a launcher started this process (and will stop it with the others): torchrun, mp.spawn, mpirun."""
    return _spawn_index is not None or launched_by_torchrun() or launched_by_mpirun()


def local_rank():
    """This process's number on its node: the mp.spawn index, LOCAL_RANK under torchrun, the MPI
    implementation's variable under mpirun; 0 for a process that runs alone."""
    if _spawn_index is not None:
        return _spawn_index
    for name in ("LOCAL_RANK", *MPI_LOCAL_RANK_VARIABLES):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def job_id():
    """What the processes of one job share and another job's do not: torchrun's run id (its --rdzv_id, a fresh
    one for each --standalone run), or, under its default id "none" (torchrun --master_addr/--master_port, as
    Kubernetes' controllers launch it), the address of the job's store, which no other job can hold at the same
    time; or mpirun's job namespace; None where nothing names the job."""
    env = os.environ
    run_id = env.get("TORCHELASTIC_RUN_ID")
    if run_id == "none":
        run_id = f"none@{env.get('MASTER_ADDR', '')}:{env['MASTER_PORT']}" if "MASTER_PORT" in env else None
    return run_id or env.get("PMIX_NAMESPACE") or None


def die_with_launcher():
    """Have the kernel end this process when the process that started it dies (Linux's parent-death signal).

    torchrun, mp.spawn and mpirun stop their workers when they end normally; killed outright (SIGKILL, a crashed
    node agent) they cannot, and a worker of an elastic job would train on as an orphan, in the job, to the end.
    Whoever killed the launcher meant its workers to go. Only under a launcher: a script started from a shell
    (under nohup, say) must outlive the shell."""
    if not launched() or not hasattr(os, "getppid"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        parent = os.getppid()
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: no such call
        return
    if os.getppid() != parent:  # the launcher died before the call: nobody would send the signal
        os.kill(os.getpid(), signal.SIGKILL)


def torchrun_hint(script):
    """The UsageError for a torchrun script started without torchrun (`script`: its path)."""
    script = os.path.basename(script)
    return UsageError(f"{script} is started by torchrun, which sets RANK, LOCAL_RANK and WORLD_SIZE; run "
                      f"`torchrun --standalone --nproc_per_node=2 {script}`")


def launcher_args():
    """The arguments of the torchrun that started this process, parsed as torchrun parses them (its PET_*
    variables included); None when the parent is not torchrun. torchrun does not tell its workers whether the
    job is elastic; its command line does."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            argv = [arg.decode(errors="replace") for arg in f.read().split(b"\0")[:-1]]
    except OSError:
        return None
    # `torchrun ARGS` runs as `python .../torchrun ARGS`; `python -m torch.distributed.run ARGS` as itself.
    starts = [i + 1 for i, arg in enumerate(argv)
              if os.path.basename(arg) == "torchrun" or arg == "torch.distributed.run"]
    if not starts:
        return None
    parser = get_args_parser()

    def error(message):
        raise ValueError(message)

    parser.error = error  # argparse would print a usage block and exit
    try:
        return parser.parse_args(argv[starts[0]:])
    except (ValueError, SystemExit):
        return None


def node_range():
    """(fewest, most) nodes of this torchrun job, from torchrun's --nnodes (or PET_NNODES); None if unknown."""
    args = launcher_args()
    nnodes = args.nnodes if args is not None else os.environ.get("PET_NNODES")
    try:
        return parse_min_max_nnodes(nnodes) if nnodes else None
    except (RuntimeError, ValueError):
        return None


def check_elastic_launch(rank):
    """In an elastic torchrun job (--nnodes=MIN:MAX), stop at once with the fix where a node that joins later
    would hang the job, and warn (rank 0) where a node that leaves would end it.

    Why the first (torch 2.13): with torchrun's rendezvous store shared with the workers (its default), the
    agent that hosts rank 0 keeps the store address it made in its first round and does not post it again;
    an agent that joins later waits for that post, while the first waits for the newcomer's rank information:
    both time out after about 60 s and the job fails, with no worker running to say why.
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 makes the agents post a fresh address every round."""
    if not launched_by_torchrun():
        return
    nodes = node_range()
    if nodes is None or nodes[0] == nodes[1]:
        return
    nnodes = f"--nnodes={nodes[0]}:{nodes[1]}"
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise UsageError(f"an elastic job (torchrun {nnodes}) needs {ELASTIC_FIX} on every node: with torchrun's "
                         "shared store (its default) a node that joins later deadlocks the agents for 60 s and the "
                         f"job fails; start each node as `{ELASTIC_FIX} torchrun {nnodes} ...`")
    if rank == 0 and os.environ.get("TORCHELASTIC_MAX_RESTARTS") == "0":
        return (f"warning: an elastic job (torchrun {nnodes}) without --max_restarts: a node that leaves ends the "
                "job on the other nodes too; give torchrun --max_restarts=N (each node that leaves costs one)")
    return None


def after_lost_peers():
    """What follows when a rank lost the others: torchrun restarts the group while it has restarts left (an
    elastic job then goes on with the nodes that are left); otherwise it is the user's turn."""
    if launched_by_torchrun():
        env = os.environ
        left = int(env.get("TORCHELASTIC_MAX_RESTARTS", 0)) - int(env.get("TORCHELASTIC_RESTART_COUNT", 0))
        if left > 0:
            return f"torchrun starts the group again, which resumes from the snapshots ({left} restarts left)"
    return "check that every rank is alive and reachable, then start again (snapshots resume the run)"
