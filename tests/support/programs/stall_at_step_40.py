"""Runs the script named first on the command line, with the rest as its arguments; rank 1 deadlocks after its 40th
optimizer step (in the second epoch of 32 steps): a hang for the diagnosis tool to name (tests/test_hangs.py)."""
import os
import runpy
import sys
import threading
from pathlib import Path

import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository: the script's own imports


def after_step(optimizer, args, kwargs, steps=[0]):  # noqa: B006  the count lives in the default
    steps[0] += 1
    if steps[0] == 40 and dist.get_rank() == 1:
        os.write(1, b"rank 1: stall at step 40\n")
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()  # the stall


register_optimizer_step_post_hook(after_step)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
