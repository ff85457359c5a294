"""python -m diagnose [--timeout SECONDS] [--keep-waiting] LAUNCH COMMAND ...: see diagnose/__init__.py."""
import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import diagnose
from diagnose import address

SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "site")


def positive_seconds(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def parser():
    p = argparse.ArgumentParser(prog="python -m diagnose", description=diagnose.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--timeout", type=positive_seconds, default=300.0,
                   help="seconds a collective may wait before the ranks are asked (default 300)")
    p.add_argument("--keep-waiting", action="store_true",
                   help="print the line, then let the job go on waiting instead of ending it")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the launch command, as you would type it")
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    if not args.command:
        parser().error("no launch command given, e.g. `python -m diagnose torchrun --nproc_per_node=2 train.py`")
    if shutil.which(args.command[0]) is None:
        print(f"python -m diagnose: error: {args.command[0]}: command not found", file=sys.stderr)
        return 127
    line = address.check_command(args.command, os.environ)
    if line:  # the job could only wait out its rendezvous timeout: say it now, start nothing
        print(line, file=sys.stderr)
        return 1
    folder = tempfile.mkdtemp(prefix="diagnose-")
    env = dict(os.environ, DIAGNOSE_TIMEOUT=str(args.timeout), DIAGNOSE_DIR=folder,
               DIAGNOSE_KEEP_WAITING="1" if args.keep_waiting else "0",
               PYTHONPATH=os.pathsep.join(filter(None, [SITE, os.environ.get("PYTHONPATH")])))
    nnodes = address.elastic(args.command)
    if nnodes and os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1":
        # torch 2.13: with the agents' store shared with the workers, a node that joins later deadlocks every agent
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        print(f"diagnose: an elastic job (--nnodes={nnodes}): TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 set for it, or a "
              "node that joins later would deadlock torchrun's shared store; start every node under the tool, or set "
              "it there (docs/elastic.md)", file=sys.stderr)
    job = subprocess.Popen(args.command, env=env)

    def forward(signum, frame):
        job.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, forward)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the job through the terminal; wait for it
    try:
        code = job.wait()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
