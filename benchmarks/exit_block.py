"""Which `if __name__ == "__main__":` exit keeps a rank whose peer died mid-collective from aborting.

    python benchmarks/exit_block.py                     # 30 runs of each form, 2 CPU-loading processes beside
    python benchmarks/exit_block.py --forms bare block --runs 5 --out out

Each run starts 2 ranks, forked from a process that imported torch once (env://, as run_with_python.py
does; no launcher stops the survivor; each rank's group, threads and exit are its own). They train a DDP
model of several gradient buckets, so gloo's threads all-reduce while the backward pass goes on. Once both
train, the harness SIGKILLs one (rank 1 in even runs, rank 0, the store's host, in odd ones) after a random
0 to 0.5 s, while --load processes spin on the cores. The survivor's collective fails (`Connection reset by
peer`); the form under test decides how it leaves. A run is clean if
the survivor exits 1 within --run_timeout seconds of the kill and prints none of `terminate called`, `SIGABRT`,
`Segmentation fault`; aborted if it dies by a signal or prints one of them; hung if it is still running.
Forms (the survivor's way out; `import torch.distributed.nn` at the top unless named):
- bare: `main()` alone: Python prints the traceback and exits as usual;
- block: the exit block of the examples (multigpu_torchrun.py): the message, then os._exit(1);
- short: the same, its message and traceback in one expression statement;
- destroy: `dist.destroy_process_group()` in a `finally:`, then Python's own exit;
- noimport: block, without `import torch.distributed.nn`.
- stop_bare, stop_short: no kill: at step 3 rank 0 starts a 16 MiB all-reduce and raises at once, while rank 1
  computes 3 s before its part (a check said no while gloo's threads wait for a live peer); the forms as above;
- finish, finish_noimport: no kill; both ranks train 3 steps and finish (`del model`,
  `destroy_process_group()`, exit 0): whether the import still matters for a run that ends well.
"""
import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks import report  # noqa: E402
from benchmarks.launches import ABORT_MARKERS, clean_env  # noqa: E402

FORMS = ("bare", "block", "short", "destroy", "noimport", "finish", "finish_noimport", "stop_bare", "stop_short")

WORKER_HEAD = '''
import os, sys, time
from datetime import timedelta
import torch
import torch.distributed as dist
{import_nn}
from torch.nn.parallel import DistributedDataParallel as DDP


def main(steps, stop=False):
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    torch.manual_seed(0)
    layers = [torch.nn.Linear(512, 512) for _ in range(12)]  # 12 MiB of gradients: several buckets
    model = DDP(torch.nn.Sequential(*layers), bucket_cap_mb=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, 512)
    print("training", flush=True)
    step = 0
    while steps is None or step < steps:
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
        step += 1
        if stop and step == 3:  # rank 0 stops while its all-reduce waits in gloo's threads for a live peer
            if dist.get_rank() == 0:
                dist.all_reduce(torch.ones(1 << 22), async_op=True)
                raise RuntimeError("a check said no while a collective was in flight")
            time.sleep(3)  # the peer computes; its part of that all-reduce comes later
            dist.all_reduce(torch.ones(1 << 22))
    print("finished", flush=True)
    del model, optimizer
    dist.destroy_process_group()

'''

BLOCK = '''
if __name__ == "__main__":
    try:
        main(STEPS)
    except (Exception, SystemExit) as error:
        if not dist.is_initialized():  # no process group: Python's own exit is safe
            raise
        # The group lives on: Python's exit can stall or abort in gloo's threads. Say why as Python would; leave now.
        if isinstance(error, SystemExit):  # sys.exit("error: ...")
            print(error.code, file=sys.stderr)
        else:  # the traceback, through any hook a tool installed
            sys.excepthook(*sys.exc_info())
        sys.stdout.flush()
        os._exit(1)
'''

SHORT = '''
if __name__ == "__main__":
    try:
        main(STEPS)
    except (Exception, SystemExit) as error:
        if not dist.is_initialized():  # no process group: Python's own exit is safe
            raise
        # The group lives on: Python's own exit could abort on gloo's threads. Say why as Python would; leave now.
        print(error.code, file=sys.stderr) if isinstance(error, SystemExit) else sys.excepthook(*sys.exc_info())
        sys.stdout.flush()
        os._exit(1)
'''

TAILS = {
    "bare": '\nif __name__ == "__main__":\n    main(STEPS)\n',
    "block": BLOCK,
    "short": SHORT,
    "destroy": ('\nif __name__ == "__main__":\n    try:\n        main(STEPS)\n    finally:\n'
                '        if dist.is_initialized():\n            dist.destroy_process_group()\n'),
    "noimport": BLOCK,
    "finish": BLOCK,
    "finish_noimport": BLOCK,
    "stop_bare": '\nif __name__ == "__main__":\n    main(STEPS)\n',
    "stop_short": SHORT,
}


def worker_text(form):
    import_nn = "" if form.endswith("noimport") else "import torch.distributed.nn  # noqa: F401"
    steps = "3" if form.startswith("finish") else "None, stop=True" if form.startswith("stop") else "None"
    return WORKER_HEAD.format(import_nn=import_nn) + TAILS[form].replace("STEPS", steps)


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait(pid, deadline):
    """The exit code of a forked rank (negative: the signal), or None if it still runs at `deadline`."""
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            return None
        time.sleep(0.02)


