"""hangs.py under the diagnosis tool, as docs/hangs.md runs it: each way of breaking rank 1 is named by the tool's
one line (the rank, the collective, the line of hangs.py) and the job ends within the tool's --timeout plus some
seconds, with nothing left running (conftest fails a test whose processes outlive it). The tool's own tests, on a
user's script under every launcher, are in test_diagnose.py; here run_with_mpirun.py --train is broken from outside
by a wrapper that deadlocks one rank after an optimizer step.
"""
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import (BIN, PROGRAMS, REPO, assert_one_line_error, clean_env, mpi_env, mpirun_cmd, python_cmd,
                      rank_0_env, run, torchrun_cmd, watch)

TIMEOUT = 8  # the tool's --timeout: long enough that a loaded 2-core machine never trips it in healthy steps
DEADLINE_S = TIMEOUT + 30  # from the fault to the job's end
MLP_PARAMETERS = 20 * 64 + 64 + 64 * 64 + 64 + 64 + 1  # models_and_data.MLP(20): one gradient bucket
SOURCE = (REPO / "hangs.py").read_text().splitlines()
TOOL_SOURCE = REPO / "diagnose" / "src"  # the tool's package, as an editable install points at it


def line_of(marker, source=SOURCE, name="hangs.py"):
    """'hangs.py:N', the line of hangs.py that holds `marker` (exactly one)."""
    found = [number for number, text in enumerate(source, 1) if marker in text]
    assert len(found) == 1, (marker, found)
    return f"{name}:{found[0]}"


def diagnosed(launch):
    """torchdiagnose (the package requirements-dev.txt installs) in front of a launch."""
    return [BIN / "torchdiagnose", "--timeout", str(TIMEOUT), *map(str, launch)]


def the_line(lines):
    """The tool's line: exactly one (one host), whatever the launcher printed around it; the job's last line says
    it again, after the launcher's report."""
    found = [line for _, line in lines if line.startswith("diagnose: ")]
    assert len(found) == 1, "\n".join(line for _, line in lines)[-5000:]
    assert lines[-1][1] == found[0].replace("diagnose: ", "torchdiagnose: verdict: ", 1), lines[-1][1]
    return found[0]


def ends_in_time(lines, fault_fragment, deadline=DEADLINE_S):
    """The launch ended within `deadline` seconds of the line that announced the fault."""
    start_at = next((moment for moment, line in lines if fault_fragment in line), None)
    assert start_at is not None, "\n".join(line for _, line in lines)[-4000:]
    took = lines[-1][0] - start_at
    assert took < deadline, f"the launch ended {took:.1f}s after the fault, more than {deadline}s"
    return took


def hangs_py(cwd, fault, aborts=False):
    """hangs.py under the tool and torchrun, rank 1 breaking at step 3: (exit code, the tool's line, lines)."""
    launch = torchrun_cmd("hangs.py", "--fault", fault, "--fault_rank", "1", "--at_step", "3")
    code, lines = watch(diagnosed(launch), cwd, clean_env(), aborts)
    assert code != 0
    ends_in_time(lines, f"rank 1: --fault {fault} at step 3")
    return the_line(lines), lines


BACKWARD = f"all_reduce of [{MLP_PARAMETERS}], DDP's gradients in backward() at {line_of('loss.backward()')}"
GATHER = f"all_gather of [2] at {line_of('dist.all_gather(gathered, stats)')}"


def page_command():
    """docs/hangs.md's first command, as written there (torchdiagnose ... torchrun ... hangs.py --steps N), with
    this environment's torchdiagnose and torchrun and the repository's hangs.py: (command, N)."""
    found = [line for line in (REPO / "docs" / "hangs.md").read_text().splitlines()
             if line.startswith("torchdiagnose ") and " hangs.py --steps " in line]
    tokens = shlex.split(found[0])
    paths = {"torchdiagnose": BIN / "torchdiagnose", "torchrun": BIN / "torchrun", "hangs.py": REPO / "hangs.py"}
    return [paths.get(token, token) for token in tokens], int(tokens[tokens.index("--steps") + 1])


