"""What torchdiagnose (`python -m torchdiagnose`) costs a job that does not hang: the tutorial's step 3 and train.py,
each launched with and without the prefix, the launches alternating so that both settings share whatever else loads the
machine.

    python benchmarks/diagnose_cost.py                               # 5 pairs of each; some minutes
    python benchmarks/diagnose_cost.py --quick --jobs step3 --out out   # a smoke test: one pair, 5 epochs of step 3

Each launch is `torchrun --standalone --nproc_per_node=2` (--quick: 1) in a fresh folder; its samples/s come from
the summary line (the training loop only, start-up excluded). The figure is the median of the paired ratios (with
the tool / without), against the noise: the spread of the same ratio between the pairs. Every other pair runs the
prefixed launch first.
Writes diagnose_cost.json to --out (default benchmarks/results).
"""
import argparse
import re
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file: make the repository importable
from benchmarks import report
from benchmarks.launches import REPO, clean_env, launch_once, torchrun_cmd

SUMMARY = re.compile(r"^Summary: .* \| samples/s ([\d.]+) \|", re.M)


def jobs(args):
    step3_epochs = 5 if args.quick else args.epochs * 50
    every = {
        "step3": ("multigpu_torchrun.py (step 3)", ["multigpu_torchrun.py", "--total_epochs", str(step3_epochs),
                                                    "--save_every", "1000"]),
        "train": ("train.py (SimpleCNN, Hugging Face Trainer)",
                  ["train.py", "--data_dir", str(REPO / "data" / "mnist"), "--num_train_epochs", str(args.epochs),
                   "--max_train_samples", "2000", "--save_strategy", "no"]),
    }
    return dict(every[job] for job in args.jobs)


def throughput(script_args, prefixed, timeout, nproc):
    with tempfile.TemporaryDirectory() as tmp:
        argv = [str(a) for a in torchrun_cmd(*script_args, nproc=nproc)]
        if script_args[0] == "multigpu_torchrun.py":
            argv += ["--snapshot_path", f"{tmp}/snapshot.pt"]
        else:
            argv += ["--output_dir", f"{tmp}/out"]
        if prefixed:
            argv = [sys.executable, "-m", "torchdiagnose", *argv]
        _, _, code, output = launch_once(argv, REPO, clean_env(), timeout)
    match = SUMMARY.search(output)
    if code != 0 or not match:
        sys.exit(f"error: {' '.join(argv)} failed (exit code {code}): {output.splitlines()[-3:]}")
    return float(match[1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="pairs of launches per job (default 5)")
    parser.add_argument("--epochs", type=int, default=2, help="train.py's epochs; step 3 trains 50 times as many")
    parser.add_argument("--jobs", nargs="+", choices=["step3", "train"], default=["step3", "train"],
                        help="the jobs to launch (default both)")
    parser.add_argument("--out", default=report.DEFAULT_OUT, help="folder for diagnose_cost.json")
    parser.add_argument("--launch_timeout", type=float, default=600)
    parser.add_argument("--quick", action="store_true",
                        help="a smoke test: one pair of one-process launches, step 3 for 5 epochs, train.py for 1 "
                             "(not figures to keep)")
    args = parser.parse_args()
    # --quick: one process a launch, which runs every path of this file (the prefix, the pairs, the ratios) at
    # half the launches' start-up CPU; not a figure to keep.
    nproc = 1 if args.quick else 2
    if args.quick:
        args.repeats, args.epochs = 1, 1
    if args.repeats < 1 or args.epochs < 1:
        parser.error("--repeats and --epochs must be at least 1")
    rows = []
    for name, script_args in jobs(args).items():
        pairs = []
        for repeat in range(args.repeats):
            # Every other pair runs the prefixed launch first: the order of the two must not become the figure.
            order = (False, True) if repeat % 2 == 0 else (True, False)
            rates = {prefixed: throughput(script_args, prefixed, args.launch_timeout, nproc) for prefixed in order}
            pairs.append((rates[False], rates[True]))
        ratios = [tool / plain for plain, tool in pairs]
        rows.append({"job": name, "samples_per_s_without": statistics.median(p for p, _ in pairs),
                     "samples_per_s_with": statistics.median(t for _, t in pairs),
                     "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                     "pairs": pairs})
    machine = report.machine("gloo", nproc)
    print(report.machine_line(machine))
    print(report.table(["job", "samples/s without", "with diagnose", "ratio (median, min-max of pairs)"],
                       [[r["job"], f"{r['samples_per_s_without']:.0f}", f"{r['samples_per_s_with']:.0f}",
                         f"{r['ratio_median']:.3f} ({r['ratio_min']:.3f}-{r['ratio_max']:.3f})"] for r in rows]))
    path = report.write_json(Path(args.out) / "diagnose_cost.json",
                             {"machine": machine, "processes": nproc, "repeats": args.repeats, "epochs": args.epochs,
                              "quick": args.quick, "rows": rows})
    print(f"Wrote {path}")


if __name__ == "__main__":
    main()