def one_run(code, form, victim, timeout, folder):
    """{"end": "clean" | "aborted" | "hung" | "failed", ...} of the rank that stays (both ranks for finish)."""
    port, finishing, stopping = free_port(), form.startswith("finish"), form.startswith("stop")
    victim = 1 if stopping else victim  # rank 0 stops by itself; rank 1 is killed once it has
    logs = [os.path.join(folder, f"rank{rank}.log") for rank in (0, 1)]
    pids = []
    sys.stdout.flush()
    sys.stderr.flush()
    for rank in (0, 1):
        pid = os.fork()
        if pid == 0:  # the rank: torch is imported already; its group, its threads and its exit are its own
            fd = os.open(logs[rank], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            exec(code, {"__name__": "__main__"})
            sys.exit(0)  # main() returned: Python's own exit, as the script's would be
        pids.append(pid)
    started = time.monotonic()
    deadline = started + 3 * timeout  # to start, train and leave: a loaded machine starts slowly
    killed = None
    if not finishing and not stopping:
        while time.monotonic() < deadline:
            if all(os.path.exists(log) and "training" in Path(log).read_text() for log in logs):
                time.sleep(random.uniform(0, 0.5))  # mid-step: forward, backward or a bucket's all-reduce
                os.kill(pids[victim], signal.SIGKILL)
                killed = time.monotonic()
                deadline = killed + timeout  # from the kill: a hang is the survivor's, not the start's
                break
            time.sleep(0.02)
    watched = [i for i in (0, 1) if finishing or i != victim]
    codes = [wait(pids[i], deadline) for i in watched]
    exit_s = round(time.monotonic() - killed, 2) if killed and None not in codes else None  # the kill to the exit
    for i, pid in enumerate(pids):  # a hung rank, or the SIGKILLed one still to reap
        if (i not in watched or codes[watched.index(i)] is None) and wait(pid, 0) is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    output = "".join(Path(logs[i]).read_text() for i in watched if os.path.exists(logs[i]))
    markers = [m for m in ABORT_MARKERS if m in output]
    if not finishing and not stopping and killed is None:
        end = "failed"  # never trained: nothing to kill
    elif None in codes:
        end = "hung"
    elif markers or any(c < 0 for c in codes):
        end = "aborted"
    else:
        end = "clean" if all(c == (0 if finishing else 1) for c in codes) else "failed"
    return {"end": end, "exit_codes": codes, "markers": markers, "victim": None if finishing else victim,
            "exit_s": exit_s, "seconds": round(time.monotonic() - started, 2),
            "tail": output.splitlines()[-4:] if end != "clean" else []}


def serve(form, runs, timeout, out):
    """Runs of one form, each rank forked from this process: torch is imported once, not 60 times."""
    import torch.distributed
    import torch.nn.parallel
    if not form.endswith("noimport"):
        import torch._dynamo  # noqa: F401  DDP imports it lazily, and torch.distributed.nn with it
    code = compile(worker_text(form), f"{form}.py", "exec")
    folder = tempfile.mkdtemp()
    results = [one_run(code, form, i % 2 ^ 1, timeout, folder) for i in range(runs)]
    shutil.rmtree(folder)
    Path(out).write_text(json.dumps(results))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--forms", nargs="+", choices=FORMS, default=list(FORMS), help="default: all")
    parser.add_argument("--runs", type=int, default=30, help="runs of each form (default 30)")
    parser.add_argument("--load", type=int, default=2, help="processes that spin on the cores meanwhile (default 2)")
    parser.add_argument("--run_timeout", type=float, default=60, help="seconds before a run counts as hung")
    parser.add_argument("--out", type=Path, default=report.DEFAULT_OUT, help="folder for the JSON")
    parser.add_argument("--serve", choices=FORMS, help=argparse.SUPPRESS)  # one form's runs, forked from here
    args = parser.parse_args()
    if args.serve:
        return serve(args.serve, args.runs, args.run_timeout, args.out)
    if args.runs < 1 or args.load < 0 or args.run_timeout <= 0:
        parser.error("--runs and --run_timeout must be positive, --load not negative")
    machine = report.machine()
    print(report.machine_line(machine), flush=True)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    results = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for form in args.forms:
                out = Path(tmp, f"{form}.json")
                subprocess.run([sys.executable, __file__, "--serve", form, "--runs", str(args.runs), "--run_timeout",
                                str(args.run_timeout), "--out", str(out)], env=clean_env(OMP_NUM_THREADS=1),
                               check=True)
                runs = json.loads(out.read_text())
                counts = {end: sum(r["end"] == end for r in runs) for end in ("clean", "aborted", "hung", "failed")}
                median = sorted(r["seconds"] for r in runs)[len(runs) // 2]
                exits = sorted(r["exit_s"] for r in runs if r["exit_s"] is not None)
                exit_median = exits[len(exits) // 2] if exits else None
                results[form] = {"runs": args.runs, **counts, "median_s": median, "exit_median_s": exit_median,
                                 "not_clean": [r for r in runs if r["end"] != "clean"]}
                print(f"{form:15} | {args.runs} runs | {counts['clean']} clean | {counts['aborted']} aborted | "
                      f"{counts['hung']} hung | {counts['failed']} failed | median {median:.1f} s a run"
                      + (f", {exit_median:.1f} s from the kill to the exit" if exits else ""), flush=True)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    machine["load_average_after"] = report.machine()["load_average_1_5_15min"]
    result = {"benchmark": "exit_block", "machine": machine, "load_processes": args.load, "results": results}
    print(f"Wrote {report.write_json(args.out / 'exit_block.json', result)}")


if __name__ == "__main__":
    main()
