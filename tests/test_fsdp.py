"""fsdp.py, the FSDP2 step, under torchrun: sharded training (each block its own unit, the collectives counted),
the memory it reports, parity with DDP, and its distributed checkpoints (complete only when marked, resharding
from 2 ranks to 1 and 3, a SIGKILL in the middle of an async save, then a bitwise resume on two nodes, every
file's sum in the marker; checkpoints with bytes flipped, a truncated marker or a shard missing, of another model,
optimizer layout or global batch, each one line from rank 0; --skip_damaged's resume from the checkpoint before; a
--snapshot_path that is a file, or that the nodes do not share).

Checkpoints are read back in the test process with DCP's own converter (dcp_to_torch_save), not with fsdp.py.
Launches are few (each costs seconds on a CPU): one 2-rank run serves most tests.
"""
import json
import os
import re
import shutil
import signal
import subprocess
from collections import Counter

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader, save
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from conftest import (BIN, PROGRAMS, REPO, assert_bitwise_equal, assert_one_line_error, assert_said_by_rank_0,
                      checkpoint_sums, clean_env, collectives_issued, epoch_batches, epoch_lines, finish, flip,
                      forked, free_port, run, start, stopped_worker, summary, torchrun_cmd,
                      torchrun_worker)
import fsdp_checkpoint as checkpoint_dir
from language_model import read_text
from models_and_data import BlockMLP


FLAGS = ("--save_every", "2", "--batch_size", "256")  # 4 steps an epoch at 2 ranks: FSDP on a CPU is slow per step
EPOCHS = 4
STEPS = 2048 // (256 * 2)  # per epoch and rank
DEPTH = len(BlockMLP(input_size=20).blocks)
MEMORY_LINE = re.compile(r"^Rank (\d+) holds params ([\d,]+) B \| grads ([\d,]+) B \| optimizer state ([\d,]+) B; "
                         r"DDP would hold ([\d,]+) \| ([\d,]+) \| ([\d,]+) B$", re.MULTILINE)


def fsdp(*args, nproc=2):
    return torchrun_cmd("fsdp.py", *args, nproc=nproc)


def full_state(checkpoint, tmp_path):
    """A DCP checkpoint directory as one dict of full tensors, read by DCP's converter in this process."""
    out = tmp_path / f"{checkpoint.name}-{len(list(tmp_path.iterdir()))}.pt"
    dcp_to_torch_save(checkpoint, out)
    return torch.load(out, weights_only=True)


def full_bytes():
    return sum(p.numel() * p.element_size() for p in BlockMLP(input_size=20).parameters())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """A 2-rank run of EPOCHS epochs, checkpoints every 2, its collectives counted: its directory and output."""
    directory = tmp_path_factory.mktemp("uninterrupted")
    result = run(fsdp("--total_epochs", EPOCHS, *FLAGS), cwd=directory, timeout=180,
                 env=clean_env(DDP_EXAMPLES_PROBE_COLLECTIVES=1))
    return directory, result.stdout + result.stderr


