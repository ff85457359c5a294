"""What a dead worker costs the healthy ones: torchft (fault_tolerant.py) against a restart from a snapshot.

    python benchmarks/fault_tolerance.py                       # 400 steps, the kill after step 150, median of 3
    python benchmarks/fault_tolerance.py --quick               # one short run of each, for a smoke test

The same job both ways: the tutorial's MLP on the same synthetic data, 2 workers of batch 32 each, gloo on the
CPU, every worker under `torchrun --max_restarts=1`; each step sleeps --step_delay (50 ms) after the optimizer
step, standing in for a real model's compute (the MLP's own step takes a few ms, less than torchft's per-step
round trips). The same failure: worker 1 SIGKILLed right after its step
--kill_at; its torchrun starts it again.

- torchft: a torchft_lighthouse and two replica groups, `torchrun --nproc_per_node=1 fault_tolerant.py`. Worker 0
  steps on alone; the restarted worker 1 heals from it.
- restart: one `torchrun --nproc_per_node=2` DDP job that writes a snapshot every --save_every_steps steps, as
  by_feature/step_checkpoints.py does (a minimal equivalent of it, on this job's model and data, is this file's
  --worker mode). torchrun stops worker 0 too and starts both from the last snapshot.

Measured on the healthy worker 0, from the time each of its step lines arrives: stopped_s, the seconds it did no
step (every pause between two steps longer than 3 median steps, less one median step, counted from the kill on);
redone_steps, the steps it trained twice (torchft: its steps that were not committed; restart: those since the
snapshot); regained_s, the seconds from the kill until it had finished again as many steps as it had at the kill.
Also victim_back_s, the seconds until the killed worker, started again, finished a step (torchft: after healing; None
if the healthy group finished first: the victim, stopped then, would only train alone; --quick: torchft's victim is
not started again).
Writes fault_tolerance.json and fault_tolerance.png to --out (default benchmarks/results).
"""
import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file: make the repository importable
from benchmarks import report
from benchmarks.common import free_port, group_store
from benchmarks.launches import BIN, REPO, clean_env
from launch.two_sites import Group

# The lighthouse as docs/fault-tolerance.md starts it: a group silent for 2 s is dead.
LIGHTHOUSE_FLAGS = ["--min_replicas", "1", "--join_timeout_ms", "1000", "--heartbeat_timeout_ms", "2000"]
TORCHFT_STEP = re.compile(r"^Step (\d+) \| groups \d+ \|")
NOT_COMMITTED = re.compile(r"^Step \d+ \| not committed")
RESTART_STEP = re.compile(r"^rank (\d+) step (\d+)$")


class Launch(Group):
    """A launch in a session of its own, each line of its output kept with the time it arrived: launch/two_sites.py's
    Group, without the echo; here a line that does not come is an error."""

    def __init__(self, argv, cwd, env=None):
        super().__init__(None, [str(a) for a in argv], env or clean_env(), cwd, echo=False)

    def wait_for(self, pattern, timeout, accept=lambda match: True):
        """The match of the first line that matches `pattern` and that `accept` takes; raise if none comes."""
        deadline = time.monotonic() + timeout
        with self.arrived:
            while True:
                for _, line in self.lines:
                    if (match := re.search(pattern, line)) and accept(match):
                        return match
                if self.process.poll() is not None and not self.reader.is_alive():
                    raise RuntimeError(f"exited {self.process.returncode} before {pattern!r}: {self.tail()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no {pattern!r} within {timeout}s: {self.tail()}")
                self.arrived.wait(0.1)

    def tail(self):
        return " / ".join(line for _, line in self.lines[-5:])

    def finish(self, timeout):
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(f"still running after {timeout}s: {self.tail()}") from None
        self.reader.join(10)
        return self.process.returncode


def worker_of(agent_pid, local_rank):
    """The pid of the worker torchrun (agent_pid) runs as LOCAL_RANK local_rank, from /proc."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if parent == agent_pid and f"LOCAL_RANK={local_rank}".encode() in environ:
            return int(entry.name)
    raise RuntimeError(f"torchrun {agent_pid} runs no worker of local rank {local_rank}")


def measure(times_steps, kill_time, kill_at, redone):
    """stopped_s, regained_s and the median step of the healthy worker's [(time, step)] lines."""
    before = [t for t, _ in times_steps if t <= kill_time]
    step_s = statistics.median(b - a for a, b in zip(before, before[1:]))
    after = [(t, s) for t, s in times_steps if t > kill_time]
    previous, stopped = kill_time, 0.0
    for t, _ in after:
        if t - previous > 3 * step_s:
            stopped += t - previous - step_s
        previous = t
    # Back where it was: the first step past the kill's after the last one that was not (a restart's redone steps).
    redo_end = max((t for t, s in after if s <= kill_at), default=kill_time)
    regained = min(t for t, s in after if t >= redo_end and s > kill_at)
    return {"stopped_s": stopped, "regained_s": regained - kill_time, "redone_steps": redone, "step_ms": 1000 * step_s,
            "timeline": [[round(t - kill_time, 4), s] for t, s in times_steps]}


