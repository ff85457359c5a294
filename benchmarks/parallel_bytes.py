"""The bytes each rank sends in a training step, counted by the kernel, beside the formula, for each layout of
tensor_parallel.py, pipeline_parallel.py and nd_parallel.py; and the step time on the CPU (gloo).

    python benchmarks/parallel_bytes.py              # 11 layouts on 2, 4 and 8 processes (2 to 4 min on 2 cores)
    python benchmarks/parallel_bytes.py --quick      # the 4 layouts of 2 processes, 4 steps each

One torchrun job per world size runs its layouts one after the other: a worker imports each script and calls its
own main() (the script's model, mesh, parallelization and Trainer, under a process group the worker opened), with
the script's Trainer._run_batch wrapped to read, before and after every step, what each TCP socket of the process
was given to send (getsockopt TCP_INFO on the sockets under /proc/self/fd: bytes_sent - bytes_retrans +
notsent_bytes, the kernel's counts; gloo's headers included). Counted is the difference from the start of the
second step to the end of the last (the first step also infers shapes and runs CommDebugMode), over the steps; the
bytes given between two steps are recorded too (0: nothing but the steps talks). Start-up, the store and the
checkpoint lie outside the window. Each socket's peer is mapped to the rank that owns its other end, so the JSON
says which rank sent what to which. The step time is the slowest rank's median step, on CPUs shared by all the
processes (8 processes on 2 cores wait for a core).

The formula, per rank and step, for s bytes an element, b samples per data-parallel rank in a step, width W, n
ranks in a group: a ring all-reduce sends 2(n-1)/n of the tensor's bytes, an all-gather (n-1)/n, and gloo's
reduce-scatter as much as its all-reduce, 2(n-1)/n, where NCCL's ring sends (n-1)/n (each job measures these first):
- tp: 2 all-reduces of b x W x s per block, forward (fc2's output) and backward (fc1's input's gradient);
- FSDP2 over dp_shard: the stage's blocks (each rank's tp piece) all-gathered in forward once per micro-batch and
  once in backward (PipelineStage keeps them gathered over the backward micro-batches), the rest of the model once;
  every gradient reduce-scattered once;
- HSDP: the shards' gradients all-reduced over dp_replicate too (DDP-like: dp_shard 1, only this);
- pp: b x W x s of activations to the next stage, as much of their gradients to the one before.
Writes parallel_bytes.json and parallel_bytes.png to --out (default benchmarks/results).
"""
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file: make the repository importable
from benchmarks import common, report
from benchmarks.launches import BIN, REPO, clean_env

INPUT_SIZE, DATASET_SIZE = 20, 2048  # the scripts' regression data
# name, processes, script, its arguments. The scripts' own sizes: width 64, hidden 256, depth 4, batch 256.
LAYOUTS = [
    ("DDP-like 2", 2, "nd_parallel.py", "--dp 2 --dp_replicate 2"),
    ("FSDP2 2", 2, "nd_parallel.py", "--dp 2"),
    ("TP 2", 2, "tensor_parallel.py", ""),
    ("PP 2", 2, "pipeline_parallel.py", "--microbatches 4"),
    ("DDP-like 4", 4, "nd_parallel.py", "--dp 4 --dp_replicate 4"),
    ("FSDP2 4", 4, "nd_parallel.py", "--dp 4"),
    ("TP 4", 4, "tensor_parallel.py", ""),
    ("PP 4", 4, "pipeline_parallel.py", "--microbatches 4"),
    ("FSDP2 x TP 2x2", 4, "nd_parallel.py", "--dp 2 --tp 2"),
    ("HSDP 2x2", 4, "nd_parallel.py", "--dp 4 --dp_replicate 2"),
    ("3-D 2x2x2", 8, "nd_parallel.py", "--dp 2 --tp 2 --pp 2"),
]
WARMUP = 1  # steps left out of the window

