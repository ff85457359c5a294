"""Whether torchrun's restarts still need a store of the group's own (group_store in multigpu_torchrun.py).

    python benchmarks/restart_store.py      # 10 jobs each of 3 ways on one machine; prints the counts, writes a JSON
    python benchmarks/restart_store.py --ways plain group_store loopback env prefix --scenarios standalone two_nodes
    python benchmarks/restart_store.py --jobs 1 --crashes 1 --job_timeout 40 --out /tmp/results    # a smoke test

Each job runs a worker that forms its group and all-reduces; in each of the first 3 attempts (--crashes) rank 1
exits at once (as a crash does, leaving the group's keys behind in torchrun's store), while rank 0 computes for
--busy seconds before its next all-reduce. `--max_restarts=3` covers exactly those 3 crashes: a job that ends 0
used its restarts; one that ends non-zero burned them all; one where no attempt starts for --job_timeout
seconds while it runs hangs (it is killed: a loaded machine makes a job slow, not hung). Scenarios:
- standalone: `torchrun --standalone --nproc_per_node=2` (one agent, one restart count);
- two_nodes: two torchruns, `--nnodes=2 --nproc_per_node=1` with c10d rendezvous on 127.0.0.1, as two machines
  would (each agent counts its own restarts: the agent whose worker is still computing when the other node
  comes back restarts without counting, pytorch/pytorch#108158).
Ways (how the worker forms its group):
- plain: init_process_group() on torchrun's own store (what most examples do);
- group_store: the store of the group's own that the torchrun examples made (multigpu_torchrun.py's, copied);
- loopback: the same, its server listening at MASTER_ADDR only (not on every interface);
- env: plain, with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 given to torchrun (a fresh store per attempt, on rank 0);
- prefix: torchrun's store under PrefixStore(f"attempt{TORCHELASTIC_RESTART_COUNT}").
"""
import argparse
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

WAYS = ("plain", "group_store", "loopback", "env", "prefix")
SCENARIOS = ("standalone", "two_nodes")

# group_store as multigpu_torchrun.py had it (its server on every interface), copied: the benchmark outlives it.
GROUP_STORE = '''
def group_store(rank, world_size, timeout):
    """Under torchrun, a store of this group's own: torchrun's outlives a restart with the dead group's keys, and a
    restarted rank can read a dead peer's address and burn the restart (pytorch/pytorch#135712, torch 2.13 too)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    host = os.environ["MASTER_ADDR"]
    torchrun_store = dist.TCPStore(host, int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    if rank == 0:  # a fresh store, its port posted in torchrun's
        store = dist.TCPStore(host, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        torchrun_store.set("group_store_port", str(store.port))
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while time.monotonic() < deadline:  # where nothing answers at the posted port, the post is the dead group's
        port = int(torchrun_store.get("group_store_port"))
        try:
            socket.create_connection((host, port), timeout=3).close()  # refused at once where rank 0 died
            return dist.TCPStore(host, port, is_master=False, timeout=timeout)
        except OSError:
            time.sleep(0.1)
    sys.exit(f"error: rank 0 opened no store for this group within --timeout {timeout.total_seconds():g}s")
'''

# The loopback candidate: group_store with its server listening at the rendezvous address only.
LOOPBACK_STORE = '''
def loopback_store(rank, world_size, timeout):
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    host = os.environ["MASTER_ADDR"]
    torchrun_store = dist.TCPStore(host, int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    if rank == 0:  # a fresh store at the rendezvous address only, its port posted in torchrun's
        listener = socket.create_server((host, 0), family=socket.getaddrinfo(host, 0)[0][0])
        store = dist.TCPStore(host, listener.getsockname()[1], world_size, is_master=True, timeout=timeout,
                              wait_for_workers=False, master_listen_fd=listener.detach())
        torchrun_store.set("group_store_port", str(store.port))
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while time.monotonic() < deadline:  # where nothing answers at the posted port, the post is the dead group's
        port = int(torchrun_store.get("group_store_port"))
        try:
            socket.create_connection((host, port), timeout=3).close()  # refused at once where rank 0 died
            return dist.TCPStore(host, port, is_master=False, timeout=timeout)
        except OSError:
            time.sleep(0.1)
    sys.exit(f"error: rank 0 opened no store for this group within --timeout {timeout.total_seconds():g}s")
'''

WORKER = '''
import os, socket, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
{group_store}
{loopback_store}
way, busy, folder = sys.argv[1], float(sys.argv[2]), sys.argv[3]
rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
with open(os.path.join(folder, "starts"), "a") as f:  # which restart count each rank saw
    f.write(f"{{rank}}:{{os.environ['TORCHELASTIC_RESTART_COUNT']}}\\n")
timeout = timedelta(seconds=30)
store = None
if way == "group_store":
    store = group_store(rank, world_size, timeout)
elif way == "loopback":
    store = loopback_store(rank, world_size, timeout)
elif way == "prefix":
    store = dist.PrefixStore(f"attempt{{os.environ['TORCHELASTIC_RESTART_COUNT']}}", dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout))
dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
t = torch.ones(1)
dist.all_reduce(t)
crashes = os.path.join(folder, "crashes")
if rank == 1 and (not os.path.exists(crashes) or os.path.getsize(crashes) < {crashes}):
    with open(crashes, "a") as f:
        f.write("x")
    os._exit(1)
time.sleep(busy)  # rank 0 computes; in a crashed attempt its next all-reduce fails
dist.all_reduce(t)
dist.destroy_process_group()
os._exit(0)  # this benchmark counts restarts, not clean exits
'''


