"""Whether torchrun's restarts still need a store of the group's own (group_store in multigpu_torchrun.py).

    python benchmarks/restart_store.py                # 10 jobs each way; prints the counts, writes a JSON

Each job is `torchrun --standalone --nproc_per_node=2 --max_restarts=3` on a worker that forms its group,
all-reduces once, and, in each of the first 3 attempts, has rank 1 exit at once (as a crash does, leaving the
group's keys behind). A job that ends 0 used its restarts; one that ends 1 burned them all; one still running
after --job_timeout seconds hangs (it is killed). Three ways:
- plain: init_process_group() on torchrun's own store (what most examples do);
- group store: the store of the group's own that the torchrun examples here make;
- env: plain, with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 given to torchrun.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks import report  # noqa: E402
from benchmarks.launches import BIN, clean_env  # noqa: E402

WORKER = '''
import os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
sys.path.insert(0, {repo!r})
from multigpu_torchrun import group_store
rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
timeout = timedelta(seconds=30)
store = group_store(rank, world_size, timeout) if sys.argv[1] == "group_store" else None
dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
t = torch.ones(1)
dist.all_reduce(t)
if rank == 1 and int(os.environ["TORCHELASTIC_RESTART_COUNT"]) < 3:
    os._exit(1)
time.sleep(0.5)
dist.destroy_process_group()
'''


def job(worker, way, timeout):
    """("finished" | "burned" | "hung", seconds) of one job."""
    env = clean_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1") if way == "env" else clean_env()
    env["RESTART_STORE_JOB"] = mark = f"{os.getpid()}-{time.monotonic_ns()}"  # finds the job's workers later
    started = time.perf_counter()
    process = subprocess.Popen([str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", "--max_restarts=3",
                                worker, "group_store" if way == "group_store" else "plain"], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        code = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        # torchrun's workers run in sessions of their own: each process of the job is found by its mark.
        for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if f"RESTART_STORE_JOB={mark}".encode() in f.read().split(b"\0"):
                        os.kill(pid, signal.SIGKILL)
            except OSError:  # gone already, or not ours
                pass
        process.wait()
        return "hung", time.perf_counter() - started
    return ("finished" if code == 0 else "burned"), time.perf_counter() - started


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=10, help="jobs each way (default 10)")
    parser.add_argument("--job_timeout", type=float, default=90, help="seconds before a job counts as hung")
    parser.add_argument("--out", type=Path, default=report.DEFAULT_OUT, help="folder for the JSON")
    args = parser.parse_args()
    if args.jobs < 1:
        parser.error("--jobs must be positive")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        worker = os.path.join(tmp, "worker.py")
        Path(worker).write_text(WORKER.format(repo=str(REPO)))
        for way in ("plain", "group_store", "env"):
            runs = [job(worker, way, args.job_timeout) for _ in range(args.jobs)]
            counts = {end: sum(e == end for e, _ in runs) for end in ("finished", "burned", "hung")}
            results[way] = {"jobs": args.jobs, **counts, "median_s": sorted(s for _, s in runs)[len(runs) // 2]}
            print(f"{way:12} | {args.jobs} jobs | {counts['finished']} finished | {counts['burned']} burned all 3 "
                  f"restarts | {counts['hung']} hung | median {results[way]['median_s']:.1f} s a job", flush=True)
    print(f"Wrote {report.write_json(args.out / 'restart_store.json', {'benchmark': 'restart_store', 'machine': report.machine(), 'results': results})}")


if __name__ == "__main__":
    main()
