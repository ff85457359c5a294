"""Run example scripts as rank 0 of a launch, one forked process a command line, and print JSON
[[exit code, stdout, stderr], ...] in their order.

    python tests/support/rank_0_runs.py '[["nd_parallel.py", ["--cp", "3"], 2], ...]'

For the checks a script makes before its process group (tests/test_parallelism.py's bad sizes): rank 0 alone says
what the whole launch would (launching.rank_0_env). `python script args` costs an `import torch` each (seconds);
here torch is imported once, and each case is a child forked from this process: the environment torchrun gives rank
0 of its processes, the script run as __main__ (runpy) with its command line, its own stdout and stderr, and its
exit as Python's would be (SystemExit's code, its message on stderr; a traceback and 1 for any other exception)."""
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


def child(script, args, nproc, out, err):
    """In the forked process: never returns."""
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    env = rank_0_env(nproc)
    os.environ.clear()
    os.environ.update(env)
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
for script, args, nproc in json.loads(sys.argv[1]):
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            child(script, args, nproc, out, err)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        results.append([os.waitstatus_to_exitcode(status), out.read(), err.read()])
print(json.dumps(results))
