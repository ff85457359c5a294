"""The bytes each rank sends in a training step of the decoder, counted by the kernel, beside the formula, for each
layout of tensor_parallel.py, pipeline_parallel.py and nd_parallel.py; their speed (tokens/s, model-FLOPs
utilization against this machine's own matmul peak); and the cost of nd_parallel.py on one process against a plain
training loop of the same model and data, on the CPU (gloo).

    python benchmarks/parallel_bytes.py              # 14 layouts on 2, 4 and 8 processes, and one process
    python benchmarks/parallel_bytes.py --quick      # the 5 layouts of 2 processes and one process, 4 steps each
                                                     # (a smoke test: 1 repeat, a short matmul peak)

The model is small, so that 8 processes run on 2 cores: language_model.Decoder with --dim 32 --n_layers 4
--n_heads 8 --n_kv_heads 4 --hidden 64 --seq_len 16 (53,536 parameters; 4 key/value heads, so that --tp 4 divides
them), global batch 64, trained on the first characters of language_model.read_text() (written to a file for
--data): as many as give --steps whole steps (8; --quick 4). One torchrun job per world size runs its layouts one
after the other: a worker imports each script and calls its own main() (the script's model, mesh,
parallelization and Trainer, under a process group the worker opened), with the script's Trainer._run_batch
wrapped to read, before and after every step, what each TCP socket of the process was given to send (getsockopt
TCP_INFO on the sockets under /proc/self/fd: bytes_sent - bytes_retrans + notsent_bytes, the kernel's counts;
gloo's headers included). Counted is the difference from the start of the second step to the end of the last (the
first step also infers the pipeline's shapes and runs CommDebugMode), over the steps; the bytes given between two
steps are recorded too (0: nothing but the steps talks). Start-up, the store and the checkpoint lie outside the
window. The second step also records its peak memory, by plan.py's tracker (plan.peak_of_step), for the planner's
test. Each socket's peer is mapped to the rank that owns its other end, so the JSON says which rank sent what to
which.

The formula, per rank and step, for s = 4 bytes an element, b sequences of S positions per data-parallel rank in a
step, width D, n ranks in a group, a = b x S x D x s the bytes of one activation [b, S, D]: a ring all-reduce sends
2(n-1)/n of the tensor's bytes, an all-gather (n-1)/n, and gloo's reduce-scatter as much as its all-reduce,
2(n-1)/n, where NCCL's ring sends (n-1)/n (each job measures these first):
- tp, sequence parallel: per layer 2 all-gathers of a (before attention and the MLP) and 2 reduce-scatters (after
  o_proj and down_proj) forward, the same backward; the embedding (split over the vocabulary) reduce-scatters its
  partial output over the sequence (no all-reduce) and all-gathers its gradient, lm_head all-gathers its input
  and reduce-scatters its gradient; loss_parallel all-reduces 3 numbers a token (the logits' max, the sum of
  exponentials, the target's logit); each norm's weight gradient (partial sums over tp) is all-reduced once
  before the optimizer (the scripts' settle_grads; under FSDP2, FSDP2 itself);
- pp: a/tp (a tp rank's slice of the sequence) of activations to the next stage, as much of their gradients to the
  one before, for each of the rank's stages whose neighbour lives on another rank (looped and V schedules: 2
  stages a rank);
- FSDP2 over dp_shard: each layer and the rest of the stage (each rank's tp piece, each parameter padded to a
  multiple of dp_shard rows) all-gathered twice without a pipeline (forward and backward: reshard_after_forward
  True, which the script passes, so the root is resharded too), once under a pipeline (reshard_after_forward
  False: kept from the first forward to the last backward), m + 1 times if resharded after each of m forwards
  (GPipe; the worker passes True); every gradient reduce-scattered once;
- HSDP: the shards' gradients all-reduced over dp_replicate too (DDP-like: dp_shard 1, only this).
Speed: tokens/s as each script's Summary line says it (its wall: every step and the checkpoint), and from the
slowest rank's median step; model FLOPs a token 6 x parameters + 12 x layers x S x D (the attention's scores and
weighted sums, forward and backward), their rate (MFU) against the machine's float32 matmul peak, measured here
before and after the runs (the best of one thread's FLOP/s times the cores and all threads' at once). One
process: nd_parallel.py's median step against plain_loop()'s (the same Decoder, AdamW, cross-entropy and global
batch, no schedule, no DTensor), --repeats runs of each in one process, alternating.
Writes parallel_bytes.json and parallel_bytes.png to --out (default benchmarks/results).
"""
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file: make the repository importable
import torch
import torch.nn.functional as F

