"""torchdiagnose (the installed console script) on the tutorial's tensor-parallel and pipeline-parallel steps, with one
rank stalled: the line names the rank, the collective (DTensor's all_reduce and the parallel style and module it
comes from; for a pipeline, the send or recv that never came and the stage it waits on) and the script's line.

The scripts are not edited: the tests' probe (tests/support/sitecustomize.py, DDP_EXAMPLES_PROBE_STALL) makes one
rank stall in the model's first forward after a given number of optimizer steps (in a pipeline, the stage's forward
of the step's first micro-batch): sleep (its Python waits: the rank is named alive, idle, at its line), stop (it
SIGSTOPs itself: named stopped), and backward (it sleeps in the backward of that call). The lines of the scripts are
found in their text, so that edits elsewhere in them do not break the tests.
"""
import re
import threading
import time

from conftest import BIN, REPO, check_no_abort, clean_env, kill_launched, start

TIMEOUT = 6  # the tool's --timeout
HANG_GUARD_S = 180
SIZES = ["--width", "16", "--hidden", "32", "--depth", "2", "--total_epochs", "20", "--save_every", "1000"]
BATCH, WIDTH, MICROBATCHES = 256, 16, 4  # the scripts' default global batch and micro-batches; SIZES's width

def line_of(script, marker):
    """'script:N', the first line of the repository's `script` that holds `marker`."""
    for number, text in enumerate((REPO / script).read_text().splitlines(), 1):
        if marker in text:
            return f"{script}:{number}"
    raise AssertionError(f"{marker!r} is not in {script}")


def diagnosed(tmp_path, script, stall, rank, step):
    """Launch `script` on 2 ranks under torchdiagnose with rank `rank` stalled in step `step`: the tool's line
    (exactly one, repeated as the job's last line) once the job has ended, which it must within HANG_GUARD_S."""
    cmd = [BIN / "torchdiagnose", "--timeout", TIMEOUT, BIN / "torchrun", "--standalone", "--nproc_per_node=2",
           REPO / script, *SIZES, "--snapshot_path", tmp_path / "checkpoints"]
    env = clean_env(OMP_NUM_THREADS=1, DDP_EXAMPLES_PROBE_STALL=f"{stall}:{rank}:{step}")
    process = start(cmd, tmp_path, env)
    hung = threading.Event()
    timer = threading.Timer(HANG_GUARD_S, lambda: (hung.set(), kill_launched()))
    timer.start()
    lines = [(time.monotonic(), line.rstrip("\n")) for line in process.stdout]
    process.wait()
    timer.cancel()
    output = "\n".join(text for _, text in lines)
    assert not hung.is_set(), f"still running after {HANG_GUARD_S}s:\n{output[-3000:]}"
    check_no_abort(output, script)
    assert process.returncode != 0, output[-3000:]
    assert any(f"rank {rank}: stall {stall}" in text for _, text in lines), output[-3000:]  # the probe ran
    found = [text for _, text in lines if text.startswith("diagnose: ")]
    assert len(found) == 1, output[-5000:]
    assert lines[-1][1] == found[0].replace("diagnose: ", "torchdiagnose: verdict: ", 1), output[-3000:]
    stalled = next(moment for moment, text in lines if f"rank {rank}: stall" in text)
    said = next(moment for moment, text in lines if text.startswith("diagnose: "))
    assert said - stalled < TIMEOUT + 15, f"the line came {said - stalled:.0f}s after the stall"
    return found[0]


def test_tensor_parallel_with_a_stopped_rank_names_dtensors_all_reduce_and_its_module(tmp_path):
    # Rank 1 stops before its forward of step 12 (epoch 1, of 8 steps): rank 0 waits in block 0's fc2 all-reduce.
    line = diagnosed(tmp_path, "tensor_parallel.py", "stop", 1, 12)
    head = (rf"diagnose: collective #\d+ \(all_reduce of \[{BATCH}, {WIDTH}\], DTensor in RowwiseParallel of "
            rf"blocks\.0\.fc2 at {re.escape(line_of('tensor_parallel.py', 'self.model(source)'))}\) waited more "
            rf"than --timeout {TIMEOUT}s: rank 1 is stopped by SIGSTOP \(pid \d+, on ")
    assert re.match(head, line), line


def test_tensor_parallel_with_a_rank_stalled_in_backward_names_the_gradients_all_reduce(tmp_path):
    # Rank 1 sleeps in the backward of step 12: rank 0 waits in the all-reduce of block 1's input gradient.
    line = diagnosed(tmp_path, "tensor_parallel.py", "backward", 1, 12)
    backward = re.escape(line_of("tensor_parallel.py", ".backward()"))
    head = (rf"diagnose: collective #\d+ \(all_reduce of \[{BATCH}, {WIDTH}\], DTensor's gradients in backward\(\) "
            rf"at {backward}\) waited more than --timeout {TIMEOUT}s: rank 1 did not arrive: it is alive, in its own "
            rf"code at {backward} \(innermost: sitecustomize\.py:\d+ in <lambda>\), idle")
    assert re.match(head, line), line


def test_pipeline_with_a_stage_stalled_in_python_names_the_recv_that_never_came(tmp_path):
    # Rank 0 (stage 0) sleeps in the forward of step 10's first micro-batch (epoch 1): stage 1 has finished step 9
    # and waits for that micro-batch's activations.
    line = diagnosed(tmp_path, "pipeline_parallel.py", "sleep", 0, 10)
    step = re.escape(line_of("pipeline_parallel.py", "self.schedule.step("))
    head = (rf"diagnose: p2p recv of \[{BATCH // MICROBATCHES}, {WIDTH}\] from stage 0 \(rank 0\), the activations "
            rf"for stage 1's forward, at {step} waited more than --timeout {TIMEOUT}s: rank 0 did not send it: it is "
            rf"alive, in its own code at pipeline_parallel\.py:\d+ \(innermost: sitecustomize\.py:\d+ in "
            rf"forward_or_stall\), idle")
    assert re.match(head, line), line
    assert "flight recorder: `torchfrtrace fr_traces/" in line, line  # both ranks answered


def test_pipeline_with_a_stopped_stage_names_the_p2p_op_and_the_stage_it_waits_on(tmp_path):
    # Rank 1 (stage 1) stops in the forward of step 10's first micro-batch, whose activations it has received:
    # stage 0 waits to send it the next micro-batch's (gloo's send waits for the matching recv), or for the first
    # one's gradients, as the schedule has it.
    line = diagnosed(tmp_path, "pipeline_parallel.py", "stop", 1, 10)
    op = (rf"(send of \[{BATCH // MICROBATCHES}, {WIDTH}\] to stage 1 \(rank 1\), stage 0's activations|recv of "
          rf"\[{BATCH // MICROBATCHES}, {WIDTH}\] from stage 1 \(rank 1\), the gradients for stage 0's backward)")
    head = (rf"diagnose: p2p {op}, at {re.escape(line_of('pipeline_parallel.py', 'self.schedule.step('))} waited "
            rf"more than --timeout {TIMEOUT}s: rank 1 is stopped by SIGSTOP \(pid \d+, on ")
    assert re.match(head, line), line
