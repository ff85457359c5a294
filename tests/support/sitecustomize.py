"""Test-only probe, loaded by every Python process the tests launch (tests/conftest.py puts this folder on
PYTHONPATH): after destroy_process_group() of the default group, gloo's worker threads must be gone.

If anything still holds the group when it is destroyed (a DDP model not yet freed, a library's default
argument), its threads live on and the group is torn down later: with the GIL held when the DDP model
goes (a hang, now and then), or during interpreter shutdown (an abort, now and then). Either happens in a
few launches out of a hundred; this check fails the run that holds the group every time. The tests fail
on the line it prints (README: clean exits).
"""
import importlib.abc
import importlib.util
import os
import sys

MARKER = "ddp-examples-probe: the process group outlived destroy_process_group"


def gloo_worker_threads():
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                count += f.read().startswith("pt_gloo_runloop")
        except OSError:  # the thread ended meanwhile
            pass
    return count


class CheckDestroyProcessGroup(importlib.abc.MetaPathFinder):
    """Wraps torch.distributed's destroy_process_group once its module has been imported."""

    def find_spec(self, name, path, target=None):
        if name != "torch.distributed.distributed_c10d":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            destroy = module.destroy_process_group

            def checked(group=None):
                destroy(group)
                left = gloo_worker_threads()
                if group is None and left:
                    print(f"{MARKER} ({left} gloo worker threads still run: something holds the group)",
                          file=sys.stderr, flush=True)

            module.destroy_process_group = checked

        spec.loader.exec_module = exec_module
        return spec


if sys.platform.startswith("linux"):
    sys.meta_path.insert(0, CheckDestroyProcessGroup())
