"""torchdiagnose [--timeout SECONDS] [--keep-waiting] LAUNCH COMMAND ...: see diagnose/__init__.py."""
import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torchdiagnose
from torchdiagnose import address, names, node

PROG = "torchdiagnose"
GRACE_S = 3.0  # after a rank declared the job failed: how long its ranks get to write their dumps and end
LAUNCHER_GRACE_S = 10.0  # then how long the launcher gets to report and end before it is stopped too


def positive_seconds(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def version():
    try:
        from importlib.metadata import version as installed
        torch = installed("torch")
    except Exception:  # noqa: BLE001  no torch here (the job's Python may be another): say so, nothing fails
        torch = "not installed in this Python"
    return (f"{PROG} {torchdiagnose.__version__} (tested with torch {', '.join(torchdiagnose.TESTED_TORCH)}; "
            f"this Python's torch: {torch})")


def parser():
    p = argparse.ArgumentParser(prog=PROG, description=torchdiagnose.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--timeout", type=positive_seconds, default=300.0,
                   help="seconds a collective may wait before the ranks are asked (default 300)")
    p.add_argument("--keep-waiting", action="store_true",
                   help="print the line, then let the job go on waiting instead of ending it")
    p.add_argument("--version", action="version", version=version())
    p.add_argument("command", nargs=argparse.REMAINDER, help="the launch command, as you would type it")
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    if not args.command:
        parser().error(f"no launch command given, e.g. `{PROG} torchrun --nproc_per_node=2 train.py`")
    if shutil.which(args.command[0]) is None:
        print(f"{PROG}: error: {args.command[0]}: command not found", file=sys.stderr)
        return 127
    line = address.check_command(args.command, os.environ)
    if line:  # the job could only wait out its rendezvous timeout: say it now, start nothing
        print(line, file=sys.stderr)
        return 1
    folder = tempfile.mkdtemp(prefix="diagnose-")
    os.environ[names.FOLDER] = folder  # node.* read it here too
    env = dict(os.environ, **{names.TIMEOUT: str(args.timeout), names.FOLDER: folder,
                              names.KEEP_WAITING: "1" if args.keep_waiting else "0",
                              names.LAUNCH_MASTER_PORT: os.environ.get("MASTER_PORT", "")})
    nnodes = address.elastic(args.command)
    if nnodes and os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1":
        # torch 2.13: with the agents' store shared with the workers, a node that joins later deadlocks every agent
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        print(f"diagnose: an elastic job (--nnodes={nnodes}): TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 set for it, or a "
              f"node that joins later would deadlock torchrun's shared store; start every node under {PROG}, or set "
              "it there", file=sys.stderr)
    # A launcher that restarts the group (torchrun --max_restarts N, an elastic --nnodes range) recovers from what a
    # rank declared: the tool says its line and leaves the job to the launcher, as --keep-waiting does.
    keep_waiting = args.keep_waiting or bool(nnodes) or max_restarts(args.command) > 0
    job = subprocess.Popen(args.command, env=env)

    def forward(signum, frame):
        job.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, forward)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the job through the terminal; wait for it
    try:
        code = watch(job, keep_waiting)
        verdict = node.read(names.VERDICT, "job")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if verdict and code != 0:
        # The launcher's report above names the first rank to exit, which is seldom the cause: say the cause last.
        sys.stdout.flush()
        print(f"{PROG}: verdict: {verdict.split(': ', 1)[-1].rstrip()}", file=sys.stderr)
    return code if code >= 0 else 128 - code


def max_restarts(command):
    """torchrun's --max_restarts (or --max-restarts) in a launch command; 0 where it has none."""
    for i, token in enumerate(command):
        for flag in ("--max_restarts", "--max-restarts"):
            value = token[len(flag) + 1:] if token.startswith(flag + "=") else (
                command[i + 1] if token == flag and i + 1 < len(command) else None)
            if value is not None:
                try:
                    return int(value)
                except ValueError:  # torchrun itself says what is wrong with it
                    return 0
    return 0


def watch(job, keep_waiting):
    """Wait for the launcher; once a rank declared the job failed (unless --keep-waiting), end it: the ranks of
    this node that still run after GRACE_S (a stopped one, one stuck in native code) are killed, so the launcher
    reports at once instead of after its own grace (torchrun's 30 s for a stopped worker, mp.spawn's never)."""
    declared = None
    while True:
        try:
            return job.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass
        if keep_waiting:
            continue
        if declared is None and node.read(names.VERDICT, "job") is not None:
            declared = time.monotonic()
        if declared is None:
            continue
        waited = time.monotonic() - declared
        if waited > GRACE_S:
            for pid in node.job_processes():
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:  # ended meanwhile
                    pass
        if waited > GRACE_S + LAUNCHER_GRACE_S:
            job.send_signal(signal.SIGTERM if waited < GRACE_S + 2 * LAUNCHER_GRACE_S else signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
