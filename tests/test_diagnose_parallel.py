"""torchdiagnose (the installed console script) on the tutorial's tensor-parallel and pipeline-parallel steps, with one
rank stalled: the line names the rank, the collective (DTensor's all-gather of a layer's sequence-parallel input, or of
a gradient in backward; for a pipeline, the send or recv that never came and the stage it waits on) and the script's
line.

The scripts are not edited, and train language_model.Decoder at SIZES on a few thousand characters of the default
text: the tests' probe (tests/support/sitecustomize.py, DDP_EXAMPLES_PROBE_STALL) makes one rank stall in the first
DecoderLayer.forward it runs after a given number of optimizer steps (tensor parallelism: layers.0; in a pipeline,
the stage's first layer, for the step's first micro-batch), once the layer's input has arrived: sleep (its Python
waits: the rank is named alive, idle, at its line), stop (it SIGSTOPs itself: named stopped), and backward (it sleeps
in the backward of that call, when the gradient of the layer's output has come), kill and skip (it leaves the layer
out). On a mesh the line names each waiting rank's collective in its group (DTensor's all-gather, a pipeline's send,
FSDP2's reduce-scatter). The lines of the scripts are found in their text, so that edits elsewhere in them do not
break the tests.
"""
import re
import subprocess

from conftest import (BIN, REPO, clean_env, watch)
from language_model import read_text

TIMEOUT = 6  # the tool's --timeout
MESH_TIMEOUT = 12  # 4 and 8 processes share the 2 cores: twice the margin of the 2-process tests
HANG_GUARD_S = 180
# A small decoder: 14 steps an epoch on TEXT_CHARACTERS of text; the stalls come in the first epoch, the second is
# a margin. No checkpoint is due before the stall, and no sample after it.
SIZES = ["--dim", "32", "--n_layers", "2", "--n_heads", "4", "--n_kv_heads", "2", "--hidden", "64",
         "--seq_len", "16", "--global_batch_size", "16", "--log_every", "0", "--sample", "0",
         "--total_epochs", "2", "--save_every", "1000"]
BATCH, SEQ, DIM = 16, 16, 32  # SIZES's global batch (sequences), sequence length and width
MICROBATCHES = 2  # pipeline_parallel.py's default on 2 ranks (1f1b: one a stage)
TEXT_CHARACTERS = 4000  # of language_model.read_text()'s default text (data/shakespeare)

def line_of(script, marker):
    """'script:N', the first line of the repository's `script` that holds `marker`."""
    for number, text in enumerate((REPO / script).read_text().splitlines(), 1):
        if marker in text:
            return f"{script}:{number}"
    raise AssertionError(f"{marker!r} is not in {script}")


def waiting(line):
    """The line's 'waiting: ' part on a mesh: {'rank 1': 'the collective above of dp_shard group [1, 3]', ...}."""
    return dict(re.findall(r"(?:waiting: |; )(rank \d) in (.*?), for rank", line))


def diagnosed(tmp_path, script, stall, rank, step, nproc=2, args=(), aborts=False, timeout=TIMEOUT):
    """Launch `script` on `nproc` ranks under torchdiagnose with rank `rank` stalled in step `step`: the tool's line
    (exactly one, repeated as the job's last line) once the job has ended, which it must within HANG_GUARD_S."""
    text = tmp_path / "text.txt"
    text.write_text(read_text()[0][:TEXT_CHARACTERS], encoding="utf-8")
    cmd = [BIN / "torchdiagnose", "--timeout", timeout, BIN / "torchrun", "--standalone", f"--nproc_per_node={nproc}",
           REPO / script, *SIZES, *args, "--data", text, "--snapshot_path", tmp_path / "checkpoints"]
    stall_at = f"{stall}:{rank}:{step}"
    env = clean_env(OMP_NUM_THREADS=1, DDP_EXAMPLES_PROBE_STALL=stall_at)
    # gloo aborts a rank whose peer's collective does not match: `aborts` only where the test means it.
    code, lines = watch(cmd, tmp_path, env, aborts=aborts, guard=HANG_GUARD_S)
    output = "\n".join(text for _, text in lines)
    assert code != 0, output[-3000:]
    assert any(f"rank {rank}: stall {stall}" in text for _, text in lines), output[-3000:]  # the probe ran
    found = [text for _, text in lines if text.startswith("diagnose: ")]
    assert len(found) == 1, output[-5000:]
    assert lines[-1][1] == found[0].replace("diagnose: ", "torchdiagnose: verdict: ", 1), output[-3000:]
    stalled = next(moment for moment, text in lines if f"rank {rank}: stall" in text)
    said = next(moment for moment, text in lines if text.startswith("diagnose: "))
    assert said - stalled < timeout + 15, f"the line came {said - stalled:.0f}s after the stall"
    return found[0]


