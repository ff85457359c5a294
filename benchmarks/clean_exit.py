"""Clean exits: launch every script that starts processes or a process group, many times, under each of
its launchers, and count the runs that finished cleanly.

    python benchmarks/clean_exit.py                          # 15 launches of each of 16 jobs: 240 launches
    python benchmarks/clean_exit.py --repeats 3 --jobs multigpu.py torchrun_ddp.py

A clean exit: exit code 0 and none of `terminate called`, `SIGABRT`, `Segmentation fault` in the output.
torchrun can report a worker that aborted after the run had finished (its summary printed) as a failed
job, or not at all; mp.spawn reports it as a killed process; the text catches what the exit code misses.
The jobs are the tiny launches of benchmarks/launches.py (2 CPU processes each, python, torchrun, mp.spawn
and mpirun). A launch that runs past --launch_timeout is killed and counted as a hang. Exits 1 if any
launch was not clean. Writes clean_exit.json to --out (default benchmarks/results).
"""
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file: make the repository importable
from benchmarks import common, report
from benchmarks.common import UsageError
from benchmarks.launches import LAUNCHES, aborted, launch_argv, launch_env, launch_once

# singlegpu.py starts neither processes nor a process group: nothing for it to tear down.
JOBS = [name for name in LAUNCHES if name != "singlegpu.py"]


def stress(name, repeats, timeout):
    row = {"job": name, "launches": 0, "clean": 0, "aborted": 0, "hung": 0, "failed": 0, "failures": []}
    for attempt in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            _, seconds, code, output = launch_once(launch_argv(name, tmp), tmp, launch_env(name), timeout)
        row["launches"] += 1
        markers = aborted(output)
        if code == 0 and not markers:
            row["clean"] += 1
            continue
        kind = "aborted" if markers else "hung" if code == -9 and seconds >= timeout else "failed"
        row[kind] += 1
        row["failures"].append({"launch": attempt, "exit_code": code, "markers": markers,
                                "output_tail": output.splitlines()[-8:]})
    return row


def main(args):
    unknown = [job for job in args.jobs if job not in JOBS]
    if unknown:
        raise UsageError(f"unknown job {', '.join(unknown)}; known: {', '.join(JOBS)}")
    machine = report.machine()
    print(report.machine_line(machine), flush=True)
    rows, start = [], time.perf_counter()
    for name in args.jobs:
        rows.append(stress(name, args.repeats, args.launch_timeout))
        r = rows[-1]
        print(f"{name}: {r['clean']}/{r['launches']} clean"
              + "".join(f", {r[k]} {k}" for k in ("aborted", "hung", "failed") if r[k]), flush=True)
    machine["load_average_after"] = report.machine()["load_average_1_5_15min"]
    print(report.table(["job", "launches", "clean", "aborted", "hung", "failed"],
                       [[r["job"], r["launches"], r["clean"], r["aborted"], r["hung"], r["failed"]] for r in rows]))
    for r in rows:
        for failure in r["failures"]:
            print(f"{r['job']} launch {failure['launch']}: exit code {failure['exit_code']}, markers "
                  f"{failure['markers']}:\n  " + "\n  ".join(failure["output_tail"]))
    total = {k: sum(r[k] for r in rows) for k in ("launches", "clean", "aborted", "hung", "failed")}
    print(f"Total: {total['clean']} of {total['launches']} launches exited cleanly | aborted {total['aborted']} | "
          f"hung {total['hung']} | failed {total['failed']} | {time.perf_counter() - start:.0f} s | load average "
          "after " + ", ".join(f"{x:.2f}" for x in machine["load_average_after"]))
    result = {"benchmark": "clean_exit", "machine": machine, "torch": torch.__version__, "repeats": args.repeats,
              "total": total, "results": rows}
    print(f"Wrote {report.write_json(args.out / 'clean_exit.json', result)}")
    if total["clean"] != total["launches"]:
        sys.exit(1)


if __name__ == "__main__":
    parser = common.ArgumentParser(description="Launch every distributed job many times; count the clean exits.")
    parser.add_argument("--jobs", nargs="+", default=JOBS, metavar="JOB",
                        help=f"jobs to launch (default: all of {', '.join(JOBS)})")
    parser.add_argument("--repeats", type=common.positive_int, default=15, help="launches per job (default 15)")
    parser.add_argument("--launch_timeout", type=common.positive_float, default=300,
                        help="seconds before a launch is killed and counted as hung (default 300)")
    parser.add_argument("--out", type=Path, default=report.DEFAULT_OUT, help="folder for the JSON")
    common.run(main, parser)
