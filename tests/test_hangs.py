"""A rank that hangs or leaves, under the real launchers: the other ranks' one line names the rank, the
collective and where to look, within --timeout plus the few seconds they spend asking each other
(ddp_common/hangs.py), and nothing is left running (conftest fails a test whose processes outlive it).

hangs.py breaks its rank itself (--fault); the training scripts are broken from outside: a wrapper that runs the
real script with runpy and deadlocks, kills or miscalls on one rank after a chosen optimizer step (torchrun,
mpirun), or a real SIGSTOP of one process (mp.spawn, whose children the wrapper would not reach).
"""
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from conftest import (BIN, REPO, check_no_abort, clean_env, kill_launched, mpi_env, mpirun_cmd, python_cmd, run,
                      start, torchrun_cmd)
from ddp_common import hangs
from test_elastic import signal_pending

TIMEOUT = 8  # --timeout: long enough that a loaded 2-core machine never trips it in healthy steps
# After the fault: --timeout for the waiting ranks, then at most hangs.WAIT_S asking the others; the rest is
# slack for a loaded machine (the launcher's teardown, a slow interpreter exit).
DEADLINE_S = TIMEOUT + hangs.WAIT_S + 20
HANG_GUARD_S = 240  # a launch still running then is called hung (and killed, and the test fails)
MLP_PARAMETERS = 20 * 64 + 64 + 64 * 64 + 64 + 64 + 1  # ddp_common.models.MLP(20): one gradient bucket


def watch(cmd, cwd, env=None, aborts=False):
    """Run a launch to its end, every line of its output (stdout and stderr) with the time it came:
    (exit code, [(time, line)]). A launch that outlives HANG_GUARD_S is killed and fails the test."""
    process = start(cmd, cwd, env)
    hung = threading.Event()

    def guard():
        hung.set()
        kill_launched()

    timer = threading.Timer(HANG_GUARD_S, guard)
    timer.start()
    lines = [(time.monotonic(), line.rstrip("\n")) for line in process.stdout]
    process.wait()
    timer.cancel()
    output = "\n".join(line for _, line in lines)
    if hung.is_set():
        pytest.fail(f"{' '.join(map(str, cmd))} still running after {HANG_GUARD_S}s:\n{output[-3000:]}")
    if not aborts:
        check_no_abort(output, " ".join(map(str, cmd)))
    return process.returncode, lines


def when(lines, fragment):
    """The time of the first line holding `fragment`; fails the test if none does."""
    for moment, line in lines:
        if fragment in line:
            return moment
    pytest.fail(f"no line with {fragment!r} in:\n" + "\n".join(line for _, line in lines)[-4000:])


def error_lines(lines):
    return [line for _, line in lines if line.startswith("error: ")]


def the_error(lines, count=None):
    """The error line (every rank that speaks says the same); `count`: how many ranks must say it."""
    found = error_lines(lines)
    assert found, "\n".join(line for _, line in lines)[-4000:]
    if count is not None:
        assert len(found) == count, found
    return found[0]


def ends_in_time(lines, fault_fragment, deadline=DEADLINE_S):
    """The launch ended within `deadline` seconds of the line that announced the fault."""
    took = lines[-1][0] - when(lines, fault_fragment)
    assert took < deadline, f"the launch ended {took:.1f}s after the fault, more than {deadline}s"
    return took


def hangs_py(cwd, fault, detail=False, aborts=False, nproc=2):
    """hangs.py under torchrun (`nproc` ranks), rank 1 breaking at step 3: watch()'s (exit code, lines)."""
    command = torchrun_cmd("hangs.py", "--fault", fault, "--fault_rank", "1", "--at_step", "3", "--timeout",
                           str(TIMEOUT), nproc=nproc)
    return watch(command, cwd, clean_env(TORCH_DISTRIBUTED_DEBUG="DETAIL") if detail else clean_env(), aborts)


def dumps(cwd):
    """{folder: [ranks]} of the flight recorder dumps written under cwd/fr_traces."""
    return {folder.name: sorted(int(p.name.split("_")[-1]) for p in folder.iterdir())
            for folder in (cwd / "fr_traces").iterdir()} if (cwd / "fr_traces").exists() else {}


# ---- hangs.py under torchrun: the lesson's five ways ----

