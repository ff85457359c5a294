"""Training throughput of DDP at world sizes 1, 2 and 4, against what the machine could give it.

    python benchmarks/scaling.py                                   # MLP, linear, SimpleCNN at 1, 2 and 4 ranks
    python benchmarks/scaling.py --quick --world_sizes 1 2         # a smoke run in seconds
    python benchmarks/scaling.py --models cnn --world_sizes 1 2 --profile    # why DDP is slower, variant by variant
    python benchmarks/scaling.py --models cnn --world_sizes 1 2 --comm_hook none fp16 bf16 powersgd --zero
                                                  # sending less, side by side, with accuracy on MNIST

Each world size is one mp.spawn of N processes (gloo on 127.0.0.1 at a free port; NCCL when every rank
has a GPU), each with --threads intra-op threads (default 1). Every process runs, interleaved, for
each model and repeat:
  independent  the same loop without DDP and without any communication, all N at the same time: the
               ceiling, which already contains whatever the machine loses to N busy processes
               (shared cores, memory bandwidth, other users' load);
  ddp          the model wrapped in DistributedDataParallel.
samples/s = N * batch * steps / (wall time of the slowest rank); each figure is the median of --repeats.
  scaling efficiency  = ddp(N) / (N * ddp(1))
  vs ceiling          = ddp(N) / independent(N): what DDP itself costs
  DDP overhead at 1   = independent(1) / ddp(1) - 1: DDP's cost when there is nothing to communicate
The loop feeds pre-built batches and never reads the loss back per step, so the data loader and host
syncs stay out of the figures; --profile measures them, DDP's bucket settings and Join, one at a time.
--comm_hook (several) and --zero add a DDP loop per setting, each with the bytes it hands to all-reduce per
step, and for SimpleCNN the held-out accuracy after --accuracy_steps steps of training on 8,000 MNIST
images (evaluated on the other 2,000 of the test set, the tests' split; --quick: 200 of them) with that setting.
Targets (SimpleCNN, batch 64 per rank, 1 thread per rank): ddp >= 0.9 x ceiling at 2 ranks, and at
most 5% DDP overhead at 1 rank; with --comm_hook/--zero, some setting >= 0.9 x ceiling at 2 ranks with
accuracy within 0.5 points of no compression. Writes scaling.json and scaling.png (and scaling-comm.png
with several settings; profile.json with --profile) to --out.
"""
import ast
import contextlib
import json
import os
import statistics
import sys
import textwrap
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file: make the repository importable
from benchmarks import comm_hooks, common, report
import torch.distributed.nn  # before any process group: docs/failures.md, clean exits
from benchmarks.comm_hooks import CommHook
from benchmarks.common import UsageError, check_backend, free_port
from models_and_data import MLP, LinearClassifier, mnist_splits


MNIST_MEAN, MNIST_STD = 0.1307, 0.3081  # of the MNIST training pixels scaled to 0..1


def mnist_tensors(data_dir):
    """(train, eval) TensorDatasets of normalised images (N, 1, 28, 28) and int64 labels: the official split, or
    with data/mnist's test set alone, its 8,000 / 2,000 split (models_and_data.mnist_splits, the tests' split).
    Missing or broken files: a UsageError."""
    try:
        splits = mnist_splits(str(data_dir))[:2]
    except (OSError, ValueError) as error:
        raise UsageError(f"--data_dir {data_dir}: {error}") from None
    return tuple(TensorDataset((images.reshape(-1, 1, 28, 28).float() / 255 - MNIST_MEAN) / MNIST_STD, labels)
                 for images, labels in splits)


