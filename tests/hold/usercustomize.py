"""Test-only: with DDP_EXAMPLES_HOLD=MODULE:DIR[:N] in its environment (and this folder on PYTHONPATH), a worker that
torchrun started (LOCAL_RANK set: not the torchft_lighthouse, a Python program too) waits right after its
`import MODULE` until the file DIR/go exists or, with N, until N workers have come that far (each leaves
DIR/arrived-<pid>); at most 10 minutes.

So a test can start a torchft group together with the others, its imports (seconds on a busy machine) running beside
their training, and have it join at an exact point while they still train (DIR/go); or have groups started together
join together (N), whichever's imports took longer. Started late instead, a group joins after its whole start-up: a
race with the others' remaining steps (seen: 16 s of 26). Python imports `usercustomize` after the tests'
sitecustomize (tests/support) at every start; without DDP_EXAMPLES_HOLD this does nothing.
"""
import importlib.abc
import importlib.util
import os
import sys
import time


def wait(directory, count):
    open(os.path.join(directory, f"arrived-{os.getpid()}"), "w").close()
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        names = os.listdir(directory)
        if "go" in names or (count and sum(n.startswith("arrived-") for n in names) >= count):
            return
        time.sleep(0.05)


class HoldAfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, name, directory, count):
        self.name, self.directory, self.count = name, directory, count

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)  # find the real module, not ourselves
        spec = importlib.util.find_spec(name)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            wait(self.directory, self.count)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("DDP_EXAMPLES_HOLD") and "LOCAL_RANK" in os.environ:
    module, directory, *count = os.environ["DDP_EXAMPLES_HOLD"].split(":")
    sys.meta_path.insert(0, HoldAfterImport(module, directory, int(count[0]) if count else 0))