def run_torchft(args, tmp):
    port = free_port()
    lighthouse = Launch([BIN / "torchft_lighthouse", "--bind", f"127.0.0.1:{port}", *LIGHTHOUSE_FLAGS], tmp,
                        clean_env(RUST_LOG="warn"))
    try:
        time.sleep(0.5)
        # --quick starts no worker again: its figures are the healthy group's. A worker started again races that
        # group's last 50 steps: back before they end, it heartbeats before its first quorum, and the lighthouse (a
        # quorum of more than half of the groups it hears) holds the healthy group's quorum till then: a stall.
        restarts = f"--max_restarts={0 if args.quick else 1}"
        groups = [Launch([BIN / "torchrun", "--standalone", "--nproc_per_node=1", restarts,
                          REPO / "fault_tolerant.py", "--replica_id", str(i), "--steps", str(args.steps),
                          "--batch_size", str(args.batch_size), "--step_delay", str(args.step_delay),
                          "--lighthouse", f"http://127.0.0.1:{port}"], tmp)
                  for i in range(2)]
        try:
            # The group that starts second heals from the first; the kill comes once both step together, after step
            # --kill_at (or after the first step together, if a slow start had group 1 heal past it).
            killed_after = int(groups[1].wait_for(r"^Step (\d+) \| groups 2 ", args.launch_timeout,
                                                  lambda m: int(m[1]) >= args.kill_at)[1])
            os.kill(worker_of(groups[1].process.pid, 0), signal.SIGKILL)
            kill_time = time.monotonic()
            codes = [groups[0].finish(args.launch_timeout)]
            # The victim heals from the healthy group or never: once that group is done, a victim not healed yet
            # would train every step again alone, which no figure reads (--quick: the healthy group finishes
            # first). It is stopped then (SIGTERM: its torchrun stops the worker, even one still importing, which
            # a SIGKILLed torchrun would leave behind); a victim that healed must finish as the healthy group did.
            healed = [line for t, line in groups[1].lines if t > kill_time and line.startswith("Healed")]
            if not healed:
                groups[1].process.terminate()
            stopped = groups[1].finish(args.launch_timeout)
            if healed:
                codes.append(stopped)
        finally:
            for group in groups:
                group.kill()
        if any(codes):
            raise RuntimeError(f"fault_tolerant.py exited {codes}: {groups[0].tail()} | {groups[1].tail()}")
        healthy = groups[0].lines
        times_steps = [(t, int(m[1])) for t, line in healthy if (m := TORCHFT_STEP.match(line))]
        redone = sum(1 for t, line in healthy if t > kill_time and NOT_COMMITTED.match(line))
        result = measure(times_steps, kill_time, killed_after, redone)
        result["victim_healed"] = healed[0] if healed else None  # None: the others finished before it was back
        back = [t for t, line in groups[1].lines if t > kill_time and TORCHFT_STEP.match(line)]
        result["victim_back_s"] = back[0] - kill_time if healed and back else None
        return result
    finally:
        lighthouse.kill()


def run_restart(args, tmp):
    job = Launch([BIN / "torchrun", "--standalone", "--nproc_per_node=2", "--max_restarts=1", __file__, "--worker",
                  "--steps", str(args.steps), "--batch_size", str(args.batch_size), "--save_every_steps",
                  str(args.save_every_steps), "--step_delay", str(args.step_delay), "--snapshot",
                  Path(tmp) / "snapshot.pt"], tmp)
    try:
        job.wait_for(rf"^rank 1 step {args.kill_at}$", args.launch_timeout)
        os.kill(worker_of(job.process.pid, 1), signal.SIGKILL)
        kill_time = time.monotonic()
        code = job.finish(args.launch_timeout)
    finally:
        job.kill()
    if code != 0:
        raise RuntimeError(f"the restart job exited {code}: {job.tail()}")
    times_steps = [(t, int(m[2])) for t, line in job.lines if (m := RESTART_STEP.match(line)) and m[1] == "0"]
    resumed = min(s for t, s in times_steps if t > kill_time) - 1  # the snapshot's step
    result = measure(times_steps, kill_time, args.kill_at, args.kill_at - resumed)
    back = [t for t, line in job.lines if t > kill_time and (m := RESTART_STEP.match(line)) and m[1] == "1"]
    result["victim_back_s"] = back[0] - kill_time
    return result