def test_tensor_parallel_with_a_stopped_rank_names_dtensors_all_gather(tmp_path):
    # Rank 1 stops as its layers.0 begins step 2's forward, the embedding's reduce-scatter done: rank 0 waits in
    # the all-gather of its slice of the sequence [BATCH, SEQ / 2, DIM] before attention (PrepareModuleInput of
    # layers.0.self_attn), called from the script's step, in the model's file.
    line = diagnosed(tmp_path, "tensor_parallel.py", "stop", 1, 2)
    forward = re.escape(line_of("tensor_parallel.py", "self.parts[0](source)"))
    attention = re.escape(line_of("language_model.py", "self.self_attn(self.input_layernorm(x))"))
    head = (rf"diagnose: collective #\d+ \(all_gather of \[{BATCH}, {SEQ // 2}, {DIM}\], DTensor in "
            rf"PrepareModuleInput of layers\.0\.self_attn at {forward} via {attention} in forward\) waited more than "
            rf"--timeout {TIMEOUT}s: rank 1 is stopped by SIGSTOP \(pid \d+, on [^)]+\): it runs nothing until it gets "
            r"SIGCONT; no torchfrtrace: rank 1 did not answer, so wrote no flight recorder dump")
    assert re.match(head, line), line


def test_tensor_parallel_with_a_rank_stalled_in_backward_names_the_gradients_all_gather(tmp_path):
    # Rank 1 sleeps in the backward of step 2, as the gradient of layers.0's output comes: rank 0 goes on into
    # layers.0's backward and waits in its first collective, the all-gather of the MLP's output gradient (the
    # backward of down_proj's reduce-scatter).
    line = diagnosed(tmp_path, "tensor_parallel.py", "backward", 1, 2)
    backward = re.escape(line_of("tensor_parallel.py", ".backward()"))
    head = (rf"diagnose: collective #\d+ \(all_gather of \[{BATCH}, {SEQ // 2}, {DIM}\], DTensor's gradients in "
            rf"backward\(\) at {backward}\) waited more than --timeout {TIMEOUT}s: rank 1 did not arrive: it is alive, "
            rf"in its own code at {backward} \(innermost: sitecustomize\.py:\d+ in <lambda>\), idle: it waits for "
            rf"something of its own")
    assert re.match(head, line), line
    assert "flight recorder: `torchfrtrace fr_traces/" in line, line  # both ranks answered


def test_pipeline_with_a_stage_stalled_in_python_names_the_recv_that_never_came(tmp_path):
    # Rank 0 (stage 0) sleeps in layers.0's forward of step 2's first micro-batch: stage 1 has finished step 1 and
    # waits for that micro-batch's activations. Rank 0's innermost frame of the script is the Trainer's timing
    # wrapper around the stage's forward.
    line = diagnosed(tmp_path, "pipeline_parallel.py", "sleep", 0, 2)
    step = re.escape(line_of("pipeline_parallel.py", "self.schedule.step("))
    timed = re.escape(line_of("pipeline_parallel.py", "return work(*args, **kwargs)"))
    head = (rf"diagnose: p2p recv of \[{BATCH // MICROBATCHES}, {SEQ}, {DIM}\] from stage 0 \(rank 0\), the "
            rf"activations for stage 1's forward, at {step} waited more than --timeout {TIMEOUT}s: rank 0 did not send "
            rf"it: it is alive, in its own code at {timed} \(innermost: sitecustomize\.py:\d+ in forward_or_stall\), "
            rf"idle: it waits for something of its own")
    assert re.match(head, line), line
    assert "flight recorder: `torchfrtrace fr_traces/" in line, line  # both ranks answered


