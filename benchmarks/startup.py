"""Launch-to-first-training-step time of every example script on the CPU (target: at most 5 s).

    python benchmarks/startup.py                                   # every script, median of 3 launches
    python benchmarks/startup.py --scripts singlegpu.py multinode.py --repeats 1

Each script is started the way its docstring shows, with its own launcher (python, torchrun, mpirun), 2
CPU processes where it runs several, a tiny job, and a fresh empty working folder (no snapshot or .env
to pick up). The clock runs from the launch to the first line on its output that reports finished
training work (per script below: the first `Epoch N` line, the Trainer's first `'loss'` log, or, for the
two scripts that only run collectives, their result table), and on to the exit. Everything before that
line is the cost of starting: the launcher, `import torch`, process spawning, the rendezvous, building
data and model.
Writes startup.json to --out (default benchmarks/results).
"""
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file: make the repository importable
from benchmarks import common, report
from benchmarks.launches import LAUNCHES, launch_argv, launch_env, launch_once, script_of
from benchmarks.common import UsageError

# The scripts' own launches (the variants under a second launcher are the clean-exit benchmark's business).
SCRIPTS = [name for name in LAUNCHES if " " not in name and not name.startswith("benchmarks/")]
TARGET_S = 5.0


def measure(name, repeats, timeout):
    command, arguments, progress = LAUNCHES[name]
    row = {"script": name, "command": " ".join([Path(str(command(script_of(name))[0])).name, name, arguments])}
    firsts, exits = [], []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            first, total, code, output = launch_once(launch_argv(name, tmp), tmp, launch_env(name), timeout, progress)
        if code != 0 or first is None:
            reason = f"exit code {code}" if code != 0 else "no progress line"
            return {**row, "status": "failed", "reason": reason, "output_tail": output.splitlines()[-5:]}
        firsts.append(first)
        exits.append(total)
    first = statistics.median(firsts)
    return {**row, "status": "PASS" if first <= TARGET_S else "MISS", "first_step_s": first,
            "exit_s": statistics.median(exits), "first_step_s_repeats": firsts}


def main(args):
    unknown = [s for s in args.scripts if s not in SCRIPTS]
    if unknown:
        raise UsageError(f"no launch command known for {', '.join(unknown)}; known: {', '.join(SCRIPTS)}")
    machine = report.machine()
    print(report.machine_line(machine), flush=True)
    rows = []
    for script in args.scripts:
        rows.append(measure(script, args.repeats, args.launch_timeout))
        row = rows[-1]
        print(f"{script}: {row['status']}"
              + (f" {row['first_step_s']:.1f} s" if "first_step_s" in row else "")
              + (f" ({row['reason']})" if "reason" in row else ""), flush=True)
    machine["load_average_after"] = report.machine()["load_average_1_5_15min"]
    print(report.table(
        ["script", "first step", "exit", "status", "command"],
        [[r["script"], f"{r['first_step_s']:.1f} s" if "first_step_s" in r else "-",
          f"{r['exit_s']:.1f} s" if "exit_s" in r else "-", r["status"], r["command"]] for r in rows]))
    for r in rows:
        if r["status"] == "failed":
            print(f"{r['script']} failed ({r['reason']}):\n  " + "\n  ".join(r["output_tail"]))
    counts = {s: sum(r["status"] == s for r in rows) for s in ("PASS", "MISS", "failed")}
    print(f"Target: first training step within {TARGET_S:.0f} s of the launch, median of {args.repeats} | "
          + " | ".join(f"{k} {v}" for k, v in counts.items()) + " | load average after "
          + ", ".join(f"{x:.2f}" for x in machine["load_average_after"]))
    result = {"benchmark": "startup", "machine": machine, "target_s": TARGET_S, "repeats": args.repeats,
              "results": rows}
    print(f"Wrote {report.write_json(args.out / 'startup.json', result)}")
    if counts["failed"]:
        sys.exit(1)


if __name__ == "__main__":
    parser = common.ArgumentParser(description="Seconds from launching each example script to its first "
                                            "training step, on the CPU.")
    parser.add_argument("--scripts", nargs="+", default=SCRIPTS, metavar="SCRIPT",
                        help=f"scripts to launch (default: all of {', '.join(SCRIPTS)})")
    parser.add_argument("--repeats", type=common.positive_int, default=3, help="launches per script; median reported")
    parser.add_argument("--launch_timeout", type=common.positive_float, default=300,
                        help="seconds before a launch is killed and counted as failed (default 300)")
    parser.add_argument("--out", type=Path, default=report.DEFAULT_OUT, help="folder for the JSON")
    common.run(main, parser)
