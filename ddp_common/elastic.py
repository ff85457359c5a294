"""Elastic torchrun jobs (--nnodes=MIN:MAX): nodes join and leave, and torchrun re-forms the group at the new
size (README: elastic training). torchrun does not tell its workers the job is elastic; its command line does.
"""
import os
import sys

from ddp_common.errors import UsageError

FIX = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"


def launcher_args():
    """The arguments of the torchrun that started this process, parsed as torchrun parses them (its PET_*
    variables included); None when the parent is not torchrun."""
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
    from torch.distributed.run import get_args_parser

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
    from torch.distributed.run import parse_min_max_nnodes

    args = launcher_args()
    nnodes = args.nnodes if args is not None else os.environ.get("PET_NNODES")
    try:
        return parse_min_max_nnodes(nnodes) if nnodes else None
    except (RuntimeError, ValueError):
        return None


def check_launch(rank):
    """In an elastic torchrun job, stop at once with the fix where a node that joins later would hang the job,
    and warn (rank 0) where a node that leaves would end it.

    Why the first (torch 2.13): with torchrun's rendezvous store shared with the workers (its default), the
    agent that hosts rank 0 keeps the store address it made in its first round and does not post it again;
    an agent that joins later waits for that post (MASTER_ADDR), while the first waits for the newcomer's
    rank information: both time out after about 60 s and the job fails, with no worker running to say why.
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 makes the agents post a fresh address every round."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    nodes = node_range()
    if nodes is None or nodes[0] == nodes[1]:
        return
    nnodes = f"--nnodes={nodes[0]}:{nodes[1]}"
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise UsageError(f"an elastic job (torchrun {nnodes}) needs {FIX} on every node: with torchrun's shared "
                         "store (its default) a node that joins later deadlocks the agents for 60 s and the job "
                         f"fails; start each node as `{FIX} torchrun {nnodes} ...`")
    if rank == 0 and os.environ.get("TORCHELASTIC_MAX_RESTARTS") == "0":
        print(f"warning: an elastic job (torchrun {nnodes}) without --max_restarts: a node that leaves ends the job "
              "on the other nodes too; give torchrun --max_restarts=N (each node that leaves costs one)",
              file=sys.stderr, flush=True)


def after_lost_peers():
    """What follows when a rank lost the others: torchrun restarts the group while it has restarts left (an
    elastic job then goes on with the nodes that are left); otherwise it is the user's turn."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        env = os.environ
        left = int(env.get("TORCHELASTIC_MAX_RESTARTS", 0)) - int(env.get("TORCHELASTIC_RESTART_COUNT", 0))
        if left > 0:
            return f"torchrun starts the group again, which resumes from the snapshots ({left} restarts left)"
    return "check that every rank is alive and reachable, then start again (snapshots resume the run)"
