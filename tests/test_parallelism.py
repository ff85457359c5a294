"""tensor_parallel.py, pipeline_parallel.py and nd_parallel.py under torchrun on gloo, 2, 4 and 8 processes: what each
rank holds and which collectives the blocks run; the same numbers as one process; checkpoints that resume in any
layout, from any of the three scripts; a checkpoint killed mid-save never loaded; bad input in one line.

The one-process reference is computed here, in this process, with plain torch (no torch.distributed): BlockMLP, SGD
with momentum, the mean squared error of each step's samples, in float64, over the same global batches (the
epoch's order is torch.randperm seeded with seed + epoch, as fsdp_checkpoint.GlobalOrderSampler cuts it).
Checkpoints are read back with DCP's own converter, not with the scripts.

Tolerance: the parallel runs add the same numbers in another order: TP's all-reduce sums fc2's partial products
rank by rank, not inside one matmul; FSDP sums the data-parallel ranks' gradients and divides by dp; a pipeline adds
the micro-batches' gradients one by one. Each step's rounding therefore differs in the last bits of float64 (about
1e-16 relative); over these runs' 24 steps the weights and momentum stay within WEIGHT_TOL = 1e-10 of one process's
(measured: 1e-16 to 3e-16), while a wrong batch, a lost shard or a gradient scaled by dp is off by more than 1e-4. The
printed epoch losses have 6 decimals: LOSS_TOL = 1e-6.
"""
import json
import re
import subprocess

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.checkpoint import FileSystemReader, save
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from conftest import (BIN, REPO, assert_one_line_error, clean_env, epoch_lines, finish, run, start, summary,
                      torchrun_cmd)
import fsdp_checkpoint as checkpoint_dir
from models_and_data import BlockMLP, regression_dataset

GLOBAL_BATCH = 512  # 4 steps an epoch: the scripts' step costs most on a CPU, not the samples
F64 = ("--dtype", "float64", "--global_batch_size", str(GLOBAL_BATCH), "--save_every", "1",
       "--snapshot_path", "checkpoints")
WEIGHT_TOL = 1e-10
LOSS_TOL = 1e-6
ENV = {"OMP_NUM_THREADS": "1"}


def reference_run(epochs, seed=0):
    """One process, no torch.distributed: [(epoch loss, weights, momentum buffers) after each epoch]."""
    torch.manual_seed(seed)
    x, y = (t.double() for t in regression_dataset(2048, seed=seed).tensors)
    model = BlockMLP(input_size=20).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    names = {p: name for name, p in model.named_parameters()}
    after = []
    for epoch in range(epochs):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed + epoch))
        squared = 0.0
        for start_ in range(0, len(x), GLOBAL_BATCH):
            batch = order[start_:start_ + GLOBAL_BATCH]
            optimizer.zero_grad()
            loss = F.mse_loss(model(x[batch]), y[batch], reduction="sum")
            (loss / len(batch)).backward()
            optimizer.step()
            squared += loss.item()
        momentum = {names[p]: state["momentum_buffer"].clone() for p, state in optimizer.state.items()}
        after.append((squared / len(x), {k: v.clone() for k, v in model.state_dict().items()}, momentum))
    return after


@pytest.fixture(scope="module")
def reference():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the launches run (OMP_NUM_THREADS=1); OpenMP's spinning threads cost more here
    try:
        return reference_run(6)
    finally:
        torch.set_num_threads(threads)


def newest(checkpoints):
    """The newest complete checkpoint (with fsdp_checkpoint's marker) in a directory."""
    return max(p for p in checkpoints.iterdir() if (p / checkpoint_dir.MARKER).exists())


def full_state(checkpoint, tmp_path):
    out = tmp_path / f"{checkpoint.name}-{len(list(tmp_path.iterdir()))}.pt"
    dcp_to_torch_save(checkpoint, out)
    return torch.load(out, weights_only=True)


def assert_matches_reference(state, reference, epochs, what):
    """A checkpoint's weights and momentum against one process's after `epochs` epochs."""
    _, weights, momentum = reference[epochs - 1]
    assert state["model"].keys() == weights.keys(), (what, sorted(state["model"]))
    for name, weight in weights.items():
        assert state["model"][name].dtype == torch.float64, (what, name)
        difference = (state["model"][name] - weight).abs().max().item()
        assert difference <= WEIGHT_TOL, f"{what}: {name} differs from one process's by {difference}"
        difference = (state["optimizer"][f"state.{name}.momentum_buffer"] - momentum[name]).abs().max().item()
        assert difference <= WEIGHT_TOL, f"{what}: {name}'s momentum differs from one process's by {difference}"
    initial = BlockMLP(input_size=20).state_dict()
    assert any((initial[n].double() - w).abs().max() > 1e-3 for n, w in weights.items()), "it must have trained"