def test_fsdp_learns_shards_block_by_block_reports_its_shards_and_saves_complete_checkpoints(uninterrupted):
    directory, out = uninterrupted
    lines = epoch_lines(out)
    assert [line.epoch for line in lines] == list(range(EPOCHS)), "rank 0 alone logs, once an epoch"
    assert {line.steps for line in lines} == {STEPS}, "each rank trains on its half of the data"
    assert lines[-1].loss < 0.5 * lines[0].loss, [line.loss for line in lines]
    assert (summary(out).world_size, summary(out).backend) == (2, "gloo")

    # The collectives of the default group, counted in each rank by the probe (DCP's run in a group of their
    # own). Each block is an FSDP unit of its own: all-gathered for its forward, again for its backward, and its
    # gradients reduce-scattered; the root's layers are all-gathered once (the backward starts with them, so
    # they stay gathered) and reduce-scattered. Hence 3 * DEPTH + 2 a step; and the epoch loss's all-reduce
    # each epoch, and the memory report's all_gather_object (2 collectives). Sharded as one unit, the model
    # would issue 2 a step.
    per_rank = STEPS * EPOCHS * (3 * DEPTH + 2) + EPOCHS + 2
    assert collectives_issued(out) == {0: per_rank, 1: per_rank}, out[-3000:]

    checkpoints = directory / "fsdp_checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["epoch_000002", "epoch_000004"]
    newest = checkpoints / "epoch_000004"
    marker = json.loads((newest / checkpoint_dir.MARKER).read_text())
    assert marker.pop("files") == checkpoint_sums(newest), "every file of it, its size and CRC-32 (zlib's, here)"
    assert marker == {"epochs_run": 4, "position": 0, "steps": STEPS * 4, "dataset_size": 2048, "seed": 0,
                      "global_batch": 512, "architecture": "BlockMLP", "world_size": 2, "saved_by": "fsdp.py"}
    assert sorted(p.name for p in newest.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                                        checkpoint_dir.MARKER]

    # Each rank wrote its own shard of every parameter: from the checkpoint's metadata, the bytes of the model
    # that each rank's file holds.
    metadata = FileSystemReader(newest).read_metadata()
    written = {0: 0, 1: 0}
    for index, info in metadata.storage_data.items():
        if index.fqn.startswith("model."):
            item = metadata.state_dict_metadata[index.fqn]
            chunk = next(c for c in item.chunks if list(c.offsets) == list(index.offset))
            written[int(info.relative_path[2])] += chunk.sizes.numel() * item.properties.dtype.itemsize
    full = full_bytes()
    assert written[0] + written[1] == full and abs(written[0] - written[1]) < 0.05 * full, written

    # What the ranks report holding: their shard (FSDP pads each parameter to a multiple of the world size, so
    # at most one row of each more), against DDP's full copy computed here from the model itself.
    reports = {int(m[1]): [int(x.replace(",", "")) for x in m.groups()[1:]] for m in MEMORY_LINE.finditer(out)}
    assert sorted(reports) == [0, 1], out
    one_row_each = sum(p[0].numel() * p.element_size() for p in BlockMLP(input_size=20).parameters())
    for rank, (params, grads, optimizer, *ddp) in reports.items():
        assert ddp == [full, full, full]
        for held in (params, grads, optimizer):
            assert written[rank] <= held <= written[rank] + one_row_each, (rank, held, written, one_row_each)


def test_fsdp_and_ddp_reach_the_same_weights_in_fp32(uninterrupted, tmp_path):
    directory, _ = uninterrupted
    run(torchrun_cmd("tests/support/fsdp_ddp_reference.py", tmp_path / "ddp.pt", EPOCHS, 256), cwd=tmp_path)
    ddp = torch.load(tmp_path / "ddp.pt", weights_only=True)
    fsdp_state = full_state(directory / "fsdp_checkpoints" / "epoch_000004", tmp_path)
    torch.manual_seed(0)
    initial = BlockMLP(input_size=20).state_dict()
    assert ddp["model"].keys() == fsdp_state["model"].keys()
    for name, weight in ddp["model"].items():
        assert torch.allclose(fsdp_state["model"][name], weight, rtol=1e-4, atol=1e-6), name
        assert torch.allclose(fsdp_state["optimizer"]["state"][name]["momentum_buffer"], ddp["momentum"][name],
                              rtol=1e-3, atol=1e-6), name
    assert any(not torch.allclose(initial[n], ddp["model"][n]) for n in initial), "the weights must have trained"


@pytest.mark.parametrize("nproc", [1, 3])
def test_a_two_rank_checkpoint_loads_at_another_world_size_with_the_full_state(uninterrupted, tmp_path, nproc):
    directory, _ = uninterrupted
    shutil.copytree(directory / "fsdp_checkpoints", tmp_path / "fsdp_checkpoints")
    saved = full_state(tmp_path / "fsdp_checkpoints" / "epoch_000004", tmp_path)
    out = run(fsdp("--total_epochs", EPOCHS, *FLAGS, "--global_batch_size", "512", "--export_path", "full.pt",
                   nproc=nproc), cwd=tmp_path).stdout
    assert f"Resuming from fsdp_checkpoints/epoch_000004 at epoch {EPOCHS}" in out and "Nothing to do" in out
    assert_bitwise_equal(saved, torch.load(tmp_path / "full.pt", weights_only=True), f"loaded at {nproc} ranks")