def synchronize(device):
    """Wait for the device to finish: GPUs run asynchronously, so a clock read without this stops early."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def train_py_class(name):
    """A class of train.py (its SimpleCNN, for the MNIST rows) without importing train.py: its transformers and
    datasets imports cost seconds of CPU in this process and in each spawned rank, and the class needs only torch."""
    source = (Path(__file__).resolve().parent.parent / "train.py").read_text()
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == name)
    namespace = {"torch": torch, "nn": torch.nn, "F": F}
    exec(compile(ast.Module([node], type_ignores=[]), "train.py", "exec"), namespace)
    return namespace[name]


SimpleCNN = train_py_class("SimpleCNN")
# name: (model, per-rank batch, one sample's shape, labels (classes) or regression targets (None), description)
MODELS = {
    "mlp": (lambda: MLP(input_size=20), 32, (20,), None, "tutorial MLP 20-64-64-1, batch 32"),
    "linear": (lambda: LinearClassifier(100, 2), 32, (100,), 2, "linear classifier 100->2, batch 32"),
    "cnn": (SimpleCNN, 64, (1, 28, 28), 10, "SimpleCNN on 28x28, batch 64"),
}
# The DDP settings of the benchmark loop. gradient_as_bucket_view makes the gradients views into DDP's
# communication buckets, so no copy of every gradient into (and out of) a bucket each step.
DDP_SETTINGS = {"gradient_as_bucket_view": True}
# One change at a time against the tutorial's DDP(model) on pre-built batches; see --profile.
PROFILE_VARIANTS = {
    "independent (ceiling)": {"mode": "independent"},
    "independent + DataLoader": {"mode": "independent", "loader": True},
    "ddp defaults": {"ddp": {}},
    "ddp defaults + DataLoader (tutorial)": {"ddp": {}, "loader": True},
    "ddp defaults + loss.item() every step": {"ddp": {}, "item": True},
    "ddp gradient_as_bucket_view": {"ddp": {"gradient_as_bucket_view": True}},
    "ddp static_graph": {"ddp": {"static_graph": True}},
    "ddp bucket_view + static_graph": {"ddp": {"gradient_as_bucket_view": True, "static_graph": True}},
    "ddp bucket_cap_mb=1": {"ddp": {"bucket_cap_mb": 1}},
    "ddp bucket_cap_mb=100": {"ddp": {"bucket_cap_mb": 100}},
    # What Join costs when nobody runs out early: two 1-element all-reduces per forward pass (README: uneven data).
    "ddp defaults inside Join": {"ddp": {}, "join": True},
}
TARGET_VS_CEILING, TARGET_OVERHEAD, TARGET_ACCURACY_POINTS = 0.9, 0.05, 0.5
ACCURACY_LR = 0.05  # SGD, momentum 0.9: SimpleCNN reaches about 98% on the split in 300 steps of 128 images


def make_batches(model_name, count, device, seed):
    _, batch, shape, classes, _ = MODELS[model_name]
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(count * batch, *shape, generator=generator)
    y = torch.randint(0, classes, (count * batch,), generator=generator) if classes else \
        torch.randn(count * batch, 1, generator=generator)
    return TensorDataset(x.to(device), y.to(device))


def loss_of(model_name, model, x, y):
    if model_name == "cnn":
        return model(x, labels=y)["loss"]
    return F.mse_loss(model(x), y) if MODELS[model_name][3] is None else F.cross_entropy(model(x), y)


class Case:
    """One loop to time: a model, with or without DDP (and a communication hook, ZeRO), fed from tensors or the
    tutorial's DataLoader."""

    def __init__(self, model_name, mode="ddp", ddp=None, loader=False, item=False, join=False, hook="none",
                 zero=False):
        self.model_name, self.mode, self.loader, self.item, self.join = model_name, mode, loader, item, join
        self.ddp_kwargs = DDP_SETTINGS if ddp is None else ddp
        self.hook, self.zero = hook, zero

    def build(self, device, args, lr=0.01):
        """A fresh model (seed 0), wrapped as this case says, its optimizer and its communication hook."""
        torch.manual_seed(0)
        model = MODELS[self.model_name][0]().to(device)
        hook = None
        if self.mode == "ddp":
            model = DDP(model, device_ids=[device.index] if device.type != "cpu" else None, **self.ddp_kwargs)
            hook = CommHook(self.hook, args.powersgd_rank, args.powersgd_warmup)
            if (registration := hook.prepare(model)) is not None:
                model.register_comm_hook(*registration)
        if self.zero:
            optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=lr,
                                                momentum=0.9)
        else:
            optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        return model, optimizer, hook

    def setup(self, device, rank, world_size, args):
        """(model, optimizer, batches, hook) for run()."""
        model, optimizer, hook = self.build(device, args)
        batch = MODELS[self.model_name][1]
        dataset = make_batches(self.model_name, 8 * world_size, device, seed=0)
        if self.loader:
            # What the tutorial scripts do: per-sample indexing and collation by the DataLoader.
            data = DataLoader(dataset, batch_size=batch, sampler=DistributedSampler(dataset, world_size, rank))
        else:
            x, y = dataset.tensors
            data = [(x[i:i + batch], y[i:i + batch]) for i in range(rank * 8 * batch, (rank + 1) * 8 * batch, batch)]
        return model, optimizer, data, hook

    def run(self, model, optimizer, data, hook, steps):
        with Join([model]) if self.join else contextlib.nullcontext():
            self._steps(model, optimizer, data, steps)

    def _steps(self, model, optimizer, data, steps):
        done = 0
        while done < steps:
            for x, y in data:
                optimizer.zero_grad(set_to_none=True)
                loss = loss_of(self.model_name, model, x, y)
                loss.backward()
                optimizer.step()
                if self.item:
                    loss.item()  # a host sync, as a per-step log line would make
                done += 1
                if done == steps:
                    break


