"""Runs the script named first on the command line, with the rest as its arguments; its first torch.save writes part
of the file, then the process dies by a real SIGKILL (tests/test_reliability.py)."""
import os
import runpy
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository: the script's own imports


def half_a_save(obj, f):
    f.write(b"the first half of a snapshot")
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)


torch.save = half_a_save
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