def start_two_nodes(*args, cwds, merge_output=True):
    """fsdp.py on two torchrun agents of one rank each, as on two machines, node i started in cwds[i].
    torchrun sets OMP_NUM_THREADS=1 only for several processes a node; set here as the standalone runs have it,
    since the number of threads changes the order in which a matmul sums, and so its last bits."""
    port = free_port()
    return [start([BIN / "torchrun", "--nnodes=2", f"--node_rank={node}", "--nproc_per_node=1", "--rdzv_id=fsdp",
                   "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", REPO / "fsdp.py", *args,
                   "--timeout", "60"], cwd, env=clean_env(OMP_NUM_THREADS=1), merge_output=merge_output)
            for node, cwd in enumerate(cwds)]


def two_nodes(*args, cwd):
    """fsdp.py on two nodes sharing `cwd`, run to a clean end: their outputs."""
    agents = start_two_nodes(*args, cwds=[cwd, cwd])
    outputs = [finish(agent, 180) for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], outputs
    return outputs


@pytest.mark.slow
def test_a_sigkill_during_an_async_save_leaves_the_previous_checkpoint_and_two_nodes_resume_bitwise(uninterrupted,
                                                                                                  tmp_path):
    directory, _ = uninterrupted
    # Rank 1, while it writes its shards of the epoch-4 checkpoint: half a file, then a real SIGKILL (the probe).
    job = start(torchrun_cmd("fsdp.py", "--total_epochs", "6", *FLAGS, "--async_save"), cwd=tmp_path,
                env=clean_env(DDP_EXAMPLES_PROBE_KILL_IN_SAVE="1:epoch_000004.tmp"))
    out = finish(job, 180)
    assert job.returncode != 0 and "SIGKILL" in out, out[-3000:]
    checkpoints = tmp_path / "fsdp_checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["epoch_000002", "epoch_000004.tmp"], out[-3000:]
    half = (checkpoints / "epoch_000004.tmp" / "__1_0.distcp").read_bytes()
    assert half.startswith(b"half a shard, written by AsyncCheckpointExecutor"), "killed in DCP's save thread"
    assert not (checkpoints / "epoch_000004.tmp" / ".metadata").exists()
    assert_bitwise_equal(full_state(directory / "fsdp_checkpoints" / "epoch_000002", tmp_path),
                         full_state(checkpoints / "epoch_000002", tmp_path), "the previous checkpoint")

    # Started again as two nodes (one rank each) on the directory they share: the same world size, so the run
    # goes on from epoch 2 exactly, and ends bitwise where the uninterrupted run ended.
    node0, node1 = two_nodes("--total_epochs", EPOCHS, *FLAGS, "--async_save", cwd=tmp_path)
    assert "Resuming from fsdp_checkpoints/epoch_000002 at epoch 2" in node0
    assert [line.epoch for line in epoch_lines(node0)] == [2, 3] and not epoch_lines(node1), "rank 0 logs"
    assert summary(node0).world_size == 2
    assert sorted(p.name for p in checkpoints.iterdir()) == ["epoch_000002", "epoch_000004"], "the .tmp is gone"
    assert sorted(p.name for p in (checkpoints / "epoch_000004").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", checkpoint_dir.MARKER]
    assert_bitwise_equal(full_state(directory / "fsdp_checkpoints" / "epoch_000004", tmp_path),
                         full_state(checkpoints / "epoch_000004", tmp_path), "resumed from the killed run")


def test_amp_computes_in_bf16_and_keeps_fp32_weights(uninterrupted, tmp_path):
    """One rank with twice the batch: the same global batches as the fp32 run of two, so only rounding differs."""
    _, fp32_out = uninterrupted
    out = run(fsdp("--total_epochs", "2", "--save_every", "2", "--batch_size", "512", "--amp", nproc=1),
              cwd=tmp_path).stdout
    losses, fp32_losses = [line.loss for line in epoch_lines(out)], [line.loss for line in epoch_lines(fp32_out)]
    assert losses[1] < losses[0], losses
    for loss, fp32_loss in zip(losses, fp32_losses):
        assert 1e-4 < abs(loss - fp32_loss) < 0.05 * fp32_loss, ("bf16 rounding, no more", losses, fp32_losses)
    state = full_state(tmp_path / "fsdp_checkpoints" / "epoch_000002", tmp_path)
    assert {t.dtype for t in state["model"].values()} == {torch.float32}, "weights are kept in fp32"


# ---- bad input: one line, no traceback, the checkpoint left as it was ----

def write_checkpoint(checkpoint, width=64, flatten=False, sums=True):
    """A checkpoint as fsdp.py writes it (state keyed by parameter name) of a BlockMLP of `width`, after a step, its
    optimizer's state flattened by parameter or not, with a marker (every file's sum, or none, as an older
    fsdp_checkpoint.py wrote it). Saved by this process alone (no_dist)."""
    model = BlockMLP(input_size=20, width=width)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=True)
    model(torch.randn(2, 20)).sum().backward()
    optimizer.step()
    model_state, optimizer_state = get_state_dict(model, optimizer,
                                                  options=StateDictOptions(flatten_optimizer_state_dict=flatten))
    save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=checkpoint, no_dist=True)
    marker = {"epochs_run": 2, "position": 0, "steps": 8, **({"files": checkpoint_sums(checkpoint)} if sums else {})}
    (checkpoint / checkpoint_dir.MARKER).write_text(json.dumps(marker))


