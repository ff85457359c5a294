"""Runs the script named first on the command line, with the rest as its arguments, with DCP's save thread holding
the save's arguments (the staged state, the groups) a second after its future is done: a done-callback runs in that
thread before it drops them (tests/test_fsdp.py)."""
import runpy
import sys
import threading
import time
from pathlib import Path

import torch.distributed.checkpoint._async_thread_executor as executor_module

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository: the script's own imports


class SlowToLetGo(executor_module.ThreadPoolExecutor):
    def submit(self, fn, /, *args, **kwargs):
        gate = threading.Event()  # the callback is added before the save can finish

        def gated(*a, **k):
            gate.wait()
            return fn(*a, **k)

        future = super().submit(gated, *args, **kwargs)
        future.add_done_callback(lambda _: time.sleep(1))
        gate.set()
        return future


executor_module.ThreadPoolExecutor = SlowToLetGo
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