@pytest.mark.quick
def test_without_a_fault_it_trains_the_tool_says_nothing_and_the_next_sitecustomize_still_runs(tmp_path):
    """docs/hangs.md's command: a job that does not hang ends as without the tool; the tests' own sitecustomize
    (tests/support), which counts each rank's collectives, still loads after the tool's."""
    command, steps = page_command()
    code, lines = watch(command, tmp_path, clean_env(DDP_EXAMPLES_PROBE_COLLECTIVES=1))
    output = "\n".join(line for _, line in lines)
    assert code == 0, output[-3000:]
    assert f"Trained {steps} steps: no fault, no hang" in output and "diagnose:" not in output, output[-3000:]
    # A gradient all_reduce and an all_gather a step, after DDP's 5 collectives at construction.
    assert output.count(f"issued {5 + 2 * steps} collectives") == 2, output[-3000:]


def test_a_skipped_collective_is_named_on_both_sides_and_torchfrtrace_reads_the_dumps(tmp_path):
    """Rank 1 skips the step's all_gather and goes on to the next step's gradient all_reduce. The dumps land in
    fr_traces/ of the folder the tool runs in, and the hint's torchfrtrace reads them."""
    line, _ = hangs_py(tmp_path, "skip")
    assert line.startswith("diagnose: collective #") and f"({GATHER}) waited more than --timeout {TIMEOUT}s" in line
    assert f"the ranks wait in different collectives: rank 0 in {GATHER}; rank 1 in {BACKWARD}" in line, line
    assert "flight recorder: `torchfrtrace fr_traces/" in line, line
    folder = line.split("torchfrtrace ")[1].split("`")[0]
    assert sorted(p.name for p in (tmp_path / folder).iterdir()) == ["rank_0", "rank_1"]
    report = subprocess.run([BIN / "torchfrtrace", folder], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr[-3000:]
    assert "Culprit rank 1" in report.stdout + report.stderr, (report.stdout + report.stderr)[-3000:]


def test_another_collective_is_named_on_both_sides(tmp_path):
    line, _ = hangs_py(tmp_path, "other_collective")
    other = f"all_reduce of [2] at {line_of('dist.all_reduce(stats)')}"
    assert f"the ranks wait in different collectives: rank 0 in {GATHER}; rank 1 in {other}" in line, line


def test_another_shape_aborts_its_rank_and_is_named(tmp_path):
    """gloo pairs the two all_gathers and aborts the rank that received more than it expected."""
    line, lines = hangs_py(tmp_path, "other_shape", aborts=True)
    assert re.search(r"rank \d is gone: killed by SIGABRT \(pid \d+, on [^)]+\); gloo aborts a process whose peer's "
                     r"collective does not match its own \(another shape or kind\)", line), line
    assert "Received data size doesn't match expected size" in "\n".join(text for _, text in lines)


@pytest.mark.quick
def test_a_rank_stuck_in_its_own_code_is_named_with_its_line_with_torch_outside_its_pythons_own_packages(tmp_path):
    """Rank 0 waits in DDP's gradient all_reduce, rank 1 deadlocks in hangs.py's own code: the collective, rank 1's
    line, and both ranks' dumps. The launch runs in a venv that finds torch through a .pth file in a folder of no
    Python's own (as a venv over a container image's torch can), with the tool installed there as pip installs it
    editable (a .pth to its source, and its hook's .pth): torch's frames (rank 0's backward) are still not taken for
    the script's line (torch/autograd/graph.py was, once, on such a machine)."""
    venv, elsewhere = tmp_path / "venv", tmp_path / "torch-packages"
    elsewhere.symlink_to(Path(torch.__file__).parent.parent)  # the frames' paths then start here
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    python = venv / "bin" / "python"
    packages = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   check=True, capture_output=True, text=True).stdout.strip())
    (packages / "elsewhere.pth").write_text(f"{elsewhere}\n")
    (packages / "_torchdiagnose.pth").write_text(f"{TOOL_SOURCE}\n")
    shutil.copy(TOOL_SOURCE / "torchdiagnose-hook.pth", packages)
    faulty = [REPO / "hangs.py", "--fault", "stall", "--fault_rank", "1", "--at_step", "3"]
    cmd = [python, "-m", "torchdiagnose", "--timeout", str(TIMEOUT), python, "-m", "torch.distributed.run",
           "--standalone", "--nproc_per_node=2", *faulty]
    code, lines = watch(cmd, tmp_path, clean_env())
    assert code != 0
    line = the_line(lines)
    assert line.startswith("diagnose: collective #") and f"({BACKWARD}) waited more than --timeout {TIMEOUT}s" in line
    assert f"rank 1 did not arrive: it is alive, in its own code at {line_of('lock.acquire()  # never returns')}, " \
        "idle" in line, line
    assert "flight recorder: `torchfrtrace fr_traces/" in line, line  # both ranks answered, so both dump
    assert (tmp_path / "fr_traces").is_dir()
    assert ends_in_time(lines, "rank 1: --fault stall at step 3") > TIMEOUT, "rank 0 waited the tool's --timeout"