from benchmarks import common, report
from benchmarks.launches import BIN, REPO, clean_env
from language_model import Decoder, DecoderConfig, read_text, text_splits
from nd_parallel import LOOPED, V_SHAPED, stage_indices  # the stages a rank runs, as the scripts place them

CONFIG = DecoderConfig(dim=32, n_layers=4, n_heads=8, n_kv_heads=4, hidden=64, max_seq_len=16)
MODEL_FLAGS = (f"--dim {CONFIG.dim} --n_layers {CONFIG.n_layers} --n_heads {CONFIG.n_heads} --n_kv_heads "
               f"{CONFIG.n_kv_heads} --hidden {CONFIG.hidden} --seq_len {CONFIG.max_seq_len}")
GPIPE_4 = "--schedule gpipe --microbatches 4"
# name, processes, script, its arguments, what the worker changes (reshard: FSDP2's reshard_after_forward=True).
LAYOUTS = [
    ("DDP-like 2", 2, "nd_parallel.py", "--dp 2 --dp_replicate 2", ""),
    ("FSDP2 2", 2, "nd_parallel.py", "--dp 2", ""),
    ("TP 2", 2, "tensor_parallel.py", "", ""),
    ("PP 2", 2, "pipeline_parallel.py", "--microbatches 4", ""),
    ("PP 2, V (zbv)", 2, "pipeline_parallel.py", "--schedule zbv --microbatches 4", ""),
    ("DDP-like 4", 4, "nd_parallel.py", "--dp 4 --dp_replicate 4", ""),
    ("FSDP2 4", 4, "nd_parallel.py", "--dp 4", ""),
    ("TP 4", 4, "tensor_parallel.py", "", ""),
    ("PP 4", 4, "pipeline_parallel.py", "--microbatches 4", ""),
    ("FSDP2 x TP 2x2", 4, "nd_parallel.py", "--dp 2 --tp 2", ""),
    ("HSDP 2x2", 4, "nd_parallel.py", "--dp 4 --dp_replicate 2", ""),
    ("FSDP2 x PP 2x2", 4, "nd_parallel.py", f"--dp 2 --pp 2 {GPIPE_4}", ""),
    ("FSDP2 x PP 2x2, resharded", 4, "nd_parallel.py", f"--dp 2 --pp 2 {GPIPE_4}", "reshard"),
    ("3-D 2x2x2", 8, "nd_parallel.py", "--dp 2 --tp 2 --pp 2", ""),
    ("one process", 1, "nd_parallel.py", "", ""),
]
WARMUP = 1  # steps left out of the window

