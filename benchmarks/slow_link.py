"""DDP against LocalSGD, DiLoCo and Streaming DiLoCo over a shaped link: loss against wall-clock time and against
the bytes that crossed it. Needs root (network namespaces and tc).

    sudo python benchmarks/slow_link.py                  # 6 ways x 2 rates, some 8 minutes on 2 cores
    sudo python benchmarks/slow_link.py --quick          # 2 ways at 20mbit, 40 steps: a smoke test

Every run: launch/two_sites.py's two namespaces joined by a veth pair shaped with `tc tbf rate R` each way, the
lighthouse in site 0 (--min_replicas 2: the first sync waits for both), one diloco.py replica group per site,
BlockMLP of 134,401 parameters, batch 32 per group, --steps inner steps. The ways: DDP's behaviour (localsgd
every step), LocalSGD and DiLoCo every 10 and 50 steps, Streaming DiLoCo every 50 in 2 fragments. Measured: the
time of each sync line as it arrives (from the later group's first line), the veth's byte counters (`ip -s link`,
both directions summed, sampled every 0.1 s), each group's mean training loss of the round at its sync lines, and
the final model's loss on the whole dataset. "loss at T": the rounds' loss at the time the fastest way at that
rate took to finish, the same time for every way.
Writes slow_link.json and slow_link.png to --out (default benchmarks/results).
"""
import argparse
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file: make the repository importable
from benchmarks import report
from benchmarks.launches import clean_env
from launch.two_sites import Sites

WAYS = {  # name: diloco.py flags
    "ddp": ["--algorithm", "localsgd", "--sync_every", "1", "--log_every", "10"],
    "localsgd-h10": ["--algorithm", "localsgd", "--sync_every", "10"],
    "localsgd-h50": ["--algorithm", "localsgd", "--sync_every", "50"],
    "diloco-h10": ["--algorithm", "diloco", "--sync_every", "10"],
    "diloco-h50": ["--algorithm", "diloco", "--sync_every", "50"],
    "streaming-h50-f2": ["--algorithm", "diloco", "--sync_every", "50", "--fragments", "2"],
}
SYNC = re.compile(r"^Sync (\d+) \| step (\d+) \| groups (\d+) \| sent (\d+) B \| loss ([\d.]+)$")
SUMMARY = re.compile(r"^Summary: steps (\d+) \| syncs (\d+) \|.*\| final loss ([\d.]+) \|")


def run_way(name, rate, steps, timeout):
    with tempfile.TemporaryDirectory() as tmp, Sites(rate) as sites:
        lighthouse = sites.lighthouse(2, tmp)
        env = clean_env(OMP_NUM_THREADS=1, TORCH_CPP_LOG_LEVEL="ERROR")
        flags = [*WAYS[name], "--steps", str(steps), "--timeout", "60"]
        groups = [sites.group(site, "diloco.py", flags, tmp, env) for site in (0, 1)]
        for group in groups:
            group.echo = False
        samples, stop = [], threading.Event()

        def sample():  # the link's counters, both directions summed
            while not stop.is_set():
                samples.append((time.monotonic(), sum(sites.sent())))
                time.sleep(0.1)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        codes = [group.finish(timeout) for group in groups]
        stop.set()
        sampler.join()
        lighthouse.kill()
    if codes != [0, 0]:
        tails = [" / ".join(line for _, line in group.lines[-4:]) for group in groups]
        raise RuntimeError(f"{name} at {rate}: exit codes {codes}: {tails}")
    # Training starts once both groups are up: from the later one's first line.
    t0 = max(next(t for t, line in g.lines if line.startswith("Replica group")) for g in groups)
    base = next((b for t, b in reversed(samples) if t <= t0), samples[0][1])
    by_sync = {}
    for group in groups:
        for t, line in group.lines:
            if match := SYNC.match(line):
                by_sync.setdefault(int(match[1]), []).append((t, int(match[2]), float(match[5])))
    curve = []
    for sync in sorted(by_sync):
        rows = by_sync[sync]
        t = max(r[0] for r in rows)
        link = next((b for ts, b in samples if ts >= t), samples[-1][1]) - base
        curve.append({"t_s": round(t - t0, 3), "step": rows[0][1], "link_bytes": link,
                      "loss": sum(r[2] for r in rows) / len(rows)})
    summaries = [SUMMARY.match(line) for g in groups for _, line in g.lines if SUMMARY.match(line)]
    end = max(t for g in groups for t, line in g.lines if line.startswith("Summary"))
    return {"way": name, "rate": rate, "steps": steps, "flags": WAYS[name], "wall_s": round(end - t0, 2),
            "syncs": int(summaries[0][2]), "link_bytes": samples[-1][1] - base,
            "final_loss": float(summaries[0][3]), "final_losses_equal": len({s[3] for s in summaries}) == 1,
            "curve": curve}