def test_nd_a_killed_rank_is_named_at_once_by_the_group_it_broke_and_torchfrtrace_reads_the_rest(tmp_path):
    # dp_shard 2 x tp 2: ranks [0, 1] and [2, 3] split each layer (tp), [0, 2] and [1, 3] shard it (FSDP2). Rank 3
    # SIGKILLs itself as layers.0 begins step 2's forward. Its tp partner's all-gather fails at once (the
    # pipeline stage raises its own error from it); ranks 0 and 1 fail on ranks that failed. The line names the
    # collective that rank 3 broke, its group, module and model line, and rank 3 as killed; the hint's torchfrtrace
    # command reads the three dumps there are.
    line = diagnosed(tmp_path, "nd_parallel.py", "kill", 3, 2, nproc=4, args=("--dp", "2", "--tp", "2"),
                     timeout=MESH_TIMEOUT)
    # Whichever of its partners asks first: rank 2's all-gather in their tp group, or rank 1's FSDP2 gather in
    # their dp_shard group; both broke on rank 3.
    step = re.escape(line_of("nd_parallel.py", "return work(*args, **kwargs)"))
    attention = re.escape(line_of("language_model.py", "self.self_attn(self.input_layernorm(x))"))
    layers = re.escape(line_of("language_model.py", "x = layer(x)"))
    head = (rf"diagnose: collective #\d+ \((all_gather of \[{BATCH // 2}, {SEQ // 2}, {DIM}\], DTensor in "
            rf"PrepareModuleInput of layers\.0\.self_attn at {step} via {attention} in forward\) in tp group \[2, 3\]|"
            rf"all_gather of \[\d+\], FSDP of layers\.1 at {step} via {layers} in forward\) in dp_shard group "
            r"\[1, 3\]) failed \(.*?\): rank 3 is gone: killed by SIGKILL \(pid \d+, on [^)]+\)")
    assert re.match(head, line), line
    assert "odd one out" not in line and "did not arrive" not in line, line
    command = re.search(r"`(torchfrtrace --allow-incomplete-ranks (fr_traces/[\d-]+))` reads them$", line)
    assert command, line
    report = subprocess.run([BIN / "torchfrtrace", "--allow-incomplete-ranks", command[2]], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr[-3000:]
    assert "missed FR dumps from ranks ({3})" in report.stdout + report.stderr, report.stdout[-3000:]


def test_nd_at_8_processes_a_stopped_rank_is_named_alone_across_pipeline_tensor_and_data_groups(tmp_path):
    # pp 2 x dp_shard 2 x tp 2: rank 5 (stage 1) stops as its first layer (layers.1) begins step 2's forward. Its
    # pipeline peer (rank 1) waits to send it activations, its tp partner (rank 4) in the all-gather of its slice of
    # the sequence before attention (PrepareModuleInput of layers.1.self_attn); the others wait for ranks that wait in
    # turn, or for rank 5 in their dp_shard group. Each is named in its own group, only rank 5 blamed. (An FSDP2
    # gather named by its module, on a user's 4-process FSDP2 x TP script: test_diagnose_installed.py.)
    # Ranks 2, 3, 6 and 7 run a pipeline of their own, which needs nothing of ranks 0, 1, 4 and 5 until the
    # step's end: each waits in its dp_shard group's first FSDP2 reduce-scatter of gradients (the root module's, as the
    # schedule reduces FSDP's units in the model's order), rank 7 for rank 5 itself.
    line = diagnosed(tmp_path, "nd_parallel.py", "stop", 5, 2, nproc=8, args=("--dp", "2", "--tp", "2", "--pp", "2"),
                     timeout=MESH_TIMEOUT)
    assert re.match(rf"diagnose: .*? in (pp group \[1, 5\]|tp group \[4, 5\]|dp_shard group \[5, 7\]) waited more "
                    rf"than --timeout {MESH_TIMEOUT}s: rank 5 is stopped by SIGSTOP \(pid \d+, on [^)]+\): it runs "
                    r"nothing until it gets SIGCONT; waiting: ", line), line
    waits = waiting(line)
    assert set(waits) == {f"rank {r}" for r in (0, 1, 2, 3, 4, 6, 7)}, line
    assert waits["rank 1"].endswith(" of pp group [1, 5]") and waits["rank 4"].endswith(" of tp group [4, 5]"), line
    # Rank 4's all-gather, named by DTensor's module at the timed stage forward via the model's line: in the head
    # (the collective above) or in rank 4's wait. Its shape: a dp rank's batch, one micro-batch of two, half the
    # sequence.
    step = re.escape(line_of("nd_parallel.py", "return work(*args, **kwargs)"))
    attention = re.escape(line_of("language_model.py", "self.self_attn(self.input_layernorm(x))"))
    assert re.search(rf"\(all_gather of \[{BATCH // 2 // MICROBATCHES}, {SEQ // 2}, {DIM}\], DTensor in "
                     rf"PrepareModuleInput of layers\.1\.self_attn at {step} via {attention} in forward\)", line), line
    assert re.search(r"rank 4 in (the collective above|#\d+ \(all_gather .*?\)) of tp group \[4, 5\], for rank 5;",
                     line), line
    assert re.search(r"rank 0 in .*? of \w+ group \[0, \d\], for rank \d, which waits in turn;", line), line
    # Rank 1's send of the next micro-batch's activations (gloo's send waits for the matching recv): the p2p op and
    # the stage it waits on, at the schedule's step, in the head or in rank 1's wait.
    schedule = re.escape(line_of("nd_parallel.py", "self.schedule.step("))
    shape = rf"\[{BATCH // 2 // MICROBATCHES}, {SEQ // 2}, {DIM}\]"
    assert re.search(rf"p2p send of {shape} to stage 1 \(rank 5\), stage 0's activations, at {schedule}", line), line
    # FSDP2's reduce-scatter, which gloo runs and records as an all-reduce, named as what FSDP2 called.
    assert re.search(rf"rank 7 in #\d+ \(reduce_scatter of \[\d+\], FSDP's gradients of the root module \(Decoder\) "
                     rf"at {schedule}\) of dp_shard group \[5, 7\], for rank 5;", line), line
    assert "different collectives" not in line and "did not arrive" not in line and "odd one out" not in line, line


def test_nd_a_rank_that_skips_a_layer_is_named_by_the_group_whose_collective_it_broke(tmp_path):
    # The 4-process mesh; rank 3 leaves layers.0 out of step 2, and with it that layer's tp collectives: its next
    # one meets its partner's all-reduce with another shape, and gloo aborts it. The line names that collective in
    # their tp group, and rank 3 as the one aborted for it.
    line = diagnosed(tmp_path, "nd_parallel.py", "skip", 3, 2, nproc=4, args=("--dp", "2", "--tp", "2"),
                     aborts=True, timeout=MESH_TIMEOUT)
    # (Or rank 1's FSDP2 gather in their dp_shard group, where rank 1 asks first: rank 3's abort breaks both.)
    assert re.match(r"diagnose: collective #\d+ \(.*?\) in (tp group \[2, 3\]|dp_shard group \[1, 3\]) failed \(.*?\): "
                    r"rank 3 is gone: killed by SIGABRT \(pid \d+, on [^)]+\); gloo aborts a process whose peer's "
                    r"collective does not match its own", line), line