def timed(case, state, steps, device):
    dist.barrier()  # every rank starts together, so the independent loops really run at the same time
    start = time.perf_counter()
    case.run(*state, steps)
    synchronize(device)
    return report.slowest([time.perf_counter() - start], device)[0]


def held_out_accuracy(case, device, rank, world_size, args):
    """Train a fresh SimpleCNN with this case's settings for --accuracy_steps steps on 8,000 MNIST images
    (batch 64 per rank, a new shuffle each epoch), then score it on the other 2,000, each image on one rank."""
    train_set, eval_set = mnist_tensors(args.data_dir)
    model, optimizer, _ = case.build(device, args, lr=ACCURACY_LR)
    sampler = DistributedSampler(train_set, world_size, rank, seed=0)
    batches = DataLoader(train_set, batch_size=MODELS[case.model_name][1], sampler=sampler)
    step = 0
    for epoch in range(args.accuracy_steps):  # more epochs than it needs: it stops after --accuracy_steps steps
        sampler.set_epoch(epoch)
        for x, y in batches:
            optimizer.zero_grad(set_to_none=True)
            loss_of(case.model_name, model, x.to(device), y.to(device)).backward()
            optimizer.step()
            step += 1
            if step == args.accuracy_steps:
                break
        if step == args.accuracy_steps:
            break
    counts = torch.zeros(2, device=device)  # correct, images
    images = min(len(eval_set), args.accuracy_images or len(eval_set))
    with torch.no_grad():
        # Every image on exactly one rank (DistributedSampler would pad the ranks to equal shares).
        for x, y in DataLoader(Subset(eval_set, range(rank, images, world_size)), batch_size=500):
            predicted = model.module(x.to(device))["logits"].argmax(1)
            counts += torch.stack([(predicted == y.to(device)).sum(), torch.tensor(len(y), device=device)])
    dist.all_reduce(counts)
    del model, optimizer  # they hold the process group
    return counts[0].item() / counts[1].item()


def worker(rank, world_size, backend, port, cases, args, result_path):
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    device = torch.device(accelerator.type, rank) if accelerator else torch.device("cpu")
    if accelerator:
        torch.accelerator.set_device_index(device.index)
    torch.set_num_threads(args.threads)  # the same per rank at every world size, so only N changes
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=args.timeout, device_id=device if accelerator else None)
    states = {name: case.setup(device, rank, world_size, args) for name, case in cases.items()}
    steps = {}
    for name, case in cases.items():
        # Warm-up (PowerSGD's plain steps included, so that the timed ones compress), and a step count that fills
        # --seconds at this world size on this machine.
        warmup = max(args.warmup, args.powersgd_warmup + 2) if case.hook == "powersgd" else args.warmup
        estimate = timed(case, states[name], warmup, device) / warmup
        steps[name] = max(3, min(100_000, int(args.seconds / max(estimate, 1e-9))))
    throughput = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, case in cases.items():  # interleaved: a slow spell of the machine hits every case alike
            seconds = timed(case, states[name], steps[name], device)
            throughput[name].append(world_size * MODELS[case.model_name][1] * steps[name] / seconds)
    sent = {name: (state[3].bytes_per_step(), state[3].full_bytes) for name, state in states.items()
            if state[3] is not None}
    accuracy = {name: held_out_accuracy(case, device, rank, world_size, args) for name, case in cases.items()
                if args.accuracy_steps and case.mode == "ddp" and case.model_name == "cnn"}
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump({"steps": steps, "samples_per_s": throughput, "bytes_per_step": sent, "accuracy": accuracy}, f)
    # The DDP models and ZeroRedundancyOptimizers hold the process group: free them first, so that
    # destroy_process_group frees it.
    del states
    dist.destroy_process_group()