LM = ("--dim", "32", "--n_layers", "2", "--n_heads", "4", "--n_kv_heads", "2", "--hidden", "64", "--seq_len", "16",
      "--data", "text.txt", "--sample", "0")  # a small decoder for tensor_parallel.py


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # no_dist=True: this process saves alone
def test_a_damaged_checkpoint_or_one_of_another_run_is_one_line_from_rank_0_before_any_step(uninterrupted, tmp_path):
    """Each case in a folder of its own, all launched side by side. In a copy of the uninterrupted run's
    checkpoints: 400 bytes flipped in rank 1's shard, the marker cut short, a shard missing, another global batch
    (2 x 128, the checkpoint's 2 x 256), tensor_parallel.py on fsdp.py's checkpoints, and --skip_damaged where no
    checkpoint checks out. Written here: the model narrower (a marker without sums, as an older fsdp_checkpoint.py
    wrote it), and the optimizer's state flattened as steps 6 to 8 save theirs (the same tensors, the settings under
    other keys, which DCP would call a damaged checkpoint's missing key). And a --snapshot_path that is a file. Each
    stops with its line, and leaves the checkpoints as they were (--skip_damaged: the damaged one renamed).
    The cases whose files every rank sums a share of (flipped, missing, none_whole) run at 2 ranks under torchrun,
    and prove that rank 1 stays silent while rank 0 says the line. The cases rank 0 decides alone, from a marker it
    reads or from the model every rank builds alike, run at 1 rank (the environment torchrun gives it, the same
    stop()); the file case stops in rank 0 before its process group (rank 0 of 2, alone)."""
    directory, _ = uninterrupted
    newest = "fsdp_checkpoints/epoch_000004"

    def checkpoints(case):
        shutil.copytree(directory / "fsdp_checkpoints", tmp_path / case / "fsdp_checkpoints")
        return tmp_path / case / "fsdp_checkpoints"

    flip(checkpoints("flipped") / "epoch_000004" / "__1_0.distcp")
    marker = checkpoints("truncated") / "epoch_000004" / checkpoint_dir.MARKER
    marker.write_bytes(marker.read_bytes()[:40])
    (checkpoints("missing") / "epoch_000004" / "__0_0.distcp").unlink()
    checkpoints("batch")
    (tmp_path / "file").mkdir()
    (tmp_path / "file" / "fsdp_checkpoints").write_text("a file")
    checkpoints("decoder")
    (tmp_path / "decoder" / "text.txt").write_text(read_text()[0][:1200])
    write_checkpoint(tmp_path / "narrow" / "fsdp_checkpoints" / "epoch_000002", width=32, sums=False)
    write_checkpoint(tmp_path / "flattened" / "fsdp_checkpoints" / "epoch_000002", flatten=True)
    shutil.rmtree(checkpoints("none_whole") / "epoch_000002")
    flip(tmp_path / "none_whole" / newest / ".metadata", count=1)
    cases = [  # folder, script, flags, ranks (0: rank 0 of 2 alone), what the line says
        ("flipped", "fsdp.py", FLAGS, 2, [f"checkpoint {newest} is damaged: __1_0.distcp does not match its sum "
                                          "(CRC-32", "pass --skip_damaged to set it aside and resume from the newest "
                                          "checkpoint"]),
        ("truncated", "fsdp.py", FLAGS, 1, [f"checkpoint {newest} is damaged: its complete.json cannot be read "
                                            "(JSONDecodeError: "]),
        ("missing", "fsdp.py", FLAGS, 2, [f"checkpoint {newest} is damaged: __0_0.distcp is missing; pass "
                                          "--skip_damaged"]),
        # 1 rank of 256: the global batch that 2 ranks of 128 make.
        ("batch", "fsdp.py", ("--save_every", "2", "--batch_size", "256"), 1,
         [f"checkpoint {newest} was made with a global batch of 512, here 256: pass --global_batch_size 512"]),
        ("file", "fsdp.py", FLAGS, 0, ["--snapshot_path fsdp_checkpoints is a file, not a folder"]),
        ("decoder", "tensor_parallel.py", (*LM, "--snapshot_path", "fsdp_checkpoints"), 1,
         [f"checkpoint {newest} holds another model (BlockMLP, saved by fsdp.py); this script trains a Decoder: pass "
          "another --snapshot_path"]),
        ("none_whole", "fsdp.py", (*FLAGS, "--skip_damaged"), 2, ["no checkpoint in fsdp_checkpoints checks out"]),
        ("narrow", "fsdp.py", FLAGS, 1, ["checkpoint fsdp_checkpoints/epoch_000002 does not fit this model",
                                         "model.inp.weight is [32, 20], here [64, 20]"]),
        ("flattened", "fsdp.py", FLAGS, 1, ["checkpoint fsdp_checkpoints/epoch_000002 keeps its optimizer state "
                                            "flattened (optimizer.param_groups.<parameter>.lr", "and this script keeps "
                                            "it nested (optimizer.param_groups.0.lr", "another layout; pass another"]),
    ]

    # The 2-rank cases under torchrun, side by side; the others each its script's command line in a child forked
    # from one process that imported torch once (tests/support/forked_runs.py), in its case's folder, with the
    # environment torchrun gives rank 0 (a port each: the 1-rank cases make their process group of one).
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    jobs = {case: start(torchrun_cmd(script, "--total_epochs", "6", *flags), cwd=tmp_path / case, merge_output=False)
            for case, script, flags, ranks, _ in cases if ranks == 2}
    alone = [[script, ["--total_epochs", "6", *flags], ranks or 2,
              {"cwd": tmp_path / case, "env": {"MASTER_PORT": free_port()}}]
             for case, script, flags, ranks, _ in cases if ranks != 2]
    said = iter(forked(alone, cwd=tmp_path))
    outputs = {}
    for case, _, _, ranks, fragments in cases:
        if ranks == 2:
            out, err = finish(jobs[case], 180)
            result = subprocess.CompletedProcess(jobs[case].args, jobs[case].returncode, out, err)
        else:
            result = next(said)
        outputs[case] = result.stdout
        assert_said_by_rank_0(result, *fragments)
    aside = {p: tmp_path / "none_whole" / f"{newest}.damaged" / p.name for p in before if "none_whole" in p.parts
             and "epoch_000004" in p.parts}
    assert {aside.get(p, p): data for p, data in before.items()} == {
        p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}, "no file changed, none added or lost"
    assert (f"Checkpoint {newest} is damaged (.metadata does not match its sum (CRC-32 " in outputs["none_whole"]
            and f"set aside as {newest}.damaged (--skip_damaged)" in outputs["none_whole"]), outputs["none_whole"]
    assert ("Checkpoint fsdp_checkpoints/epoch_000002 lists no sums (an older fsdp_checkpoint.py saved it): its files "
            "unchecked") in outputs["narrow"], outputs["narrow"]