WORKER = r'''
import importlib, json, os, socket, struct, sys, time
sys.path.insert(0, {repo!r})
import torch
import torch.distributed as dist

# Offsets in Linux's struct tcp_info (linux/tcp.h, kernel 4.19+): tcpi_notsent_bytes (u32), tcpi_bytes_sent and
# tcpi_bytes_retrans (u64).
NOTSENT, SENT, RETRANS = 144, 200, 208


def sockets():
    """{{(local address, peer address): bytes written}} of this process's TCP sockets, as the kernel counts them:
    those it transmitted, less those it transmitted again, plus those that wait in the send queue."""
    found = {{}}
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{{fd}}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(fd)))
        except OSError:  # closed meanwhile
            continue
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
                info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
                here, there = sock.getsockname()[:2], sock.getpeername()[:2]
                notsent, = struct.unpack_from("=I", info, NOTSENT)
                sent, retransmitted = struct.unpack_from("=QQ", info, SENT)
                found[f"{{here[0]}}:{{here[1]}}", f"{{there[0]}}:{{there[1]}}"] = sent - retransmitted + notsent
        except OSError:  # a listening socket has no peer
            pass
        finally:
            sock.close()
    return found


def counted(module):
    """Wrap the script's Trainer._run_batch: (time, every socket's bytes sent) before and after each step."""
    steps = []
    run_batch = module.Trainer._run_batch

    def wrapped(self, *args, **kwargs):
        before = (time.perf_counter(), sockets())
        result = run_batch(self, *args, **kwargs)
        steps.append((before, (time.perf_counter(), sockets())))
        return result

    module.Trainer._run_batch = wrapped
    return steps


def calibrate(size=1 << 18):
    """What gloo sends for each collective of the whole group on `size` float32 elements, per byte of the tensor."""
    whole, part = torch.ones(size), torch.empty(size // dist.get_world_size())
    collectives = {{"all_reduce": lambda: dist.all_reduce(whole),
                   "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(whole, part),
                   "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(part, whole)}}
    factors = {{}}
    for name, collective in collectives.items():
        collective()  # the first call may connect
        dist.barrier()
        before = sum(sockets().values())
        collective()
        factors[name] = (sum(sockets().values()) - before) / whole.nbytes
        dist.barrier()
    return factors


out, layouts = sys.argv[1], json.loads(sys.argv[2])
dist.init_process_group("gloo")  # the scripts' main() uses it, and leaves it open for the next layout
rank = dist.get_rank()
factors = calibrate()
records = []
for index, (name, script, arguments) in enumerate(layouts):
    module = importlib.import_module(script[:-3])
    steps = counted(module)
    arguments = [*arguments, "--snapshot_path", os.path.join(out, f"checkpoints-{{index}}")]
    module.main(module.parse_args(arguments))
    records.append({{"name": name, "steps": [[[t, list(map(list, c.items()))] for t, c in pair] for pair in steps]}})
    dist.barrier()
with open(os.path.join(out, f"rank{{rank}}.json"), "w") as f:
    json.dump({{"rank": rank, "pid": os.getpid(), "collectives": factors, "layouts": records}}, f)
dist.destroy_process_group()
'''


def arguments_of(flags, args):
    """A layout's flags and the run's: one epoch, one checkpoint at its end (outside the window)."""
    return [*flags.split(), "--total_epochs", "1", "--save_every", "1", "--global_batch_size",
            str(args.global_batch_size)]