WORKER = r'''
import contextlib, importlib, io, json, os, socket, struct, sys, time
sys.path.insert(0, {repo!r})
import torch
import torch.distributed as dist
from plan import peak_of_step

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
    steps, peaks = [], []
    run_batch = module.Trainer._run_batch

    def wrapped(self, *args, **kwargs):
        before = (time.perf_counter(), sockets())
        if len(steps) == 1:  # the second step, the first steady one: its peak memory too, as plan.py counts it
            result, peak = peak_of_step(self, lambda: run_batch(self, *args, **kwargs))
            peaks.append(peak)
        else:
            result = run_batch(self, *args, **kwargs)
        steps.append((before, (time.perf_counter(), sockets())))
        return result

    module.Trainer._run_batch = wrapped
    return steps, run_batch, peaks


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


class Tee(io.TextIOBase):
    """What the script prints, printed and kept."""
    def __init__(self, stream):
        self.stream, self.kept = stream, []

    def write(self, text):
        self.kept.append(text)
        return self.stream.write(text)

    def flush(self):
        self.stream.flush()


out, layouts = sys.argv[1], json.loads(sys.argv[2])
dist.init_process_group("gloo")  # the scripts' main() uses it, and leaves it open for the next layout
rank = dist.get_rank()
factors = calibrate() if dist.get_world_size() > 1 else {{}}
records, plain = [], []
for index, (name, script, arguments, change) in enumerate(layouts):
    if dist.get_world_size() == 1:  # one process: the plain loop of the same model and data first, each time
        from benchmarks.parallel_bytes import plain_loop
        plain.append(plain_loop(arguments))
    module = importlib.import_module(script[:-3])
    steps, run_batch, peaks = counted(module)
    arguments = [*arguments, "--snapshot_path", os.path.join(out, f"checkpoints-{{index}}")]
    if change == "reshard":  # FSDP2's other choice under a pipeline: reshard after each micro-batch's forward
        shard = module.fully_shard
        module.fully_shard = lambda *args, **kwargs: shard(*args, **{{**kwargs, "reshard_after_forward": True}})
    tee = Tee(sys.stdout)
    try:
        with contextlib.redirect_stdout(tee):
            module.main(module.parse_args(arguments))
    finally:
        module.Trainer._run_batch = run_batch
        if change == "reshard":
            module.fully_shard = shard
    summary = [line for line in "".join(tee.kept).splitlines() if line.startswith("Summary:")]
    records.append({{"name": name, "summary": summary[0] if summary else None, "peak_bytes": (peaks or [None])[0],
                    "steps": [[[t, list(map(list, c.items()))] for t, c in pair] for pair in steps]}})
    dist.barrier()
with open(os.path.join(out, f"rank{{rank}}.json"), "w") as f:
    json.dump({{"rank": rank, "pid": os.getpid(), "collectives": factors, "layouts": records, "plain": plain}}, f)
dist.destroy_process_group()
'''


def flag(arguments, name, default=None):
    """A flag's value in a script's argument list."""
    return arguments[arguments.index(name) + 1] if name in arguments else default


