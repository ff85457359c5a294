"""The private torch APIs this tool uses (PRIVATE_APIS), and the check, at the first init_process_group, that this
torch has them all; on a torch that lacks one, one line names it and the job runs untouched.

- torch._C._distributed_c10d._dump_fr_trace: the flight recorder's entries (torch exposes no public reader).
- ProcessGroup._get_sequence_number_for_group: a group's count of collectives issued.
- torch.distributed.distributed_c10d._get_default_store, _world.pg_names and _world.pg_group_ranks: the default
  group's store, the groups, and each group's ranks.
- Store.clone: a client of the group's store of the tool's own, with a timeout of its own.
- torch.multiprocessing.spawn._wrap: the function mp.spawn runs in each process, where an exception is caught.
"""
import importlib
import sys

import torchdiagnose
from torchdiagnose import lines, node
from torchdiagnose.state import STATE, say

PRIVATE_APIS = (
    "torch._C._distributed_c10d._dump_fr_trace",
    "torch.distributed.ProcessGroup._get_sequence_number_for_group",
    "torch.distributed.distributed_c10d._get_default_store",
    "torch.distributed.distributed_c10d._world.pg_names",
    "torch.distributed.distributed_c10d._world.pg_group_ranks",
    "torch.distributed.Store.clone",
    "torch.multiprocessing.spawn._wrap",
)


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


def check():
    """Turn the tool off in this process where this torch lacks one of PRIVATE_APIS (said once a node)."""
    missing = missing_api()
    if missing:
        STATE.off = True
        import torch
        if node.claim("api"):
            say(lines.missing_api(missing, torch.__version__, torchdiagnose.TESTED_TORCH))