def assert_losses_match(out, reference, epochs, what):
    lines = epoch_lines(out)
    assert [line.epoch for line in lines] == list(epochs), (what, out[-3000:])
    for line in lines:
        assert abs(line.loss - reference[line.epoch][0]) <= LOSS_TOL, (what, line, reference[line.epoch][0])


def launch(script, *args, nproc, cwd, check=True):
    result = run(torchrun_cmd(script, *args, nproc=nproc), cwd=cwd, env=clean_env(**ENV), timeout=240, check=check)
    return result.stdout + result.stderr if check else result


KILLER = """\
import os, runpy, signal, sys
sys.path.insert(0, {repo!r})
import torch.distributed.checkpoint.filesystem as filesystem
write_item = filesystem._write_item

def dying_write(transforms, stream, *args):
    # Rank 1, while it writes its part of the epoch-3 checkpoint: half a file, then a real SIGKILL.
    if os.environ["RANK"] == "1" and "epoch_000003.tmp" in stream.name:
        stream.write(b"half a shard")
        stream.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return write_item(transforms, stream, *args)

filesystem._write_item = dying_write
sys.argv[0] = {script!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """One run, its layout changed at every launch, all in float64 on one --snapshot_path: tp 2 (epoch 0); pp 2 1F1B
    (epochs 1 and 2), SIGKILLed while saving after epoch 2; pp 2 GPipe, which resumes from epoch 2's checkpoint and
    trains epoch 2 again; HSDP, 2 replicas of 2 shards (epoch 3). The outputs, what the checkpoint directory held
    after each launch, and the newest checkpoint's full state after each."""
    directory = tmp_path_factory.mktemp("layouts")
    states = tmp_path_factory.mktemp("states")
    checkpoints = directory / "checkpoints"
    seen = {"dir": directory}

    def after(name):
        seen[name]["listing"] = sorted(p.name for p in checkpoints.iterdir())
        seen[name]["newest"] = newest(checkpoints)
        seen[name]["state"] = full_state(seen[name]["newest"], states)

    seen["tp"] = {"out": launch("tensor_parallel.py", "--total_epochs", "1", *F64, nproc=2, cwd=directory)}
    after("tp")
    (directory / "killer.py").write_text(KILLER.format(repo=str(REPO), script=str(REPO / "pipeline_parallel.py")))
    job = start([BIN / "torchrun", "--standalone", "--nproc_per_node=2", directory / "killer.py", "--total_epochs", "3",
                 *F64], cwd=directory, env=clean_env(**ENV))
    seen["killed"] = {"out": finish(job, 240), "returncode": job.returncode}
    after("killed")
    seen["pp"] = {"out": launch("pipeline_parallel.py", "--total_epochs", "3", "--schedule", "gpipe", *F64, nproc=2,
                                cwd=directory)}
    after("pp")
    seen["hsdp"] = {"out": launch("nd_parallel.py", "--total_epochs", "4", "--dp", "4", "--dp_replicate", "2", *F64,
                                  nproc=4, cwd=directory)}
    after("hsdp")
    return seen


def test_tensor_parallel_prints_each_ranks_pieces_and_the_collectives_it_counted(layouts):
    out = layouts["tp"]["out"]
    assert "Mesh tp 2 | global batch 512, all of it on every rank" in out, out[-3000:]
    for rank in (0, 1):  # fc1 split by its output rows (ColwiseParallel), fc2 by its input columns (RowwiseParallel)
        assert (f"Rank {rank} holds fc1.weight [128, 64] of [256, 64] | fc1.bias [128] of [256] | fc2.weight [64, 128] "
                f"of [64, 256] | fc2.bias [64] of [64] in each block; the rest whole: 68,353 of 134,401 parameters"
                ) in out, out[-3000:]
    # Counted by CommDebugMode in the first step: fc2's partial sums all-reduced forward, fc1's input gradient
    # backward; nothing outside the blocks (the rest is whole on every rank).
    blocks = re.findall(r"^Block (\d) \| forward (.*) \| backward (.*)$", out, re.M)
    assert blocks == [(str(i), "fc2 all_reduce x1", "fc1 all_reduce x1") for i in range(4)], out[-3000:]
    assert "Outside the blocks | forward none | backward none" in out
    assert (summary(out).world_size, summary(out).backend) == (2, "gloo")