def plain_loop(arguments):
    """A plain training loop of the decoder the layout trains, on the same text and global batch: Decoder, AdamW
    (lr 3e-3, betas (0.9, 0.95), weight decay 0.1, as the scripts), the mean cross-entropy, one step a global
    batch in order. Returns each step's seconds, the loop's wall and tokens, and the mean loss of its steps."""
    config = DecoderConfig(**{name: int(flag(arguments, f"--{name}")) for name in
                              ("dim", "n_layers", "n_heads", "n_kv_heads", "hidden")},
                           max_seq_len=int(flag(arguments, "--seq_len")))
    batch = int(flag(arguments, "--global_batch_size"))
    train_set, _ = text_splits(read_text(flag(arguments, "--data"))[0], config.max_seq_len)
    model = Decoder(config).init_weights(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    steps, losses, start = [], [], time.perf_counter()
    for first in range(0, len(train_set) // batch * batch, batch):
        source, targets = train_set[list(range(first, first + batch))]
        before = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(source).flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        steps.append(time.perf_counter() - before)
        losses.append(loss.detach())
    return {"step_s": steps, "wall_s": time.perf_counter() - start,
            "tokens": len(steps) * batch * config.max_seq_len, "mean_loss": torch.stack(losses).mean().item()}


def matmul_peak(threads, size=1024, seconds=0.5, trials=3):
    """A float32 [size, size] @ [size, size] matmul's FLOP/s on `threads` threads: the best of `trials`."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        a @ b  # the first call allocates
        best = 0
        for _ in range(trials):
            n, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds:
                a @ b
                n += 1
            best = max(best, 2 * size ** 3 * n / (time.perf_counter() - start))
        return best
    finally:
        torch.set_num_threads(saved)


def text_file(path, steps, batch, seq_len):
    """The shortest start of read_text()'s text whose training split holds `steps` global batches, written to
    `path`; returns its characters and what it is."""
    text, about = read_text()

    def whole_steps(chars):
        return len(text_splits(text[:chars], seq_len)[0]) // batch

    low, high = 1, len(text)
    if whole_steps(high) < steps:
        raise common.UsageError(f"the text ({about}) holds {whole_steps(high)} steps of {batch} sequences; "
                                f"ask for fewer --steps")
    while low < high:  # the fewest characters that give `steps` steps (more characters never give fewer)
        middle = (low + high) // 2
        low, high = (middle + 1, high) if whole_steps(middle) < steps else (low, middle)
    Path(path).write_text(text[:low], encoding="utf-8")
    return low, about


def arguments_of(flags, args, data):
    """A layout's flags and the run's: the model, the text, one epoch, one checkpoint at its end (outside the
    window), no loss lines between steps, no sample."""
    return [*flags.split(), *MODEL_FLAGS.split(), "--data", str(data), "--total_epochs", "1", "--save_every", "1",
            "--global_batch_size", str(args.global_batch_size), "--log_every", "0", "--sample", "0"]


def mesh_of(script, world_size, arguments):
    """(pp, dp_replicate, dp_shard, tp, micro-batches, schedule) of a layout, as the script reads its flags."""
    schedule = flag(arguments, "--schedule", "1f1b")
    if script == "tensor_parallel.py":
        return 1, 1, 1, world_size, 1, None
    tp = 1 if script == "pipeline_parallel.py" else int(flag(arguments, "--tp", 1))
    pp = world_size if script == "pipeline_parallel.py" else int(flag(arguments, "--pp", 1))
    dp = int(flag(arguments, "--dp", world_size // (tp * pp)))
    replicate = int(flag(arguments, "--dp_replicate", 1))
    microbatches = int(flag(arguments, "--microbatches", pp * (2 if schedule in LOOPED | V_SHAPED else 1)))
    return pp, replicate, dp // replicate, tp, microbatches, schedule


def units(config, stage, stages, tp):
    """FSDP2's units of a stage (each layer, then the rest of the stage), each a list of its parameters' local
    shapes (rows, elements a row) on a tp rank: q, k, v, gate and up split by rows, o and down by columns, the
    embedding and lm_head by the vocabulary, the norms whole."""
    d, heads, kv = config.dim, config.n_heads * (config.dim // config.n_heads), \
        config.n_kv_heads * (config.dim // config.n_heads)
    layer = [(heads // tp, d), (kv // tp, d), (kv // tp, d), (d, heads // tp),  # q, k, v, o
             (config.hidden // tp, d), (config.hidden // tp, d), (d, config.hidden // tp),  # gate, up, down
             (d, 1), (d, 1)]  # the two norms
    first, end = config.n_layers * stage // stages, config.n_layers * (stage + 1) // stages
    rest = [(config.vocab_size // tp, d)] * (stage == 0) + [(d, 1), (config.vocab_size // tp, d)] * \
        (stage == stages - 1)  # embed_tokens; norm, lm_head
    return [layer] * (end - first) + [rest], end - first


def formula(mesh, rank, batch, config=CONFIG, itemsize=4, reduce_scatter=1, reshard=False):
    """The bytes `rank` sends in a step by the formula, by part: {part: bytes}. reduce_scatter: the ring's (n-1)/n
    of the bytes times this; gloo's reduce_scatter_tensor sends what an all-reduce sends, 2 (calibrate()).
    reshard: FSDP2 reshards each layer after each forward under the pipeline (GPipe: m forwards, then the first
    backward gathers once more)."""
    pp, replicate, shard, tp, microbatches, schedule = mesh
    if reshard and (pp == 1 or schedule != "gpipe"):
        raise ValueError("the formula of FSDP2 resharded after each forward is GPipe's, under a pipeline")
    pp_rank = rank // (replicate * shard * tp)
    held = stage_indices(pp_rank, pp, schedule)
    stages = pp * len(held)
    owner = {s: r for r in range(pp) for s in stage_indices(r, pp, schedule)}  # stage: its pipeline rank
    b = batch // (replicate * shard)  # sequences per data-parallel rank in a step, all micro-batches together
    seq, dim = config.max_seq_len, config.dim
    activation = b * seq * dim * itemsize  # one [b, seq, dim] tensor of the whole step
    parts = dict.fromkeys(("tp all-gather", "tp reduce-scatter", "tp loss all-reduce", "tp norm all-reduce",
                           "FSDP all-gather", "FSDP reduce-scatter", "HSDP all-reduce", "pp send"), 0)
    for stage in held:
        first, last = stage == 0, stage == stages - 1
        stage_units, layers = units(config, stage, stages, tp)
        if tp > 1:
            # Per layer, forward: the norms' outputs all-gathered over the sequence before attention and the MLP,
            # o_proj's and down_proj's partial sums reduce-scattered over it; backward, the same the other way.
            # The embedding's output is reduce-scattered (forward) and its gradient all-gathered (backward);
            # lm_head's input all-gathered (forward), its gradient reduce-scattered (backward).
            count = 4 * layers + first + last
            parts["tp all-gather"] += count * (tp - 1) / tp * activation
            parts["tp reduce-scatter"] += reduce_scatter * count * (tp - 1) / tp * activation
            # loss_parallel: 3 all-reduces of one number a token (max, sum of exponentials, the target's logit).
            parts["tp loss all-reduce"] += last * 3 * 2 * (tp - 1) / tp * b * seq * itemsize
            # The norms' weight gradients, partial sums over tp: each all-reduced once before the optimizer
            # (settle_grads; under FSDP2 by FSDP2, before its reduce-scatter).
            parts["tp norm all-reduce"] += (2 * layers + last) * 2 * (tp - 1) / tp * dim * itemsize
        if replicate * shard > 1:  # the scripts shard with FSDP2 whenever there is data parallelism
            padded = [sum(-(-rows // shard) * shard * row for rows, row in unit) for unit in stage_units]
            layer_bytes, rest_bytes = sum(padded[:-1]) * itemsize, padded[-1] * itemsize
            if pp == 1:  # resharded after forward: gathered in forward and again in backward
                gathers = 2 * (layer_bytes + rest_bytes)
            elif reshard:  # each micro-batch's forward gathers; the first backward gathers, the rest keep it
                gathers = (microbatches + 1) * (layer_bytes + rest_bytes)
            else:  # gathered by the first forward, kept to the last backward
                gathers = layer_bytes + rest_bytes
            parts["FSDP all-gather"] += (shard - 1) / shard * gathers
            parts["FSDP reduce-scatter"] += reduce_scatter * (shard - 1) / shard * (layer_bytes + rest_bytes)
            parts["HSDP all-reduce"] += 2 * (replicate - 1) / replicate * (layer_bytes + rest_bytes) / shard
        # Pipeline: the stage's output to the next stage, the gradient of its input to the one before, where
        # that stage is on another rank; under tp each tp rank sends its slice of the sequence.
        crossings = (not last and owner[stage + 1] != pp_rank) + (not first and owner[stage - 1] != pp_rank)
        parts["pp send"] += crossings * activation / tp
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
                                f"first {WARMUP}; ask for more --steps")
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


def summary_tokens(line):
    """The tokens/s a script's Summary line reports."""
    found = re.search(r"tokens/s ([0-9.]+)", line or "")
    if not found:
        raise common.UsageError(f"no tokens/s in the script's Summary line: {line!r}")
    return float(found.group(1))


def shown(arguments, data):
    """A layout's arguments as the JSON shows them: the text as text.txt (its characters are in "text")."""
    return " ".join(arguments).replace(str(data), "text.txt")


def run_job(world_size, plan, args, tmp):
    """One torchrun job of the worker over `plan`'s layouts: each rank's record."""
    out = Path(tmp) / f"n{world_size}"
    out.mkdir()
    command = [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={world_size}", str(Path(tmp) / "worker.py"),
               str(out), json.dumps(plan)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, cwd=REPO,
                              env=clean_env(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=""))
    except subprocess.TimeoutExpired:
        raise common.UsageError(f"the {world_size}-process job took over --timeout {args.timeout:g}s") from None
    if done.returncode != 0:  # the script's one line, or the output's last
        lines = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("=" * 10)]
        said = next((line for line in lines if "error:" in line), (lines or ["no output"])[-1])
        raise common.UsageError(f"the {world_size}-process job failed (exit {done.returncode}): {said.strip()}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]


def run_world(world_size, layouts, args, tmp, data):
    """The layouts of `world_size` processes: each rank's bytes beside the formula, and the speed."""
    plan = [[name, script, arguments_of(flags, args, data), change] for name, _, script, flags, change in layouts]
    ranks = run_job(world_size, plan, args, tmp)
    owner = owners(ranks)
    results = []
    tokens = args.global_batch_size * CONFIG.max_seq_len  # a step's
    for index, (name, _, script, flags, change) in enumerate(layouts):
        arguments = arguments_of(flags, args, data)
        mesh = mesh_of(script, world_size, arguments)
        command = f"torchrun --standalone --nproc_per_node={world_size} {script} {shown(arguments, data)}"
        rows = []
        for record in ranks:
            per_step, to, seconds, between = measured(record, index, owner)
            parts = formula(mesh, record["rank"], args.global_batch_size, reduce_scatter=2,
                            reshard=change == "reshard")
            textbook = sum(formula(mesh, record["rank"], args.global_batch_size, reshard=change == "reshard")
                           .values())
            rows.append({"rank": record["rank"], "bytes_per_step": per_step, "to": to, "between_steps": between,
                         "peak_bytes": record["layouts"][index]["peak_bytes"],
                         "formula": parts, "formula_bytes": sum(parts.values()), "textbook_bytes": textbook,
                         "ratio": per_step / sum(parts.values()), "step_s": seconds})
        step_s = max(row["step_s"] for row in rows)
        summary = ranks[0]["layouts"][index]["summary"]
        results.append({"layout": name, "processes": world_size, "command": command, "worker_change": change or None,
                        "mesh": dict(zip(("pp", "dp_replicate", "dp_shard", "tp", "microbatches", "schedule"), mesh)),
                        "steps_counted": len(ranks[0]["layouts"][index]["steps"]) - WARMUP, "step_s": step_s,
                        "tokens_per_s_steps": tokens / step_s, "summary": summary,
                        "tokens_per_s_summary": summary_tokens(summary), "ranks": rows})
    return results, ranks[0]["collectives"]


def one_process(args, tmp, data):
    """nd_parallel.py on one process against plain_loop(), --repeats times each, one after the other in one
    process (the plain loop first): their median steps, over every run's counted steps."""
    name, _, script, flags, _ = next(layout for layout in LAYOUTS if layout[1] == 1)
    arguments = arguments_of(flags, args, data)
    record, = run_job(1, [[name, script, arguments, ""]] * args.repeats, args, tmp)
    runs = [[after[0] - before[0] for before, after in layout["steps"][WARMUP:]] for layout in record["layouts"]]
    plain = [run["step_s"][WARMUP:] for run in record["plain"]]
    script_step, plain_step = (statistics.median(s for run in found for s in run) for found in (runs, plain))
    tokens = args.global_batch_size * CONFIG.max_seq_len
    return {"command": f"torchrun --standalone --nproc_per_node=1 {script} {shown(arguments, data)}",
            "repeats": args.repeats, "steps_counted": len(runs[0]), "step_s": script_step,
            "run_medians_s": [statistics.median(run) for run in runs], "tokens_per_s_steps": tokens / script_step,
            "summaries": [layout["summary"] for layout in record["layouts"]],
            "tokens_per_s_summary": statistics.median(summary_tokens(layout["summary"])
                                                      for layout in record["layouts"]),
            "plain_step_s": plain_step, "plain_run_medians_s": [statistics.median(run) for run in plain],
            "plain_tokens_per_s": statistics.median(run["tokens"] / run["wall_s"] for run in record["plain"]),
            "plain_mean_loss": [run["mean_loss"] for run in record["plain"]], "cost": script_step / plain_step - 1}


def plot(results, single, args, parameters, path):
    plt = report.pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5.5), gridspec_kw={"width_ratios": [3, 1]})
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
    right.barh([*names, "one process", "plain loop"],
               [r["tokens_per_s_steps"] for r in results] + [single["tokens_per_s_steps"],
                                                             args.global_batch_size * CONFIG.max_seq_len /
                                                             single["plain_step_s"]])
    right.invert_yaxis()
    right.set_xlabel("tokens/s, median step (CPU, gloo)")
    fig.suptitle(f"Bytes each rank sends per training step: Decoder of {parameters:,} parameters (dim {CONFIG.dim}, "
                 f"{CONFIG.n_layers} layers, {CONFIG.max_seq_len} positions), global batch {args.global_batch_size}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(args):
    args.steps = args.steps or (4 if args.quick else 8)
    args.repeats = args.repeats or (1 if args.quick else 5)
    # --quick, a smoke test: each matmul peak timed once for 0.1 s, not the best of 3 of 0.5 s on every core.
    timing = {"seconds": 0.1, "trials": 1} if args.quick else {}
    if args.steps <= WARMUP:
        raise common.UsageError(f"--steps {args.steps}: the first {WARMUP} is not counted; ask for more")
    if args.global_batch_size % 8:
        raise common.UsageError(f"--global_batch_size {args.global_batch_size}: 8 must divide it (4 data-parallel "
                                "ranks, 4 micro-batches, 2 data-parallel ranks of 4 micro-batches)")
    layouts = [layout for layout in LAYOUTS if layout[1] > 1 and (not args.quick or layout[1] == 2)]
    load_before = report.machine()["load_average_1_5_15min"]  # the machine is recorded at the end, with this
    cores = len(os.sched_getaffinity(0))
    peaks = [(matmul_peak(1, **timing), matmul_peak(cores, **timing))]  # again after the runs: the load changes
    parameters = sum(p.numel() for p in Decoder(CONFIG).parameters())
    # Per token: 6 FLOPs a parameter (2 forward, 4 backward); attention's scores and weighted sums, 2 matmuls of
    # seq x dim a token and layer, 2 FLOPs each, forward and twice that backward: 12 x layers x seq x dim.
    flops_per_token = 6 * parameters + 12 * CONFIG.n_layers * CONFIG.max_seq_len * CONFIG.dim
    results, collectives = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "text.txt"
        chars, about = text_file(data, args.steps, args.global_batch_size, CONFIG.max_seq_len)
        (Path(tmp) / "worker.py").write_text(WORKER.format(repo=str(REPO)))
        single = one_process(args, tmp, data)
        for world_size in sorted({layout[1] for layout in layouts}):
            found, collectives[world_size] = run_world(world_size, [layout for layout in layouts
                                                                    if layout[1] == world_size], args, tmp, data)
            results += found
    peaks.append((matmul_peak(1, **timing), matmul_peak(cores, **timing)))
    # The machine's peak: the best of one thread's matmul times the cores and all threads' at once, before and
    # after the runs (other work on the cores slows a matmul, and one of several threads waits for the slowest).
    one_thread, all_threads = (max(column) for column in zip(*peaks))
    peak = {"flops": max(cores * one_thread, all_threads), "one_thread_flops": one_thread,
            "all_threads_flops": all_threads, "threads": cores, "measured": peaks}
    for r in [*results, single]:
        r["mfu"] = r["tokens_per_s_steps"] * flops_per_token / peak["flops"]
        r["mfu_summary"] = r["tokens_per_s_summary"] * flops_per_token / peak["flops"]
    info = report.machine("gloo")
    print(report.machine_line(info))
    rows = []
    for r in results:
        for row in r["ranks"]:
            rows.append([r["layout"] if row["rank"] == 0 else "", row["rank"], f"{row['bytes_per_step']:,.0f}",
                         f"{row['formula_bytes']:,}", f"{row['ratio']:.3f}",
                         ", ".join(f"{peer} {value:,.0f}" for peer, value in row["to"].items())])
    print(report.table(["layout", "rank", "bytes sent/step", "formula", "measured/formula", "to rank: bytes"], rows))
    for world_size, factors in collectives.items():
        print(f"gloo, {world_size} ranks, bytes sent per byte of the tensor: " +
              ", ".join(f"{name} {factor:.3f}" for name, factor in factors.items()))
    print(f"Model FLOPs a token: 6 x {parameters:,} parameters + 12 x {CONFIG.n_layers} layers x "
          f"{CONFIG.max_seq_len} positions x {CONFIG.dim} = {flops_per_token:,}. Peak: a float32 matmul "
          f"{one_thread / 1e9:.1f} GFLOP/s on 1 thread, {all_threads / 1e9:.1f} on {cores} at once (the best before "
          f"and after the runs: {', '.join(f'{a / 1e9:.1f} and {b / 1e9:.1f}' for a, b in peaks)}): "
          f"{peak['flops'] / 1e9:.1f} GFLOP/s for {cores} cores")
    speed = [[r["layout"], r["processes"], f"{1000 * r['step_s']:.1f}", f"{r['tokens_per_s_steps']:,.0f}",
              f"{r['tokens_per_s_summary']:,.0f}", f"{100 * r['mfu']:.2f}%"]
             for r in [*results, {**single, "layout": "one process", "processes": 1}]]
    print(report.table(["layout", "processes", "step ms", "tokens/s (steps)", "tokens/s (Summary)", "MFU"], speed))
    print(f"One process: nd_parallel.py {1000 * single['step_s']:.2f} ms a step, a plain loop of the same model "
          f"and data {1000 * single['plain_step_s']:.2f} ms: {100 * single['cost']:+.1f}% (medians of "
          f"{single['repeats']} runs of {single['steps_counted']} steps each, the two alternating)")
    out = Path(args.out)
    report.write_json(out / "parallel_bytes.json", {
        "machine": info, "load_average_before": load_before, "torch": info["torch"], "backend": "gloo",
        "global_batch_size": args.global_batch_size, "steps": args.steps,
        "text": {"file": "text.txt", "characters": chars, "of": about,
                 "made": f"language_model.read_text()[0][:{chars}]"},
        "model": {**vars(CONFIG), "parameters": parameters}, "flops_per_token": flops_per_token,
        "matmul_peak": peak, "warmup_steps": WARMUP, "quick": args.quick, "collectives": collectives,
        "results": results, "one_process": single})
    plot(results, single, args, parameters, out / "parallel_bytes.png")
    print(f"Wrote {out / 'parallel_bytes.json'} and {out / 'parallel_bytes.png'}")


if __name__ == "__main__":
    parser = common.ArgumentParser(description=__doc__, formatter_class=common.argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the 2-process layouts and one process, 4 steps each")
    parser.add_argument("--steps", type=common.positive_int, help="steps each layout trains (default 8; --quick 4)")
    parser.add_argument("--global_batch_size", type=common.positive_int, default=64,
                        help="sequences a step over all ranks (default 64)")
    parser.add_argument("--repeats", type=common.positive_int,
                        help="runs of nd_parallel.py on one process and of the plain loop, alternating (default 5; "
                             "--quick 1)")
    parser.add_argument("--timeout", type=common.positive_float, default=900, help="seconds for each job")
    parser.add_argument("--out", default=report.DEFAULT_OUT, help="folder of parallel_bytes.json and .png")
    common.run(main, parser)