@pytest.mark.slow
def test_a_skipped_collective_is_named_on_both_sides_and_torchfrtrace_finds_the_culprit(tmp_path):
    """Rank 1 skips the step's all_gather: it goes on to the next step's gradient all_reduce, which gloo cannot
    pair with rank 0's all_gather; both wait --timeout, then name both sides."""
    code, lines = hangs_py(tmp_path, "skip")
    assert code != 0
    line = the_error(lines)
    assert line.startswith("error: lost contact with the other ranks: the ranks called different collectives at #")
    assert "rank 0 all_gather of [2] at hangs.py:" in line, line
    assert f"rank 1 all_reduce of [{MLP_PARAMETERS}], DDP's gradients in backward() at hangs.py:" in line, line
    assert "TORCH_DISTRIBUTED_DEBUG=DETAIL" in line and "torchfrtrace fr_traces/" in line, line
    assert set(error_lines(lines)) == {line}, "every rank says the same"
    ends_in_time(lines, "rank 1: --fault skip at step 3")
    (folder, ranks), = dumps(tmp_path).items()
    assert ranks == [0, 1] and f"torchfrtrace fr_traces/{folder}`" in line
    # The dumps are what torchfrtrace reads (torch 2.13's gloo dumps alone make it fail: diagnose.lines.for_torchfrtrace).
    analysis = subprocess.run([BIN / "torchfrtrace", f"fr_traces/{folder}"], cwd=tmp_path, capture_output=True,
                              text=True, timeout=120)
    report = analysis.stdout + analysis.stderr  # torchfrtrace reports through logging, on stderr
    assert analysis.returncode == 0, report[-3000:]
    assert "Culprit rank 1" in report and "'all_gather' does not match found collective type: 'all_reduce'" in report, \
        report[-3000:]


def test_another_collective_is_named_on_both_sides(tmp_path):
    code, lines = hangs_py(tmp_path, "other_collective")
    assert code != 0
    line = the_error(lines)
    assert "the ranks called different collectives at #" in line, line
    assert "rank 0 all_gather of [2] at hangs.py:" in line and "rank 1 all_reduce of [2] at hangs.py:" in line, line
    ends_in_time(lines, "rank 1: --fault other_collective at step 3")


def test_another_shape_aborts_its_rank_and_the_other_names_it_gone(tmp_path):
    """gloo pairs the two all_gathers and aborts the rank that received more than it expected (here rank 1,
    which gathers 1 number where rank 0 gathers 2; rank 0 takes the shorter message and goes on to its next
    collective): rank 0 names it gone, at once."""
    code, lines = hangs_py(tmp_path, "other_shape", aborts=True)
    assert code != 0
    output = "\n".join(line for _, line in lines)
    assert "Received data size doesn't match expected size" in output, output[-3000:]
    line = the_error(lines, count=1)
    assert line.startswith("error: lost contact with the other ranks at collective #"), line
    assert "(all_gather of [2] at hangs.py:" in line or f"(all_reduce of [{MLP_PARAMETERS}]" in line, line
    assert "rank 1 did not answer: gone" in line, line
    ends_in_time(lines, "rank 1: --fault other_shape at step 3", deadline=20)


@pytest.mark.slow
def test_a_rank_stuck_in_its_own_code_is_named_and_shows_where_it_waits(tmp_path):
    code, lines = hangs_py(tmp_path, "stall")
    assert code != 0
    line = the_error(lines, count=1)
    assert line.startswith("error: lost contact with the other ranks at collective #"), line
    assert f"(all_reduce of [{MLP_PARAMETERS}], DDP's gradients in backward() at hangs.py:" in line, line
    assert f"rank 1 did not arrive within --timeout {TIMEOUT}s and did not answer either" in line, line
    assert "stuck in its own code" in line and "py-spy dump --pid" in line, line
    took = ends_in_time(lines, "rank 1: --fault stall at step 3")
    assert took > TIMEOUT, "rank 0 waited --timeout"
    # torchrun stops the stuck rank with SIGTERM; hangs.py has faulthandler print where it was.
    assert any(line.strip().endswith(" in stall") for _, line in lines), "\n".join(l for _, l in lines)[-3000:]
    assert dumps(tmp_path) and all(ranks == [0] for ranks in dumps(tmp_path).values())
    assert "--allow-incomplete-ranks" in line, line