def test_skip_damaged_sets_a_damaged_checkpoint_aside_and_resumes_bitwise_from_the_one_before(uninterrupted,
                                                                                              tmp_path):
    """400 bytes flipped in rank 1's shard of the newest checkpoint: with --skip_damaged the run says so, renames it
    epoch_000004.damaged (kept as it was), resumes from epoch 2's, and trains epochs 2 and 3 to the uninterrupted
    run's weights, bitwise.

    The run saves with --async_save, its save thread holding the save's arguments a second after its future is
    done (tests/support/programs/slow_to_let_go.py): DCP's save thread drops them only then, and fsdp.py waits for
    that thread before destroy_process_group, else the groups outlive it (the probe of tests/support fails the
    launch). Seen once in four suite runs; made certain here by holding the thread back."""
    directory, uninterrupted_out = uninterrupted
    checkpoints = tmp_path / "fsdp_checkpoints"
    shutil.copytree(directory / "fsdp_checkpoints", checkpoints)
    flip(checkpoints / "epoch_000004" / "__1_0.distcp")
    damaged = {p.name: p.read_bytes() for p in (checkpoints / "epoch_000004").iterdir()}
    out = run([BIN / "torchrun", "--standalone", "--nproc_per_node=2", PROGRAMS / "slow_to_let_go.py",
               REPO / "fsdp.py", "--total_epochs", EPOCHS, *FLAGS, "--skip_damaged", "--async_save"],
              cwd=tmp_path).stdout
    assert summary(out).epochs == EPOCHS - 2, "epochs 2 and 3, trained here"
    resaved = checkpoints / "epoch_000004"  # summed in the save thread
    assert json.loads((resaved / checkpoint_dir.MARKER).read_text())["files"] == checkpoint_sums(resaved)
    assert re.search(r"^Checkpoint fsdp_checkpoints/epoch_000004 is damaged \(__1_0\.distcp does not match its sum "
                     r"\(CRC-32 [0-9a-f]{8}, complete\.json says [0-9a-f]{8}\)\): set aside as "
                     r"fsdp_checkpoints/epoch_000004\.damaged \(--skip_damaged\)$", out, re.M), out[-3000:]
    assert "Resuming from fsdp_checkpoints/epoch_000002 at epoch 2" in out
    assert epoch_lines(out) == epoch_lines(uninterrupted_out)[2:], "epochs 2 and 3 as the uninterrupted run's"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["epoch_000002", "epoch_000004", "epoch_000004.damaged"]
    assert {p.name: p.read_bytes() for p in (checkpoints / "epoch_000004.damaged").iterdir()} == damaged
    assert_bitwise_equal(full_state(directory / "fsdp_checkpoints" / "epoch_000004", tmp_path),
                         full_state(checkpoints / "epoch_000004", tmp_path), "trained again from epoch 2")


