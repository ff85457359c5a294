"""What torch.compile buys a training step: eager against compiled, for the tutorial's MLP (launch overhead) and a
wider residual model (where compute starts to matter), with the compile time reported apart.

    python benchmarks/compile.py                      # both models, 200 timed steps each, 1 thread, on this device
    python benchmarks/compile.py --models mlp --steps 20 --warmup 5 --out /tmp/compile

One process, no DDP (by_feature/compiled.py shows what DDP does to the graph): a step is zero_grad, forward, MSE
loss, backward and an SGD step, on one batch already on the device; its time is the median of --steps after
--warmup, eager and compiled in turns. The model is compiled in place (model.compile(), inductor's default mode);
the compile time is the first compiled step's wall time minus an eager step, with a fresh inductor cache (a cold
compile) unless TORCHINDUCTOR_CACHE_DIR is set. break_even_steps: the steps after which the compile has paid for itself.
Writes compile.json and compile.png to --out (default benchmarks/results).
"""
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file: make the repository importable
import torch
import torch.nn.functional as F

from benchmarks import common, report
from models_and_data import MLP, BlockMLP

MODELS = {
    "mlp": lambda: MLP(input_size=20, hidden_size=64),  # the tutorial's: 5,569 parameters
    "wide": lambda: BlockMLP(input_size=20, width=256, hidden=1024, depth=4),  # 2.1M parameters, LayerNorms
}


def step_times(model, optimizer, source, targets, steps, warmup, device):
    """Wall time of every step (warm-up steps first), each waited for on the device."""
    times = []
    for _ in range(warmup + steps):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        F.mse_loss(model(source), targets).backward()
        optimizer.step()
        if device.type != "cpu":
            torch.accelerator.synchronize()
        times.append(time.perf_counter() - start)
    return times


def measure(name, args, device):
    torch.manual_seed(0)
    model = MODELS[name]().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9)
    source = torch.randn(args.batch_size, 20, device=device)
    targets = torch.randn(args.batch_size, 1, device=device)
    step_times(model, optimizer, source, targets, 0, args.warmup, device)  # eager warm-up
    model.compile()
    first = step_times(model, optimizer, source, targets, 0, args.warmup, device)[0]  # compiles, then warms up
    # Eager and compiled steps in turns, a tenth of --steps each (force_eager: the compiled model's plain forward),
    # so that a machine whose load changes meanwhile weighs on both alike.
    times = {"force_eager": [], "default": []}
    for _ in range(10):
        for stance, kept in times.items():
            with torch.compiler.set_stance(stance):
                kept += step_times(model, optimizer, source, targets, max(1, args.steps // 10), 2, device)[2:]
    eager, compiled = statistics.median(times["force_eager"]), statistics.median(times["default"])
    compile_s = first - eager
    saved = eager - compiled
    return {"model": name, "parameters": sum(p.numel() for p in model.parameters()), "batch_size": args.batch_size,
            "eager_ms": eager * 1e3, "compiled_ms": compiled * 1e3, "speedup": eager / compiled,
            "compile_s": compile_s, "break_even_steps": round(compile_s / saved) if saved > 0 else None}


def plot(rows, device_name, path):
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["eager_ms"] for r in rows], width=0.4, label="eager")
    ax.bar([i + 0.2 for i in x], [r["compiled_ms"] for r in rows], width=0.4, label="compiled")
    for i, r in zip(x, rows):
        ax.annotate(f"compile {r['compile_s']:.0f} s", (i + 0.2, r["compiled_ms"]), ha="center", va="bottom",
                    fontsize=8)
    ax.set_xticks(list(x), [f"{r['model']} ({r['parameters']:,} params)" for r in rows])
    ax.set_yscale("log")  # 0.4 ms and 30 ms on one axis
    ax.set_ylabel("ms per training step")
    ax.set_title(f"torch.compile, one process: {device_name}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(args):
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        cache = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    else:  # a cold compile, as a new job on a new machine pays it
        cache = os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    device = torch.device(accelerator.type, 0) if accelerator else torch.device("cpu")
    device_name = torch.cuda.get_device_name(0) if device.type == "cuda" else report.cpu_model()
    torch.set_num_threads(args.threads)
    machine = report.machine()
    rows = [measure(name, args, device) for name in args.models]
    print(report.machine_line(machine))
    print(f"{device_name} | {args.threads} thread(s) | median of {args.steps} steps after {args.warmup} | inductor "
          f"cache {cache}")
    print(report.table(["model", "parameters", "eager ms", "compiled ms", "speedup", "compile s", "break-even steps"],
                       [[r["model"], f"{r['parameters']:,}", f"{r['eager_ms']:.3f}", f"{r['compiled_ms']:.3f}",
                         f"{r['speedup']:.2f}x", f"{r['compile_s']:.1f}", r["break_even_steps"] or "never"]
                        for r in rows]))
    result = {"benchmark": "compile", "machine": machine, "torch": torch.__version__, "device": device.type,
              "device_name": device_name, "threads": args.threads, "steps": args.steps, "warmup": args.warmup,
              "inductor_cache": "fresh" if cache.startswith(tempfile.gettempdir() + "/inductor-") else "given",
              "results": rows}
    print(f"Wrote {report.write_json(args.out / 'compile.json', result)}")
    plot(rows, device_name, args.out / "compile.png")
    print(f"Wrote {args.out / 'compile.png'}")


if __name__ == "__main__":
    parser = common.ArgumentParser(description="Training step time, eager against torch.compile.")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS),
                        help="mlp (the tutorial's), wide (a residual MLP of 2.1M parameters); default both")
    parser.add_argument("--steps", type=common.positive_int, default=200, help="timed steps (default 200)")
    parser.add_argument("--warmup", type=common.positive_int, default=20, help="steps before timing (default 20)")
    parser.add_argument("--batch_size", type=common.positive_int, default=64, help="samples per step (default 64)")
    parser.add_argument("--threads", type=common.positive_int, default=1,
                        help="torch's intra-op threads (default 1: a core per rank, as under torchrun)")
    parser.add_argument("--out", type=Path, default=report.DEFAULT_OUT, help="where to write JSON and PNG")
    common.run(main, parser)