@pytest.mark.slow
def test_at_3_ranks_a_stuck_rank_is_named_stuck_by_both_others(tmp_path):
    """Ranks 0 and 2 both wait --timeout for rank 1; the first to time out closes its connections to the other,
    which may see "Connection closed by peer" a moment before its own timeout. That closure is a live rank's
    timeout, not rank 1's death: both name rank 1 alive and stuck (hangs._shows_a_rank_gone)."""
    code, lines = hangs_py(tmp_path, "stall", nproc=3)
    assert code != 0
    found = error_lines(lines)
    assert len(found) == 2, found
    for line in found:
        assert line.startswith("error: lost contact with the other ranks at collective #"), line
        assert f"rank 1 did not arrive within --timeout {TIMEOUT}s and did not answer either" in line, line
        assert "stuck in its own code" in line and "gone" not in line, line
    ends_in_time(lines, "rank 1: --fault stall at step 3")


@pytest.mark.quick
def test_a_killed_rank_is_named_gone_at_once(tmp_path):
    code, lines = hangs_py(tmp_path, "die")
    assert code != 0
    line = the_error(lines, count=1)
    assert "rank 1 did not answer: gone, its connection closed (killed, crashed, aborted or finished" in line, line
    assert "(all_gather of [2] at hangs.py:" in line or f"(all_reduce of [{MLP_PARAMETERS}]" in line, line
    output = "\n".join(l for _, l in lines)
    assert "Signal 9 (SIGKILL)" in output, "torchrun's report says how rank 1 ended"
    ends_in_time(lines, "rank 1: --fault die at step 3", deadline=20)


@pytest.mark.parametrize("fault, rank0, rank1", [
    ("other_collective", "rank 0 all_gather of [2] (Float)", "rank 1 all_reduce of [2] (Float)"),
    ("other_shape", "rank 0 all_gather of [2] (Float)", "rank 1 all_gather of [1] (Float)")])
def test_debug_detail_reports_a_mismatch_on_every_rank_at_once(tmp_path, fault, rank0, rank1):
    """TORCH_DISTRIBUTED_DEBUG=DETAIL (with DDP: torch 2.13 would crash in DDP's constructor without
    hangs.work_around_detail_crash) checks every collective before it runs: no rank waits out --timeout."""
    code, lines = hangs_py(tmp_path, fault, detail=True)
    assert code != 0
    found = error_lines(lines)
    assert len(found) == 2, found
    for line in found:
        assert line.startswith("error: the ranks called different collectives at #"), line
        assert rank0 in line and rank1 in line, line
        assert "TORCH_DISTRIBUTED_DEBUG=DETAIL stopped them before any waited" in line, line
    ends_in_time(lines, f"rank 1: --fault {fault} at step 3", deadline=TIMEOUT)


# ---- the training scripts under their launchers ----