def test_pipeline_stages_keep_the_full_names_and_report_their_idle_time(layouts):
    out = layouts["pp"]["out"]
    assert "Mesh pp 2 | schedule GPipe | 4 micro-batches of 128 | global batch 512" in out, out[-3000:]
    assert "Stage 0 (rank 0) holds inp, blocks.0, blocks.1: 67,776 of 134,401 parameters" in out
    assert "Stage 1 (rank 1) holds blocks.2, blocks.3, norm, out: 66,625 of 134,401 parameters" in out
    idle = re.findall(r"^Stage (\d) \| idle ([\d.]+)% of a step, measured \| bubble \(p-1\)/\(m\+p-1\) = ([\d.]+)%, "
                      r"textbook$", out, re.M)
    assert [stage for stage, _, _ in idle] == ["0", "1"], out[-3000:]
    for _, measured, textbook in idle:
        assert textbook == "20.0" and 0 <= float(measured) < 100  # (2-1)/(4+2-1)
    # Each stage wrote its own parameters, under the full model's names, into its own file.
    metadata = FileSystemReader(layouts["pp"]["newest"]).read_metadata()
    files = {}
    for index, info in metadata.storage_data.items():
        if index.fqn.startswith("model."):
            files.setdefault(info.relative_path, set()).add(index.fqn.split(".")[1])
    assert files == {"__0_0.distcp": {"inp", "blocks"}, "__1_0.distcp": {"blocks", "norm", "out"}}, files


def test_every_layout_trains_the_numbers_of_one_process(layouts, reference):
    assert_losses_match(layouts["tp"]["out"], reference, [0], "tp 2")
    assert_losses_match(layouts["killed"]["out"], reference, [1, 2], "pp 2, 1F1B")
    assert_losses_match(layouts["pp"]["out"], reference, [2], "pp 2, GPipe, resumed")
    assert_losses_match(layouts["hsdp"]["out"], reference, [3], "HSDP 2 x 2, resumed")
    assert "Mesh pp 1 x dp_replicate 2 x dp_shard 2 x tp 1 |" in layouts["hsdp"]["out"]
    for name, epochs in (("tp", 1), ("killed", 2), ("pp", 3), ("hsdp", 4)):
        assert_matches_reference(layouts[name]["state"], reference, epochs, name)


def test_a_checkpoint_killed_mid_save_is_never_loaded(layouts):
    killed = layouts["killed"]
    assert killed["returncode"] != 0 and "SIGKILL" in killed["out"], killed["out"][-3000:]
    assert killed["listing"] == ["epoch_000001", "epoch_000002", "epoch_000003.tmp"], killed["listing"]
    out = layouts["pp"]["out"]
    assert "Resuming from checkpoints/epoch_000002 at epoch 2, saved as pp 2 on 2 processes" in out, out[-3000:]
    assert layouts["pp"]["listing"] == ["epoch_000002", "epoch_000003"], "the .tmp removed, the two newest kept"
    assert "Resuming from checkpoints/epoch_000003 at epoch 3, saved as pp 2 on 2 processes" in layouts["hsdp"]["out"]


# ---- the layout chain: 3-D on 8 processes, then 2-D, TP alone, FSDP alone, one process, and back to 3-D ----

CHAIN = [(2, 2, 2), (2, 2, 1), (1, 4, 1), (4, 1, 1), (1, 1, 1), (2, 2, 2)]  # dp x tp x pp


def layout(dp, tp, pp):
    return f"pp {pp} x dp_replicate 1 x dp_shard {dp} x tp {tp}"


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """nd_parallel.py, an epoch in each layout of CHAIN, each resumed from the one before: (output, the newest
    checkpoint's full state) of each."""
    directory, states = tmp_path_factory.mktemp("chain"), tmp_path_factory.mktemp("chain-states")
    found = []
    for epoch, (dp, tp, pp) in enumerate(CHAIN):
        out = launch("nd_parallel.py", "--total_epochs", epoch + 1, "--dp", dp, "--tp", tp, "--pp", pp, *F64,
                     nproc=dp * tp * pp, cwd=directory)
        found.append((out, full_state(newest(directory / "checkpoints"), states)))
    return found


@pytest.mark.slow
def test_3d_parallel_on_8_processes_places_every_rank_on_the_mesh_and_trains_as_one_process(chain, reference):
    out, state = chain[0]
    assert ("Mesh pp 2 x dp_replicate 1 x dp_shard 2 x tp 2 | 256 samples a data-parallel rank in 2 micro-batches | "
            "global batch 512 | schedule 1F1B") in out, out[-3000:]
    ranks = re.findall(r"^Rank (\d) \| pp (\d) dp_replicate 0 dp_shard (\d) tp (\d) \| ([^|]+) \| ([\d,]+) of 134,401 "
                       r"parameters \| blocks\.(\d)\.fc1\.weight \[64, 64\] of \[256, 64\]$", out, re.M)
    assert len(ranks) == 8, out[-3000:]
    stage_parts = ["inp, blocks.0, blocks.1", "blocks.2, blocks.3, norm, out"]
    for rank, pp, dp, tp, parts, held, block in ranks:
        # tp innermost, then dp_shard, then pp: rank = (pp * 2 + dp) * 2 + tp
        assert int(rank) == (int(pp) * 2 + int(dp)) * 2 + int(tp), ranks
        assert parts == stage_parts[int(pp)] and block == str(2 * int(pp)), ranks
        assert 134401 / 8 * 0.9 < int(held.replace(",", "")) < 134401 / 8 * 1.1, "an eighth of the model each"
    assert (summary(out).world_size, summary(out).backend) == (8, "gloo")
    assert_losses_match(out, reference, [0], "2x2x2")
    assert_matches_reference(state, reference, 1, "2x2x2")