def mesh_of(script, world_size, arguments):
    """(pp, dp_replicate, dp_shard, tp, micro-batches) of a layout, as the script reads its flags."""
    flags = dict(zip(arguments[::2], arguments[1::2]))
    if script == "tensor_parallel.py":
        return 1, 1, 1, world_size, 1
    if script == "pipeline_parallel.py":
        return world_size, 1, 1, 1, int(flags.get("--microbatches", 4))
    tp, pp = int(flags.get("--tp", 1)), int(flags.get("--pp", 1))
    dp = int(flags.get("--dp", world_size // (tp * pp)))
    replicate = int(flags.get("--dp_replicate", 1))
    return pp, replicate, dp // replicate, tp, int(flags.get("--microbatches", pp))


def formula(mesh, rank, batch, width=64, hidden=256, depth=4, itemsize=4, reduce_scatter=1):
    """The bytes `rank` sends in a step by the formula, by part: {part: bytes}. reduce_scatter: the ring's (n-1)/n
    of the bytes times this; gloo's reduce_scatter_tensor sends what an all-reduce sends, 2 (calibrate())."""
    pp, replicate, shard, tp, microbatches = mesh
    stage = rank // (replicate * shard * tp)
    blocks = depth * (stage + 1) // pp - depth * stage // pp
    block = 2 * hidden * width // tp + hidden // tp + width + 2 * width  # fc1, fc2 split over tp; fc2.bias, norm whole
    rest = (INPUT_SIZE * width + width) * (stage == 0) + (2 * width + width + 1) * (stage == pp - 1)
    rows = batch // (replicate * shard)  # samples per data-parallel rank in a step, all micro-batches together
    activations = rows * width * itemsize
    parts = {"tp all-reduce": 2 * blocks * 2 * (tp - 1) / tp * activations}
    if replicate * shard > 1:  # the scripts shard with FSDP2 whenever there is data parallelism
        gathered = (microbatches + 1) * blocks * block + rest
        parts["FSDP all-gather"] = (shard - 1) / shard * gathered * itemsize
        parts["FSDP reduce-scatter"] = reduce_scatter * (shard - 1) / shard * (blocks * block + rest) * itemsize
        parts["HSDP all-reduce"] = 2 * (replicate - 1) / replicate * (blocks * block + rest) / shard * itemsize
    parts["pp send/recv"] = activations * ((stage < pp - 1) + (stage > 0))
    return {part: round(value) for part, value in parts.items() if value}


def owners(ranks):
    """{address: rank} of every socket's local end: whose process a peer address belongs to."""
    return {here: record["rank"] for record in ranks for layout in record["layouts"] for step in layout["steps"]
            for _, sockets in step for (here, _), _ in sockets}


def measured(record, index, owner):
    """(bytes per step, {peer: bytes per step}, median seconds of a step, bytes between steps) of one rank in one
    layout."""
    steps = record["layouts"][index]["steps"][WARMUP:]
    if not steps:
        raise common.UsageError(f"{record['layouts'][index]['name']}: rank {record['rank']} ran no step after the "
                                f"first {WARMUP}; use a smaller --global_batch_size")
    first, last = steps[0][0][1], steps[-1][1][1]
    first, last = ({tuple(key): value for key, value in sockets} for sockets in (first, last))
    to = {}
    for key, value in last.items():
        peer = owner.get(key[1], "store or agent")
        to[peer] = to.get(peer, 0) + value - first.get(key, 0)
    between = sum(sum(v for _, v in after[1]) - sum(v for _, v in before[1])
                  for (_, before), (after, _) in zip(steps, steps[1:]))
    n = len(steps)
    seconds = statistics.median(after[0] - before[0] for before, after in steps)  # a step another job stalled: not it
    return sum(to.values()) / n, {str(k): v / n for k, v in sorted(to.items(), key=str) if v}, seconds, between


def run_world(world_size, layouts, args, tmp):
    out = Path(tmp) / f"n{world_size}"
    out.mkdir()
    worker = Path(tmp) / "worker.py"
    plan = [[name, script, arguments_of(flags, args)] for name, _, script, flags in layouts]
    command = [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={world_size}", str(worker), str(out),
               json.dumps(plan)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, cwd=REPO,
                              env=clean_env(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=""))
    except subprocess.TimeoutExpired:
        raise common.UsageError(f"the {world_size}-process job took over --timeout {args.timeout:g}s") from None
    if done.returncode != 0:  # the script's one line, or the output's last
        lines = [line for line in done.stderr.splitlines() if line.strip()] or ["no output"]
        said = next((line for line in lines if "error:" in line), lines[-1])
        raise common.UsageError(f"the {world_size}-process job failed (exit {done.returncode}): {said.strip()}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]
    owner = owners(ranks)
    results = []
    for index, (name, _, script, flags) in enumerate(layouts):
        arguments = arguments_of(flags, args)
        mesh = mesh_of(script, world_size, arguments)
        command = f"torchrun --standalone --nproc_per_node={world_size} {script} {' '.join(arguments)}"
        rows = []
        for record in ranks:
            per_step, to, seconds, between = measured(record, index, owner)
            parts = formula(mesh, record["rank"], args.global_batch_size, reduce_scatter=2)
            textbook = sum(formula(mesh, record["rank"], args.global_batch_size).values())
            rows.append({"rank": record["rank"], "bytes_per_step": per_step, "to": to, "between_steps": between,
                         "formula": parts, "formula_bytes": sum(parts.values()), "textbook_bytes": textbook,
                         "ratio": per_step / sum(parts.values()), "step_s": seconds})
        results.append({"layout": name, "processes": world_size, "command": command,
                        "mesh": dict(zip(("pp", "dp_replicate", "dp_shard", "tp", "microbatches"), mesh)),
                        "steps_counted": len(ranks[0]["layouts"][index]["steps"]) - WARMUP,
                        "step_s": max(row["step_s"] for row in rows), "ranks": rows})
    return results, ranks[0]["collectives"]


def plot(results, batch, path):
    plt = report.pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 1]})
    names = [r["layout"] for r in results]
    x = range(len(results))
    for shift, key, label in ((-0.27, "bytes_per_step", "counted (TCP_INFO)"),
                              (0, "formula_bytes", "formula, gloo (reduce-scatter sends as an all-reduce)"),
                              (0.27, "textbook_bytes", "formula, ring reduce-scatter (n-1)/n (NCCL)")):
        left.bar([i + shift for i in x], [max(row[key] for row in r["ranks"]) / 1024 for r in results], width=0.27,
                 label=label)
    left.set_xticks(list(x), names, rotation=35, ha="right")
    left.set_ylabel("KiB sent per step, the busiest rank")
    left.set_ylim(0, 1.35 * left.get_ylim()[1])  # room for the legend above the bars
    left.legend(loc="upper left")
    right.barh(names, [1000 * r["step_s"] for r in results])
    right.invert_yaxis()
    right.set_xlabel("step time, ms (CPU, gloo)")
    fig.suptitle(f"Bytes each rank sends per training step, BlockMLP (134,401 parameters), global batch {batch}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(args):
    args.global_batch_size = args.global_batch_size or (512 if args.quick else 256)
    if DATASET_SIZE % args.global_batch_size or DATASET_SIZE // args.global_batch_size <= WARMUP or \
            args.global_batch_size % 4:
        raise common.UsageError(f"--global_batch_size {args.global_batch_size} must divide the {DATASET_SIZE} "
                                f"samples into more than {WARMUP} step, and 4 must divide it (4 data-parallel "
                                "ranks, or 4 micro-batches)")
    layouts = [layout for layout in LAYOUTS if not args.quick or layout[1] == 2]
    load_before = report.machine()["load_average_1_5_15min"]  # the machine is recorded at the end, with this
    results, collectives = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "worker.py").write_text(WORKER.format(repo=str(REPO)))
        for world_size in sorted({layout[1] for layout in layouts}):
            found, collectives[world_size] = run_world(world_size, [layout for layout in layouts
                                                                    if layout[1] == world_size], args, tmp)
            results += found
    info = report.machine("gloo")
    print(report.machine_line(info))
    rows = []
    for r in results:
        for row in r["ranks"]:
            rows.append([r["layout"] if row["rank"] == 0 else "", row["rank"], f"{row['bytes_per_step']:,.0f}",
                         f"{row['formula_bytes']:,}", f"{row['ratio']:.3f}",
                         ", ".join(f"{peer} {value:,.0f}" for peer, value in row["to"].items()),
                         f"{1000 * r['step_s']:.1f}" if row["rank"] == 0 else ""])
    print(report.table(["layout", "rank", "bytes sent/step", "formula", "ratio", "to rank: bytes", "step ms"], rows))
    for world_size, factors in collectives.items():
        print(f"gloo, {world_size} ranks, bytes sent per byte of the tensor: " +
              ", ".join(f"{name} {factor:.3f}" for name, factor in factors.items()))
    out = Path(args.out)
    report.write_json(out / "parallel_bytes.json", {
        "machine": info, "load_average_before": load_before, "torch": info["torch"], "backend": "gloo",
        "global_batch_size": args.global_batch_size,
        "model": {"input": INPUT_SIZE, "width": 64, "hidden": 256, "depth": 4}, "warmup_steps": WARMUP,
        "quick": args.quick, "collectives": collectives, "results": results})
    plot(results, args.global_batch_size, out / "parallel_bytes.png")
    print(f"Wrote {out / 'parallel_bytes.json'} and {out / 'parallel_bytes.png'}")


if __name__ == "__main__":
    parser = common.ArgumentParser(description=__doc__, formatter_class=common.argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the 2-process layouts only, 4 steps each")
    parser.add_argument("--global_batch_size", type=common.positive_int,
                        help="samples a step over all ranks (default 256: 8 steps; --quick 512: 4)")
    parser.add_argument("--timeout", type=common.positive_float, default=600, help="seconds for each job")
    parser.add_argument("--out", default=report.DEFAULT_OUT, help="folder of parallel_bytes.json and .png")
    common.run(main, parser)