def kill_job(mark):
    """torchrun's workers run in sessions of their own: each process of the job is found by its mark."""
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"RESTART_STORE_JOB={mark}".encode() in f.read().split(b"\0"):
                    os.kill(pid, signal.SIGKILL)
        except OSError:  # gone already, or not ours
            pass


def free_port():
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def job(worker, way, scenario, busy, timeout, crashes):
    """{"end": "finished" | "burned" | "hung", "seconds", "starts"} of one job."""
    env = clean_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1") if way == "env" else clean_env()
    env["RESTART_STORE_JOB"] = mark = f"{os.getpid()}-{time.monotonic_ns()}"  # finds the job's workers later
    with tempfile.TemporaryDirectory() as folder:
        tail = [worker, way, str(busy), folder]
        if scenario == "standalone":
            commands = [[str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", f"--max_restarts={crashes}",
                         *tail]]
        else:
            node = [str(BIN / "torchrun"), "--nnodes=2", "--nproc_per_node=1", f"--max_restarts={crashes}",
                    "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}", f"--rdzv_id={mark}", *tail]
            commands = [node, node]
        started = time.perf_counter()
        processes = []
        for command in commands:
            processes.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            time.sleep(0.5)  # the first torchrun hosts the rendezvous store
        starts, last = Path(folder, "starts"), (0, time.perf_counter())
        while any(process.poll() is None for process in processes):
            size = starts.stat().st_size if starts.exists() else 0
            if size != last[0]:  # an attempt started: the job moves on, however loaded the machine
                last = (size, time.perf_counter())
            elif time.perf_counter() - last[1] > timeout:
                kill_job(mark)
                for process in processes:
                    process.wait()
                break
            time.sleep(0.5)
        codes = [process.returncode for process in processes]
        end = "hung" if any(c == -signal.SIGKILL for c in codes) else "burned" if any(codes) else "finished"
        seconds = time.perf_counter() - started
        starts = Path(folder, "starts").read_text().split() if Path(folder, "starts").exists() else []
    return {"end": end, "seconds": round(seconds, 2), "starts": starts}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=10, help="jobs each way and scenario (default 10)")
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=["plain", "group_store", "env"],
                        help="default: plain group_store env")
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=["standalone"],
                        help="default: standalone")
    parser.add_argument("--busy", type=float, default=2, help="seconds rank 0 computes between its all-reduces")
    parser.add_argument("--job_timeout", type=float, default=120,
                        help="seconds without a new attempt before a running job counts as hung (default 120)")
    parser.add_argument("--crashes", type=int, default=3,
                        help="attempts in which rank 1 exits, and torchrun's --max_restarts (default 3)")
    parser.add_argument("--out", type=Path, default=report.DEFAULT_OUT, help="folder for the JSON")
    args = parser.parse_args()
    if args.jobs < 1 or args.crashes < 1 or args.busy < 0 or args.job_timeout <= 0:
        parser.error("--jobs, --crashes and --job_timeout must be positive, --busy not negative")
    machine = report.machine()
    print(report.machine_line(machine), flush=True)
    tables = {}
    with tempfile.TemporaryDirectory() as tmp:
        worker = os.path.join(tmp, "worker.py")
        Path(worker).write_text(WORKER.format(group_store=GROUP_STORE, loopback_store=LOOPBACK_STORE,
                                              crashes=args.crashes))
        for scenario in args.scenarios:
            results = tables.setdefault(scenario, {})
            for way in args.ways:
                runs = []
                for _ in range(args.jobs):
                    runs.append(job(worker, way, scenario, args.busy, args.job_timeout, args.crashes))
                    print(f"  {scenario} {way}: {runs[-1]['end']} in {runs[-1]['seconds']:.0f} s, (rank:restart "
                          f"count) {' '.join(runs[-1]['starts'])}", flush=True)
                counts = {end: sum(r["end"] == end for r in runs) for end in ("finished", "burned", "hung")}
                median = sorted(r["seconds"] for r in runs)[len(runs) // 2]
                results[way] = {"jobs": args.jobs, **counts, "median_s": median, "runs": runs}
                print(f"{scenario:10} | {way:11} | {args.jobs} jobs | {counts['finished']} finished | "
                      f"{counts['burned']} burned all {args.crashes} restarts | {counts['hung']} hung | "
                      f"median {median:.1f} s a job", flush=True)
    machine["load_average_after"] = report.machine()["load_average_1_5_15min"]
    result = {"benchmark": "restart_store", "machine": machine, "busy_s": args.busy, "crashes": args.crashes,
              # one machine's table stays where it always was: results[way]
              "results": tables.get("standalone", {}), "two_nodes": tables.get("two_nodes", {})}
    print(f"Wrote {report.write_json(args.out / 'restart_store.json', result)}")


if __name__ == "__main__":
    main()
