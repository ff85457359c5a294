"""Run example scripts' command lines, each in a process forked from this one, and print JSON
[[exit code, stdout, stderr], ...] in their order.

    python tests/support/forked_runs.py '[["nd_parallel.py", ["--cp", "3"], 2], ["plan.py", ["--tp", "3"], null]]'
    python tests/support/forked_runs.py '[["train.py", ["--data_dir", "absent"], null, {"cwd": "/tmp/a"}]]' train

`python script args` costs an `import torch` and torch.distributed's modules each (about 5 CPU-s); here they are
imported once, and each command line runs in a child forked from this process: the script run as __main__ (runpy)
with its arguments, in this process's folder, its own stdout and stderr, and its exit as Python's would be
(SystemExit's code, its message on stderr; a traceback and 1 for any other exception). With a number of processes N,
the child has the environment torchrun gives rank 0 of N (launching.rank_0_env: for the checks a script makes before
its process group, which rank 0 alone says as the whole launch would); with null, this process's. A fourth item,
optional, {"cwd": FOLDER, "env": {NAME: VALUE}}: the child runs in that folder, those variables added to rank 0's
(a MASTER_PORT each, say, for the scripts that make a process group of one). Modules named after the cases (train:
the script as a module, which imports transformers) are imported once too, before the forks."""
import importlib
import json
import os
import runpy
import sys
import tempfile
import traceback

# Imported once, before the forks: the cost this saves.
import torch.distributed.checkpoint
import torch.distributed.fsdp
import torch.distributed.pipelining
import torch.distributed.tensor.parallel  # noqa: F401

from launching import REPO, rank_0_env

sys.path.insert(0, str(REPO))  # as `python REPO/script.py` puts the script's folder first
for module in sys.argv[2:]:
    importlib.import_module(module)


def child(script, args, nproc, out, err, cwd=None, env=None):
    """In the forked process: never returns."""
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    if cwd:
        os.chdir(cwd)
    if nproc is not None:
        environment = rank_0_env(nproc, **(env or {}))
        os.environ.clear()
        os.environ.update(environment)
    sys.argv = [str(REPO / script), *args]
    code = 0
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as stop:  # as the interpreter ends: None is 0, a number is itself, anything else is said
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001  as the interpreter ends on an uncaught exception
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


results = []
for script, args, nproc, *where in json.loads(sys.argv[1]):
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            child(script, args, nproc, out, err, **(where[0] if where else {}))
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        results.append([os.waitstatus_to_exitcode(status), out.read(), err.read()])
print(json.dumps(results))