@pytest.mark.slow
def test_a_run_resumed_in_every_layout_and_back_trains_as_one_uninterrupted_process(chain, reference):
    """2x2x2 -> 2x2x1 -> 1x4x1 -> 4x1x1 -> one process -> 2x2x2 (dp x tp x pp), an epoch each: every epoch's loss
    and every checkpoint's weights and momentum are one process's, within the tolerance."""
    for epoch, (out, state) in enumerate(chain):
        what = "x".join(map(str, CHAIN[epoch]))
        if epoch:
            before = CHAIN[epoch - 1]
            assert (f"Resuming from checkpoints/epoch_{epoch:06d} at epoch {epoch}, saved as {layout(*before)} on "
                    f"{before[0] * before[1] * before[2]} process") in out, (what, out[-3000:])
        assert f"Mesh {layout(*CHAIN[epoch])} |" in out, (what, out[-3000:])
        assert_losses_match(out, reference, [epoch], what)
        assert_matches_reference(state, reference, epoch + 1, what)


# ---- bad input: one line, before any work ----

def test_bad_sizes_are_one_line_before_any_work(tmp_path):
    cases = [  # script, arguments, processes, what the line says
        ("nd_parallel.py", ("--dp", "2", "--tp", "2"), 2, "--dp 2 x --tp 2 x --pp 1 must be the 2 processes"),
        ("nd_parallel.py", ("--tp", "2", "--hidden", "255"), 2, "--tp 2 does not divide --hidden 255"),
        ("tensor_parallel.py", ("--hidden", "255"), 2, "2 processes (tp 2) do not divide --hidden 255"),
        ("pipeline_parallel.py", ("--depth", "1"), 2, "2 processes make 2 stages, more than the 1 blocks"),
        ("nd_parallel.py", ("--microbatches", "3"), 1, "--dp 1 x --microbatches 3 must divide --global_batch_size 256"),
    ]
    jobs = [start(torchrun_cmd(script, *args, nproc=nproc), cwd=tmp_path, env=clean_env(**ENV), merge_output=False)
            for script, args, nproc, _ in cases]
    for job, (script, args, _, fragment) in zip(jobs, cases):
        out, err = finish(job, 180)
        result = subprocess.CompletedProcess(job.args, job.returncode, out, err)
        assert_one_line_error(result, f"{script}: error: {fragment}", code=1)  # torchrun exits 1
        assert not epoch_lines(out), (script, args)
    assert list(tmp_path.iterdir()) == [], "stopped before making the checkpoints' directory"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # no_dist=True: this process saves alone
def test_a_checkpoint_of_another_model_is_refused_in_one_line(tmp_path):
    """A checkpoint as the scripts write it (the full model's names, optimizer state flattened), of the same model
    narrower, with a complete marker."""
    other = BlockMLP(input_size=20, width=32)
    optimizer = torch.optim.SGD(other.parameters(), lr=0.01, momentum=0.9)
    other(torch.randn(2, 20)).sum().backward()
    optimizer.step()
    model_state, optimizer_state = get_state_dict(other, optimizer,
                                                  options=StateDictOptions(flatten_optimizer_state_dict=True))
    checkpoint = tmp_path / "nd_parallel_checkpoints" / "epoch_000001"
    save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=checkpoint, no_dist=True)
    (checkpoint / checkpoint_dir.MARKER).write_text(json.dumps({"epochs_run": 1, "position": 0, "steps": 8,
                                                                  "world_size": 1}))
    before = {p.name: p.read_bytes() for p in checkpoint.iterdir()}
    result = launch("nd_parallel.py", "--total_epochs", "2", nproc=1, cwd=tmp_path, check=False)
    assert_one_line_error(result, "checkpoint nd_parallel_checkpoints/epoch_000001 does not fit this model",
                          "model.inp.weight is [32, 20], here [64, 20]", code=1)
    assert {p.name: p.read_bytes() for p in checkpoint.iterdir()} == before