def spawn(world_size, cases, args):
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    device = torch.device(accelerator.type, 0) if accelerator else torch.device("cpu")  # the ranks' kind
    backend = check_backend(args.backend or dist.get_default_backend_for_device(device), device, world_size)
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result.json")
        mp.spawn(worker, args=(world_size, backend, free_port(), cases, args, result_path), nprocs=world_size)
        with open(result_path) as f:
            return backend, json.load(f)


def oversubscription(world_size, threads):
    cores = common.usable_cores()
    if world_size * threads > cores:
        return f"oversubscribed: {world_size} ranks x {threads} thread(s) on {cores} cores"
    return ""


def verdict(ok):
    return "PASS" if ok else "MISS"


def settings(args):
    """The DDP loops to compare: name -> Case options. "ddp" is DDP as it comes (no hook, the plain optimizer)."""
    found = {("ddp" if hook == "none" else f"ddp+{hook}"): {"hook": hook} for hook in args.comm_hook}
    if args.zero:
        found["ddp+zero"] = {"zero": True}
    return found


def run_scaling(args):
    results, backend = {}, None
    for world_size in args.world_sizes:
        cases = {}
        for model_name in args.models:
            cases[f"{model_name}/independent"] = Case(model_name, mode="independent")
            for setting, options in settings(args).items():
                cases[f"{model_name}/{setting}"] = Case(model_name, **options)
        print(f"world size {world_size}: {len(cases)} loops x {args.repeats} repeats "
              f"{oversubscription(world_size, args.threads)}".rstrip(), flush=True)
        backend, raw = spawn(world_size, cases, args)
        results[world_size] = raw
    rows = []
    for model_name in args.models:
        for setting, options in settings(args).items():
            name = f"{model_name}/{setting}"
            median = {n: {mode: statistics.median(results[n]["samples_per_s"][f"{model_name}/{mode}"])
                          for mode in ("independent", setting)} for n in args.world_sizes}
            base = median.get(1)
            for n in args.world_sizes:
                ddp, ceiling = median[n][setting], median[n]["independent"]
                rows.append({
                    "model": model_name, "description": MODELS[model_name][4],
                    "batch_per_rank": MODELS[model_name][1], "world_size": n, "threads_per_rank": args.threads,
                    "setting": setting, "comm_hook": options.get("hook", "none"), "zero": options.get("zero", False),
                    "oversubscribed": bool(oversubscription(n, args.threads)),
                    "steps": results[n]["steps"][name],
                    "ddp_samples_per_s": ddp, "independent_samples_per_s": ceiling,
                    "ddp_samples_per_s_repeats": results[n]["samples_per_s"][name],
                    "independent_samples_per_s_repeats": results[n]["samples_per_s"][f"{model_name}/independent"],
                    "scaling_efficiency": ddp / (n * base[setting]) if base else None,
                    "ceiling_scaling_efficiency": ceiling / (n * base["independent"]) if base else None,
                    "ddp_vs_ceiling": ddp / ceiling,
                    "ddp_overhead": ceiling / ddp - 1 if n == 1 else None,
                    "bytes_per_step": results[n]["bytes_per_step"][name][0],
                    # ZeRO: after its step every rank broadcasts its share of the updated weights to the others.
                    "broadcast_bytes_per_step": results[n]["bytes_per_step"][name][1]
                    if options.get("zero") and n > 1 else 0,
                    "accuracy": results[n]["accuracy"].get(name),
                })
    return backend, rows