FAULTY = """\
import os, runpy, signal, sys, threading
sys.path.insert(0, {repo!r})
import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

FAULT, RANK, STEP = {fault!r}, {rank}, {step}
steps = [0]


def after_step(optimizer, args, kwargs):
    steps[0] += 1
    if steps[0] != STEP or dist.get_rank() != RANK:
        return
    os.write(1, f"fault: rank {{RANK}} {{FAULT}} after step {{STEP}}\\n".encode())
    if FAULT == "stall":  # a deadlock in the rank's own code
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()
    if FAULT == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    if FAULT == "other":  # the rank's next all_reduce (the epoch's loss) becomes a broadcast
        all_reduce = dist.all_reduce

        def broadcast_once(tensor, *args, **kwargs):
            dist.all_reduce = all_reduce
            return dist.broadcast(tensor, src=0)
        dist.all_reduce = broadcast_once


register_optimizer_step_post_hook(after_step)
sys.argv[0] = {script!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def faulty(tmp_path, script, fault, rank=1, step=40):
    """A wrapper that runs `script` and breaks `rank` after its optimizer step `step` (in the second epoch of
    the tutorial's 32 steps): its path."""
    path = tmp_path / f"faulty_{fault}.py"
    path.write_text(FAULTY.format(repo=str(REPO), script=str(REPO / script), fault=fault, rank=rank, step=step))
    return path


TRAIN = ("--total_epochs", "1000", "--save_every", "1000", "--timeout", str(TIMEOUT))


@pytest.mark.slow
def test_multigpu_torchrun_names_a_stuck_rank_and_its_collective(tmp_path):
    code, lines = watch(torchrun_cmd(faulty(tmp_path, "multigpu_torchrun.py", "stall"), *TRAIN), cwd=tmp_path)
    assert code != 0
    line = the_error(lines, count=1)
    assert line.startswith("error: lost contact with the other ranks at collective #"), line
    assert f"(all_reduce of [{MLP_PARAMETERS}], DDP's gradients in backward() at multigpu_torchrun.py:" in line, line
    assert f"rank 1 did not arrive within --timeout {TIMEOUT}s" in line and "stuck in its own code" in line, line
    assert "torchrun starts" not in line and "start again" in line, "the launcher's tail stays"
    ends_in_time(lines, "fault: rank 1 stall")


def test_multigpu_torchrun_names_both_sides_of_another_collective(tmp_path):
    code, lines = watch(torchrun_cmd(faulty(tmp_path, "multigpu_torchrun.py", "other", step=32), *TRAIN),
                        cwd=tmp_path)
    assert code != 0
    line = the_error(lines)
    assert "the ranks called different collectives at #" in line, line
    assert "rank 0 all_reduce of [] at multigpu_torchrun.py:" in line and "rank 1 broadcast of []" in line, line
    ends_in_time(lines, "fault: rank 1 other")


def spawned_ranks(pid):
    """The mp.spawn children of `pid`, in the order they were started (rank 0 first)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"spawn_main" in cmdline:
                found.append(int(entry.name))
    return sorted(found)


def alive(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_multigpu_mp_spawn_names_a_stopped_rank(tmp_path):
    """A real SIGSTOP of rank 1 (alive, its connections open, doing nothing): rank 0 names it after --timeout.
    SIGCONT once rank 0 has gone, so that mp.spawn's SIGTERM reaches it (a stopped process would keep
    mp.spawn waiting 30 s before its SIGKILL)."""
    job = start(python_cmd("multigpu.py", "--world_size", "2", "--save_every", "1", "--total_epochs", "1000",
                           "--timeout", str(TIMEOUT)), cwd=tmp_path)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic(), line.rstrip("\n"))
                                                          for line in job.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + HANG_GUARD_S
    while not (tmp_path / "multigpu.pt").exists() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    ranks = spawned_ranks(job.pid)
    assert len(ranks) == 2, (ranks, lines[-20:])
    os.kill(ranks[1], signal.SIGSTOP)
    stopped = time.monotonic()
    while alive(ranks[0]) and time.monotonic() < stopped + HANG_GUARD_S:
        time.sleep(0.05)
    gone = time.monotonic() - stopped
    # Continued before mp.spawn's SIGTERM is pending, rank 1 would run on, find rank 0 gone and speak too.
    while not signal_pending(ranks[1], signal.SIGTERM) and job.poll() is None \
            and time.monotonic() < stopped + 2 * HANG_GUARD_S:
        time.sleep(0.05)
    os.kill(ranks[1], signal.SIGCONT)
    job.wait(timeout=HANG_GUARD_S)
    reader.join(timeout=30)
    output = "\n".join(line for _, line in lines)
    check_no_abort(output, "multigpu.py")
    assert job.returncode != 0
    line = the_error(lines, count=1)
    assert line.startswith("error: lost contact with the other ranks at collective #"), line
    assert "DDP's gradients in backward() at multigpu.py:" in line or "all_reduce of [] at multigpu.py" in line, line
    assert f"rank 1 did not arrive within --timeout {TIMEOUT}s" in line and "stuck in its own code" in line, line
    assert TIMEOUT < gone < DEADLINE_S, gone


@pytest.mark.slow
def test_mpirun_train_names_a_stuck_rank(tmp_path):
    code, lines = watch(mpirun_cmd(faulty(tmp_path, "run_with_mpirun.py", "stall"), "--train", *TRAIN),
                        cwd=tmp_path, env=mpi_env())
    assert code != 0
    line = the_error(lines, count=1)
    assert f"(all_reduce of [{MLP_PARAMETERS}], DDP's gradients in backward() at run_with_mpirun.py:" in line, line
    assert f"rank 1 did not arrive within --timeout {TIMEOUT}s" in line and "stuck in its own code" in line, line
    ends_in_time(lines, "fault: rank 1 stall")


# ---- the line itself, without launching ----

def entry(rank, seq=17, kind="all_reduce", shapes="[5569]", cause="timeout", **extra):
    return {"rank": rank, "seq": seq, "kind": kind, "shapes": shapes, "cause": cause, "site": "train.py:9",
            "backward": False, "timeout_s": 5.0, "gap_s": None, "absent": [], "recorder": True,
            "error": "Timed out waiting 5000ms for recv operation to complete", **extra}


@pytest.mark.quick
def test_the_line_names_the_odd_rank_out_and_the_silent_ones():
    entries = {r: entry(r) for r in (0, 2)} | {1: entry(1, kind="broadcast", shapes="[2]")}
    line = hangs.compose(entries[0], entries, 4)
    assert "the ranks called different collectives at #17" in line, line
    assert "rank 1 broadcast of [2] at train.py:9" in line and "ranks 0, 2 all_reduce of [5569]" in line, line
    assert "rank 1 is the odd one out" in line, line
    assert "rank 3 did not arrive within --timeout 5s" in line, line
    gone = hangs.compose(entry(0, cause="closed"), {0: entry(0, cause="closed")}, 2)
    assert "rank 1 did not answer: gone, its connection closed" in gone, gone
    late = entry(1, gap_s=12.0)
    assert "this rank (1) is the one that stopped: it spent 12s in its own code" in hangs.compose(late, {1: late}, 2)
    lost = hangs.compose(entry(1, cause="closed"), {}, 2, store_lost=True)
    assert "rank 0, which hosts it, is gone" in lost, lost


@pytest.mark.quick
def test_at_3_ranks_a_connection_closed_by_another_ranks_timeout_names_no_rank_gone():
    """Rank 1 stuck; rank 0 times out first and closes its connections, so rank 2 sees "Connection closed by
    peer" --timeout into its collective: rank 0's doing, not rank 1's death."""
    closed_late = entry(2, cause="closed", waited_s=5.0, error="Connection closed by peer [127.0.0.1]:40000")
    views = {0: entry(0, waited_s=5.0), 2: closed_late}
    for me in views.values():
        line = hangs.compose(me, views, 3)
        assert "rank 1 did not arrive within --timeout 5s and did not answer either: alive" in line, line
        assert "gone" not in line, line
    # Closed as late with no answering rank's timeout to explain it, or closed early: rank 1 is gone.
    alone = {0: entry(0, cause="closed", waited_s=5.0), 2: closed_late}
    assert "rank 1 did not answer: gone, its connection closed" in hangs.compose(alone[2], alone, 3)
    early = {0: entry(0, waited_s=5.0), 2: entry(2, cause="closed", waited_s=0.1)}
    assert "rank 1 did not answer: gone, its connection closed" in hangs.compose(early[2], early, 3)
    # Rank 2 stopped by the launcher before rank 0 answered: a closed connection shows one rank gone, not which.
    stopped = entry(2, cause="closed", waited_s=0.1)
    line = hangs.compose(stopped, {2: stopped}, 3, stopped=True)
    assert "ranks 0, 1 did not answer: at least one of them is gone" in line, line
    assert "the launcher stopped this rank before all had answered" in line, line


@pytest.mark.slow
def test_the_cost_benchmark_runs_and_writes_its_figures(tmp_path):
    """benchmarks/hang_diagnosis.py at a smoke-test size: the three settings side by side, one JSON."""
    out = run(python_cmd("benchmarks/hang_diagnosis.py", "--repeats", "1", "--steps", "20", "--warmup", "2",
                         "--collectives", "40", "--out", tmp_path), cwd=tmp_path, timeout=HANG_GUARD_S).stdout
    assert "Flight recorder cost" in out, out[-2000:]
    data = json.loads((tmp_path / "hang_diagnosis.json").read_text())
    assert data["machine"]["cpu_cores"] >= 1 and data["torch"] and data["world_size"] == 2
    assert len(data["results"]) == 3
    for figures in data["results"].values():
        assert all(figures[f"{name}_median"] > 0 for name in ("step_us", "all_reduce_us", "step_cpu_us",
                                                              "all_reduce_cpu_us"))
    assert set(data["flight_recorder_cost"]) >= {"step_cpu_us", "all_reduce_cpu_us", "step_us", "all_reduce_us"}