def test_a_snapshot_path_the_nodes_do_not_share_is_refused_in_one_line(tmp_path):
    """Each node started in a directory of its own, as on two machines without a shared filesystem: the
    relative --snapshot_path names a different directory on each, and DCP would write half a checkpoint into
    each. Both nodes stop at start, before any training, each with the one line."""
    cwds = [tmp_path / "node0", tmp_path / "node1"]
    for cwd in cwds:
        cwd.mkdir()
    agents = start_two_nodes("--total_epochs", "2", *FLAGS, cwds=cwds, merge_output=False)
    for agent in agents:
        out, err = finish(agent, 120)
        assert_one_line_error(subprocess.CompletedProcess(agent.args, agent.returncode, out, err),
                              "ranks [1] do not see the files rank 0 writes in fsdp_checkpoints",
                              "--snapshot_path must be on a filesystem all nodes share", code=1)
        assert not epoch_lines(out), "stopped before training"
    assert list((cwds[0] / "fsdp_checkpoints").iterdir()) == [], "rank 0's probe file removed, nothing saved"
    assert not (cwds[1] / "fsdp_checkpoints").exists()


MID = "epoch_000001_sample_000001024"


@pytest.fixture(scope="module")
def killed_mid_epoch(tmp_path_factory):
    """Checkpoints every 3 steps (4 steps an epoch at 2 ranks); the run killed once the one 2 steps into epoch 1 is
    complete: its directory (the probe's batches in first/)."""
    directory = tmp_path_factory.mktemp("killed_mid_epoch")
    first = directory / "first"
    first.mkdir()
    mid = directory / "fsdp_checkpoints" / MID
    # Rank 1 stopped by the probe after step 7, then killed: rank 0 marked step 6's checkpoint complete before step
    # 7's collectives, and cannot reach the next one (step 9) without rank 1.
    job = start(fsdp("--total_epochs", EPOCHS, *FLAGS, "--save_every_steps", "3"), cwd=directory,
                env=clean_env(DDP_EXAMPLES_PROBE_SAMPLES=first, DDP_EXAMPLES_PROBE_STOP_AT="1:0:7"))
    stopped_worker(job, 1)
    for pid in [job.pid, *(torchrun_worker(job.pid, rank) for rank in (0, 1))]:
        os.kill(pid, signal.SIGKILL)
    finish(job, 60)
    assert (mid / checkpoint_dir.MARKER).exists(), "the mid-epoch checkpoint, complete"
    assert max(path.name for path in (directory / "fsdp_checkpoints").iterdir()) == mid.name, "none after it"
    return directory


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 3])
def test_a_mid_epoch_checkpoint_resumes_at_another_world_size_with_every_sample_once(uninterrupted, killed_mid_epoch,
                                                                                     tmp_path, nproc):
    """The run killed 2 steps into epoch 1 (killed_mid_epoch), resumed at 1 and at 3 ranks with the same global
    batch of 512: it goes on from sample 1024 of epoch 1, every sample of that epoch trained on once (counted by
    the probe), and ends with the uninterrupted run's weights but for the order of float additions."""
    directory, _ = uninterrupted
    first, second = killed_mid_epoch / "first", tmp_path / "second"
    second.mkdir()
    shutil.copytree(killed_mid_epoch / "fsdp_checkpoints", tmp_path / "fsdp_checkpoints")
    mid = tmp_path / "fsdp_checkpoints" / MID
    out = run(fsdp("--total_epochs", EPOCHS, *FLAGS, "--global_batch_size", "512", nproc=nproc), cwd=tmp_path,
              env=clean_env(DDP_EXAMPLES_PROBE_SAMPLES=second), timeout=180).stdout
    assert f"Resuming from fsdp_checkpoints/{mid.name} at epoch 1, sample 1024 of 2048" in out
    used = Counter()
    for rank in (0, 1):
        for batch in epoch_batches(first, rank)[1][:2]:  # epoch 1's steps before the checkpoint
            used.update(batch)
    for rank in range(nproc):
        for batch in epoch_batches(second, rank)[0]:
            used.update(batch)
    assert sorted(used) == list(range(2048)) and set(used.values()) == {1}, "every sample of epoch 1 once"
    final = full_state(tmp_path / "fsdp_checkpoints" / "epoch_000004", tmp_path)
    reference = full_state(directory / "fsdp_checkpoints" / "epoch_000004", tmp_path)
    for name, weight in reference["model"].items():
        assert torch.allclose(final["model"][name], weight, rtol=0, atol=1e-5), name