def print_scaling(rows):
    headers = ["model", "setting", "ranks", "bytes/step", "ddp samples/s", "ceiling samples/s", "ddp/ceiling",
               "scaling eff", "ceiling eff", "accuracy", "note"]
    def eff(value):
        return "-" if value is None else f"{value:.2f}"

    lines = []
    for r in rows:
        note = "oversubscribed" if r["oversubscribed"] else ""
        if r["ddp_overhead"] is not None:
            note = f"DDP overhead {100 * r['ddp_overhead']:+.1f}%"
        sent = str(r["bytes_per_step"])
        if r["broadcast_bytes_per_step"]:
            sent += f" + {r['broadcast_bytes_per_step']} bc"
        accuracy = "-" if r["accuracy"] is None else f"{100 * r['accuracy']:.2f}%"
        lines.append([r["model"], r["setting"], r["world_size"], sent, f"{r['ddp_samples_per_s']:.0f}",
                      f"{r['independent_samples_per_s']:.0f}", f"{r['ddp_vs_ceiling']:.2f}",
                      eff(r["scaling_efficiency"]), eff(r["ceiling_scaling_efficiency"]), accuracy, note])
    print(report.table(headers, lines))


def targets(rows):
    """PASS/MISS against the targets, for SimpleCNN at batch 64 and 1 thread per rank."""
    found = []
    plain = {r["world_size"]: r for r in rows if r["model"] == "cnn" and r["setting"] == "ddp"}
    others = [r for r in rows if r["model"] == "cnn" and r["setting"] != "ddp" and r["world_size"] == 2]
    if others and 2 in plain and plain[2]["accuracy"] is not None and rows[0]["threads_per_rank"] == 1:
        def meets(r):
            return (r["ddp_vs_ceiling"] >= TARGET_VS_CEILING
                    and 100 * (plain[2]["accuracy"] - r["accuracy"]) <= TARGET_ACCURACY_POINTS)
        best = max(others, key=lambda r: (meets(r), r["ddp_vs_ceiling"]))
        found.append({"target": f"SimpleCNN, 2 ranks: a setting >= {TARGET_VS_CEILING} x independent processes with "
                                f"accuracy within {TARGET_ACCURACY_POINTS} points of ddp ({best['setting']})",
                      "value": best["ddp_vs_ceiling"], "pass": meets(best)})
    for r in rows:
        if r["model"] != "cnn" or r["threads_per_rank"] != 1 or r["setting"] != "ddp":
            continue
        if r["world_size"] == 2:
            found.append({"target": f"SimpleCNN, 2 ranks: ddp >= {TARGET_VS_CEILING} x independent processes",
                          "value": r["ddp_vs_ceiling"], "pass": r["ddp_vs_ceiling"] >= TARGET_VS_CEILING})
        if r["world_size"] == 1:
            found.append({"target": f"SimpleCNN, 1 rank: DDP overhead <= {TARGET_OVERHEAD:.0%}",
                          "value": r["ddp_overhead"], "pass": r["ddp_overhead"] <= TARGET_OVERHEAD})
    return found


def plot(rows, path, title):
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for model_name in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model_name and r.get("setting", "ddp") == "ddp"]
        sizes = [r["world_size"] for r in mine]
        line, = ax.plot(sizes, [r["ddp_samples_per_s"] for r in mine], "o-", label=f"{model_name} ddp")
        ax.plot(sizes, [r["independent_samples_per_s"] for r in mine], "s:", color=line.get_color(),
                label=f"{model_name} independent (ceiling)")
    ax.set_xticks(sorted({r["world_size"] for r in rows}))
    ax.set_yscale("log")
    ax.set_xlabel("world size (processes)")
    save_plot(plt, fig, ax, path, title)


def save_plot(plt, fig, ax, path, title, legend_outside=False):
    """Throughput on the y axis, the title (wrapped: it names the machine), a grid and the legend; to path."""
    ax.set_ylabel("samples/s (all ranks)")
    ax.set_title(textwrap.fill(title, 100), fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    if legend_outside:  # one entry a point: beside the axes, where no label can cover a point or another label
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    else:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


MARKERS = "osD^v<>P*X"


def plot_settings(rows, path, title):
    """Throughput against the bytes each rank hands to all-reduce per step: a colour per world size, a marker per
    setting, each point named in the legend with its held-out accuracy; the ceiling of each world size dotted."""
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(11, 5))
    names = list(dict.fromkeys(r["setting"] for r in rows))
    for index, n in enumerate(sorted({r["world_size"] for r in rows})):
        mine = [r for r in rows if r["world_size"] == n and r["model"] == "cnn"] or \
            [r for r in rows if r["world_size"] == n]
        ceiling = ax.axhline(mine[0]["independent_samples_per_s"], linestyle=":", color=f"C{index}",
                             label=f"{n} rank(s): independent processes (ceiling)")
        for r in mine:
            accuracy = "" if r["accuracy"] is None else f", {100 * r['accuracy']:.2f}% held-out"
            ax.scatter(r["bytes_per_step"] + r["broadcast_bytes_per_step"], r["ddp_samples_per_s"],
                       color=ceiling.get_color(), marker=MARKERS[names.index(r["setting"]) % len(MARKERS)],
                       alpha=0.7, s=50,
                       label=f"{n} rank(s): {r['setting']}{accuracy}")
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent per step and rank (all-reduce, + broadcast for ZeRO)")
    save_plot(plt, fig, ax, path, title, legend_outside=True)