def loss_at(curve, t):
    """The rounds' loss at time t: the last sync line by then (the first one's, if none came yet)."""
    before = [point for point in curve if point["t_s"] <= t]
    return (before[-1] if before else curve[0])["loss"]


def plot(results, rates, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(rates), 2, figsize=(11, 4 * len(rates)), squeeze=False)
    for row, rate in zip(axes, rates):
        for result in (r for r in results if r["rate"] == rate):
            curve = result["curve"]
            row[0].plot([p["t_s"] for p in curve], [p["loss"] for p in curve], label=result["way"])
            row[1].plot([p["link_bytes"] / 1e6 for p in curve], [p["loss"] for p in curve], label=result["way"])
        for ax, xlabel in zip(row, ("seconds", "MB across the link")):
            ax.set(xlabel=xlabel, ylabel="training loss (round mean)", yscale="log", title=f"link {rate}")
            ax.grid(alpha=0.3)
        row[1].set_xscale("log")
        row[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="ddp and diloco-h10 at 20mbit, 40 steps")
    parser.add_argument("--rates", nargs="+", default=["1gbit", "20mbit"], help="link rates, tc's syntax")
    parser.add_argument("--ways", nargs="+", choices=list(WAYS), default=list(WAYS), help="what to run")
    parser.add_argument("--steps", type=int, default=300, help="inner steps of every run (default 300)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds one run may take (default 300)")
    parser.add_argument("--out", type=Path, default=report.DEFAULT_OUT, help="folder for the JSON and PNG")
    args = parser.parse_args()
    if args.quick:
        args.rates, args.ways, args.steps = ["20mbit"], ["ddp", "diloco-h10"], 40
    if args.steps % 50 and any("50" in way for way in args.ways):
        parser.error("--steps must be a multiple of 50 with the H=50 ways")
    if sys.platform != "linux" or os.geteuid() != 0:
        parser.error("network namespaces and tc need Linux and root: run it with sudo")
    return args


def main(args):
    info = report.machine(backend="gloo", world_size=2)
    print(report.machine_line(info), flush=True)
    results = []
    for rate in args.rates:
        for way in args.ways:
            began = time.monotonic()
            results.append(run_way(way, rate, args.steps, args.timeout))
            r = results[-1]
            print(f"{rate:>7} {way:<17} training {r['wall_s']:7.2f}s | link {r['link_bytes'] / 1e6:8.2f} MB | "
                  f"final loss {r['final_loss']:.4f} | launch {time.monotonic() - began:.0f}s", flush=True)
    rows = []
    for rate in args.rates:
        same = min(r["wall_s"] for r in results if r["rate"] == rate)
        for r in (r for r in results if r["rate"] == rate):
            r["same_time_s"], r["loss_at_same_time"] = same, loss_at(r["curve"], same)
            rows.append([rate, r["way"], str(r["syncs"]), f"{r['wall_s']:.1f}", f"{r['link_bytes'] / 1e6:.1f}",
                         f"{r['final_loss']:.4f}", f"{r['loss_at_same_time']:.4f} at {same:.1f}s"])
    print(report.table(["link", "way", "syncs", "seconds", "link MB", "final loss", "loss at T"], rows))
    args.out.mkdir(parents=True, exist_ok=True)
    plot(results, args.rates, args.out / "slow_link.png")
    report.write_json(args.out / "slow_link.json", {
        "benchmark": "slow_link", "machine": info, "torch": info["torch"], "steps": args.steps,
        "model": "BlockMLP width 64, hidden 256, depth 4: 134,401 parameters", "batch_per_group": 32,
        "rates": args.rates, "results": results})
    print(f"Wrote {args.out / 'slow_link.json'} and slow_link.png")


if __name__ == "__main__":
    main(parse_args())