def worker(args):
    """The restart baseline's worker (under torchrun): DDP on the MLP, the step's batches as fault_tolerant.py takes
    them, a snapshot every --save_every_steps steps written by rank 0, resumed from at start."""
    import torch
    import torch.distributed as dist
    import torch.distributed.nn  # before any process group: docs/failures.md, clean exits
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from models_and_data import MLP, regression_dataset

    torch.set_num_threads(1)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = timedelta(seconds=30)
    dist.init_process_group("gloo", store=group_store(rank, world_size, timeout), rank=rank, world_size=world_size,
                            timeout=timeout)
    torch.manual_seed(0)
    model = DDP(MLP())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    dataset, step = regression_dataset(seed=0), 0
    if os.path.exists(args.snapshot):
        state = torch.load(args.snapshot, weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
    global_batch = world_size * args.batch_size
    steps_per_epoch = len(dataset) // global_batch
    while step < args.steps:
        epoch, position = divmod(step, steps_per_epoch)
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(epoch))
        start = position * global_batch + rank * args.batch_size
        x, y = dataset[order[start:start + args.batch_size]]
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        step += 1
        os.write(1, f"rank {rank} step {step}\n".encode())  # one write: the two ranks share the pipe
        time.sleep(args.step_delay)
        if step % args.save_every_steps == 0 and rank == 0:
            # Written beside it, then renamed over it: a kill mid-save leaves the previous snapshot whole.
            with open(args.snapshot + ".tmp", "wb") as f:
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, f)
                os.fsync(f.fileno())
            os.replace(args.snapshot + ".tmp", args.snapshot)
    del model, optimizer  # DDP holds the process group: free it first, so destroy_process_group frees the group
    dist.destroy_process_group()


def plot(results, path):
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, row in results.items():
        t, s = zip(*row["runs"][0]["timeline"])
        ax.plot(t, s, ".", markersize=2, label=f"{name}: stopped {row['stopped_s']:.1f}s, "
                                               f"{row['redone_steps']:g} steps redone")
    ax.axvline(0, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("seconds since worker 1 was SIGKILLed")
    ax.set_ylabel("step finished by the healthy worker 0")
    ax.set_title("A dead worker: torchft steps on, a restart stops and redoes steps")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(args):
    if args.quick:
        args.steps, args.kill_at, args.save_every_steps, args.repeats = 100, 50, 20, 1
    if not 0 < args.kill_at < args.steps:
        raise SystemExit("error: --kill_at must be between 0 and --steps")
    machine = report.machine("gloo", 2)
    results = {}
    for name, method in (("torchft", run_torchft), ("restart", run_restart)):
        runs = []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as tmp:
                runs.append(method(args, tmp))
        results[name] = {key: statistics.median(run[key] for run in runs)
                         for key in ("stopped_s", "regained_s", "redone_steps", "step_ms")}
        back = [run["victim_back_s"] for run in runs if run["victim_back_s"] is not None]
        results[name]["victim_back_s"] = statistics.median(back) if back else None
        results[name]["runs"] = runs
    print(report.machine_line(machine))
    print(f"2 workers, batch {args.batch_size} each, {args.steps} steps of {1000 * args.step_delay:g} ms compute and "
          f"the MLP, worker 1 SIGKILLed after step {args.kill_at} and restarted by its torchrun; restart: a snapshot "
          f"every {args.save_every_steps} steps; median of {args.repeats}")
    print(report.table(["", "healthy worker stopped", "steps redone", "back at the kill's step after",
                        "killed worker steps again after", "step before the kill"],
                       [[name, f"{r['stopped_s']:.2f}s", f"{r['redone_steps']:g}", f"{r['regained_s']:.2f}s",
                         "-" if r["victim_back_s"] is None else f"{r['victim_back_s']:.2f}s", f"{r['step_ms']:.1f} ms"]
                        for name, r in results.items()]))
    data = {"benchmark": "fault_tolerance", "machine": machine, "torch": machine["torch"], "backend": "gloo",
            "world_size": 2, "steps": args.steps, "kill_at": args.kill_at, "batch_per_worker": args.batch_size,
            "step_delay_s": args.step_delay,
            "save_every_steps": args.save_every_steps, "repeats": args.repeats, "lighthouse": LIGHTHOUSE_FLAGS,
            "results": results}
    print(f"Wrote {report.write_json(args.out / 'fault_tolerance.json', data)} and "
          f"{plot(results, args.out / 'fault_tolerance.png')}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400, help="steps of each job (default 400)")
    parser.add_argument("--kill_at", type=int, default=150, help="worker 1 is SIGKILLed after this step (default 150)")
    parser.add_argument("--save_every_steps", type=int, default=20,
                        help="the restart job's snapshot interval N (default 20, step_checkpoints.py's default)")
    parser.add_argument("--batch_size", type=int, default=32, help="samples per step and worker (default 32)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each; medians reported (default 3)")
    parser.add_argument("--step_delay", type=float, default=0.05,
                        help="seconds each step sleeps, in both jobs: a model's compute (default 0.05)")
    parser.add_argument("--quick", action="store_true",
                        help="one short run of each: 100 steps, the kill after 50, torchft's victim not started again")
    parser.add_argument("--launch_timeout", type=float, default=300, help="seconds a job may take")
    parser.add_argument("--out", type=Path, default=report.DEFAULT_OUT, help="where to write the JSON and the plot")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--snapshot", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    worker(arguments) if arguments.worker else main(arguments)