def plot_titles(result):
    """The titles of scaling.png and scaling-comm.png, from the result they plot."""
    machine, cores = result["machine"], result["machine"]["cpu_cores"]
    main_title = (f"DDP throughput vs independent processes, {result['backend']}, {result['threads_per_rank']} "
                  f"thread/rank | {machine['hostname']}: {machine['cpu_model']}, {cores} cores | "
                  f"torch {result['torch']}")
    load = ", ".join(f"{x:.1f}" for x in machine.get("load_average_after") or machine["load_average_1_5_15min"])
    comm_title = (f"DDP throughput against bytes per step, {result['backend']}, {result['threads_per_rank']} "
                  f"thread/rank, accuracy after {result.get('accuracy_steps')} steps | {machine['hostname']}, "
                  f"{cores} cores | load {load}")
    return main_title, comm_title


def plot_result(result, out):
    """scaling.png, and scaling-comm.png where several DDP settings were measured, into `out`."""
    main_title, comm_title = plot_titles(result)
    plot(result["results"], out / "scaling.png", main_title)
    if len({r.get("setting", "ddp") for r in result["results"]}) > 1:
        plot_settings(result["results"], out / "scaling-comm.png", comm_title)


def run_profile(args):
    rows = []
    for world_size in args.world_sizes:
        for model_name in args.models:
            cases = {name: Case(model_name, **{"ddp": {}, **options}) for name, options in PROFILE_VARIANTS.items()}
            print(f"profile {model_name}, world size {world_size}: {len(cases)} variants x {args.repeats} repeats "
                  f"{oversubscription(world_size, args.threads)}".rstrip(), flush=True)
            _, raw = spawn(world_size, cases, args)
            ceiling = statistics.median(raw["samples_per_s"]["independent (ceiling)"])
            for name in cases:
                value = statistics.median(raw["samples_per_s"][name])
                rows.append({"model": model_name, "world_size": world_size, "variant": name,
                             "samples_per_s": value, "vs_ceiling": value / ceiling,
                             "samples_per_s_repeats": raw["samples_per_s"][name]})
    print(report.table(["model", "ranks", "variant", "samples/s", "vs ceiling"],
                       [[r["model"], r["world_size"], r["variant"], f"{r['samples_per_s']:.0f}",
                         f"{r['vs_ceiling']:.3f}"] for r in rows]))
    return rows