def test_a_killed_rank_is_named_at_once_with_its_signal(tmp_path):
    """Rank 1 dies after its optimizer step: rank 0's all_gather of the step's numbers fails."""
    line, lines = hangs_py(tmp_path, "die")
    assert line.startswith("diagnose: collective #") and f"({GATHER}) failed (" in line, line
    assert "rank 1 is gone: killed by SIGKILL" in line and "no torchfrtrace: rank 1 did not answer" in line, line
    killed = next(moment for moment, text in lines if "--fault die at step 3" in text)
    said = next(moment for moment, text in lines if text.startswith("diagnose: "))
    assert said - killed < 10, f"the line came {said - killed:.0f}s after the kill"


@pytest.mark.quick
@pytest.mark.parametrize("args, env, message", [
    # As rank 0 of a launch of 2, alone: hangs.py checks --fault_rank before its process group, as every rank would.
    (("--fault_rank", "2"), rank_0_env(2), "hangs.py: error: --fault_rank 2 is not a rank of 2 (0 to 1)"),
    (("--fault", "stall"), None, "hangs.py: error: start it with torchrun, under the diagnosis tool"),
], ids=["fault-rank-out-of-range", "without-torchrun"])
def test_bad_input_is_one_line(tmp_path, args, env, message):
    result = run(python_cmd("hangs.py", *args), cwd=tmp_path, env=env, check=False, timeout=90)
    assert_one_line_error(result, message, code=2)


@pytest.mark.slow
def test_mpirun_train_under_the_tool_names_a_stuck_rank(tmp_path):
    """run_with_mpirun.py --train, rank 1 deadlocked after its 40th step by a wrapper: the tool names it."""
    launch = mpirun_cmd(PROGRAMS / "stall_at_step_40.py", REPO / "run_with_mpirun.py", "--train", "--total_epochs",
                        "1000", "--save_every", "1000")
    code, lines = watch(diagnosed(launch), tmp_path, mpi_env())
    assert code != 0
    line = the_line(lines)
    script = (REPO / "run_with_mpirun.py").read_text().splitlines()
    backward = line_of("loss.backward()", script, "run_with_mpirun.py")
    assert f"(all_reduce of [{MLP_PARAMETERS}], DDP's gradients in backward() at {backward})" in line, line
    # The script the rank runs (run_with_mpirun.py, which the wrapper runs as __main__) first, at its call that led
    # to the stall; then the innermost frame, the wrapper's hook.
    step = line_of("optimizer.step()", script, "run_with_mpirun.py")
    stall = line_of("# the stall", (PROGRAMS / "stall_at_step_40.py").read_text().splitlines(), "stall_at_step_40.py")
    assert f"rank 1 did not arrive: it is alive, in its own code at {step} (innermost: {stall} in after_step)" \
        in line, line
    ends_in_time(lines, "rank 1: stall at step 40")


@pytest.mark.slow
def test_the_flight_recorder_benchmark_runs_and_writes_its_figures(tmp_path):
    """benchmarks/hang_diagnosis.py (the cost of the flight recorder the tool reads) at a smoke-test size: the
    three settings side by side, one JSON."""
    out = run(python_cmd("benchmarks/hang_diagnosis.py", "--repeats", "1", "--steps", "20", "--warmup", "2",
                         "--collectives", "40", "--out", tmp_path), cwd=tmp_path, timeout=240).stdout
    assert "Flight recorder cost" in out, out[-2000:]
    data = json.loads((tmp_path / "hang_diagnosis.json").read_text())
    assert data["machine"]["cpu_cores"] >= 1 and data["torch"] and data["world_size"] == 2
    assert len(data["results"]) == 3
    for figures in data["results"].values():
        assert all(figures[f"{name}_median"] > 0 for name in ("step_us", "all_reduce_us", "step_cpu_us",
                                                              "all_reduce_cpu_us"))
    assert set(data["flight_recorder_cost"]) >= {"step_cpu_us", "all_reduce_cpu_us", "step_us", "all_reduce_us"}