def main(args):
    if args.replot:  # the plots again, from a result written earlier: nothing is measured
        plot_result(json.loads((args.replot / "scaling.json").read_text()), args.replot)
        print(f"Wrote the plots to {args.replot}")
        return
    for hook in args.comm_hook:
        comm_hooks.check(hook, args.powersgd_warmup)
    if args.accuracy_steps is None:  # accuracy when settings are compared
        args.accuracy_steps = 300 if len(settings(args)) > 1 else 0
    if args.profile:
        args.accuracy_steps = 0
    if args.quick:
        args.repeats, args.seconds, args.warmup = 1, 0.1, 2
        args.accuracy_steps = min(args.accuracy_steps, 3)
    # --quick scores 200 held-out images, not all: after 3 steps of training its accuracy only shows that it is
    # measured, and every 1,000 images scored cost a rank about a second of CPU.
    args.accuracy_images = 200 if args.quick else None
    if args.accuracy_steps and "cnn" in args.models:
        mnist_tensors(args.data_dir)  # missing or broken files: one line now, not one per rank later
    cores = common.usable_cores()
    machine = report.machine()
    print(report.machine_line(machine), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.profile:
        rows = run_profile(args)
        machine["load_average_after"] = report.machine()["load_average_1_5_15min"]
        result = {"benchmark": "scaling-profile", "machine": machine, "torch": torch.__version__,
                  "threads_per_rank": args.threads, "repeats": args.repeats, "quick": args.quick, "results": rows}
        print(f"Wrote {report.write_json(args.out / 'profile.json', result)}")
        return
    backend, rows = run_scaling(args)
    machine["load_average_after"] = report.machine()["load_average_1_5_15min"]
    print(f"backend {backend} | {args.threads} thread(s) per rank | {cores} usable cores | median of "
          f"{args.repeats} repeat(s) | DDP settings {DDP_SETTINGS} | load average after "
          f"{', '.join(f'{x:.2f}' for x in machine['load_average_after'])}")
    print_scaling(rows)
    if any(r["oversubscribed"] for r in rows):
        print(f"Oversubscribed rows run more ranks x threads than the {cores} usable cores: their ceiling "
              "already loses to time sharing, and ddp/ceiling is the figure that still means something.")
    verdicts = targets(rows)
    for t in verdicts:
        print(f"{verdict(t['pass'])}: {t['target']} (measured {t['value']:.3f})")
    result = {"benchmark": "scaling", "machine": machine, "torch": torch.__version__, "backend": backend,
              "world_sizes": args.world_sizes, "threads_per_rank": args.threads, "repeats": args.repeats,
              "seconds_per_measurement": args.seconds, "ddp_settings": DDP_SETTINGS, "quick": args.quick,
              "powersgd": {"rank": args.powersgd_rank, "warmup": args.powersgd_warmup},
              "accuracy_steps": args.accuracy_steps,
              "accuracy_images": args.accuracy_images, "accuracy_lr": ACCURACY_LR, "targets": verdicts, "results": rows}
    print(f"Wrote {report.write_json(args.out / 'scaling.json', result)}")
    plot_result(result, args.out)
    print(f"Wrote the plots to {args.out}")


if __name__ == "__main__":
    parser = common.ArgumentParser(description="DDP samples/s at several world sizes against independent "
                                            "processes (the ceiling), with scaling efficiency and DDP overhead.")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS), help="models to train")
    parser.add_argument("--world_sizes", nargs="+", type=common.positive_int, default=[1, 2, 4],
                        help="process counts; efficiencies need 1 among them (default 1 2 4)")
    parser.add_argument("--threads", type=common.positive_int, default=1, help="intra-op threads per rank")
    parser.add_argument("--repeats", type=common.positive_int, default=5, help="timed runs per loop; medians reported")
    parser.add_argument("--seconds", type=common.positive_float, default=2.0,
                        help="target duration of one timed run; sets the step count (default 2.0)")
    parser.add_argument("--warmup", type=common.positive_int, default=5, help="untimed steps per loop first")
    parser.add_argument("--profile", action="store_true",
                        help="instead: time DataLoader, per-step loss.item(), DDP bucket settings and Join one by one")
    parser.add_argument("--quick", action="store_true", help="1 repeat of 0.1 s: a smoke run, not numbers")
    parser.add_argument("--out", type=Path, default=report.DEFAULT_OUT, help="folder for the JSON and PNG")
    comm_hooks.add_args(parser)  # --comm_hook HOOK..., --powersgd_rank, --powersgd_warmup
    parser.add_argument("--zero", action="store_true", help="also time DDP with ZeroRedundancyOptimizer")
    parser.add_argument("--accuracy_steps", type=common.non_negative_int, default=None,
                        help="SimpleCNN: train this many steps per setting on MNIST and report held-out accuracy; "
                             "0: none (default 300 when settings are compared, else 0)")
    parser.add_argument("--data_dir", type=Path, default=report.REPO / "data" / "mnist",
                        help="folder with MNIST's t10k-images/labels-idx files, split 8,000 / 2,000 (default: the "
                             "tests' copy)")
    common.add_distributed_args(parser)
    parser.add_argument("--replot", type=Path, metavar="DIR",
                        help="only draw the plots again from DIR/scaling.json, into DIR")
    common.run(main, parser)
