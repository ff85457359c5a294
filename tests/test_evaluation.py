"""Uneven data: evaluation that counts every held-out sample once at any world size (by_feature/exact_evaluation.py;
train.py's Trainer: test_train_hf.py, on its mpirun run), training on shards of different lengths with Join
(by_feature/uneven_inputs.py), and what happens without it."""
import re
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import (REPO, assert_bitwise_equal, assert_one_line_error, clean_env, epoch_lines, load_snapshot,
                      python_cmd, run, summary, torchrun_cmd)
from torch.utils.data.distributed import DistributedSampler

from models_and_data import LinearClassifier, classification_splits

SMALL = ("--input_size", "20")
TRAIN_SIZE, EVAL_SIZE = 4096, 1001  # by_feature/exact_evaluation.py's; neither 2 nor 3 divides 1001
EVALUATE = "by_feature/exact_evaluation.py"
UNEVEN = "by_feature/uneven_inputs.py"
EVAL_LINE = re.compile(r"^Eval \| epochs (\d+) \| loss ([\d.]+) \| accuracy ([\d.]+) \| (\d+) of (\d+) correct$", re.M)


def evaluations(stdout):
    """Every `Eval` line as (epochs, loss, correct, samples), checking that its accuracy is correct / samples."""
    found = []
    for epochs, loss, accuracy, correct, samples in EVAL_LINE.findall(stdout):
        assert float(accuracy) == pytest.approx(int(correct) / int(samples), abs=5e-5)
        found.append((int(epochs), float(loss), int(correct), int(samples)))
    assert found, stdout[-3000:]
    return found


def held_out_logits(state):
    """The snapshot's model on the whole held-out set, in this process: the figure to match."""
    _, eval_set = classification_splits(TRAIN_SIZE, EVAL_SIZE, input_size=20, seed=0)
    model = LinearClassifier(20)
    model.load_state_dict(state["model"])
    x, y = eval_set.tensors
    with torch.no_grad():
        return model(x), y


@pytest.fixture(scope="module")
def uneven_run(tmp_path_factory):
    """by_feature/uneven_inputs.py (with Join) for 2 epochs at 2 ranks: (folder, stdout), and each rank's replica
    as it ended (tests/support/sitecustomize.py)."""
    folder = tmp_path_factory.mktemp("uneven")
    (folder / "replicas").mkdir()
    result = run(torchrun_cmd(UNEVEN, "--epochs", "2", "--snapshot_path", "uneven.pt", *SMALL), cwd=folder,
                 env=clean_env(DDP_EXAMPLES_PROBE_REPLICAS=folder / "replicas"))
    return folder, result.stdout


@pytest.mark.slow
def test_evaluation_is_the_same_at_world_sizes_1_2_3(tmp_path):
    """The example trained here at 2 ranks evaluates after every epoch; its model, scored at 2 ranks after the last
    one and with --evaluate at 1 and 3 ranks from its snapshot: the same counts, every one of the 1001 samples once,
    and the same figure as one process scoring the whole set here. The sampler the tutorial advises
    (DistributedSampler) pads 1001 samples to 1002 at both 2 and 3 ranks, and its figure differs."""
    trained = run(torchrun_cmd(EVALUATE, "--epochs", "2", "--snapshot_path", "trained.pt", *SMALL),
                  cwd=tmp_path).stdout
    assert [e[0] for e in evaluations(trained)] == [1, 2]  # after every epoch
    assert evaluations(trained)[-1][2] > 0.85 * EVAL_SIZE  # it learned (chance 0.5, label noise 5%)
    figures = {2: evaluations(trained)[-1]}  # the snapshot holds the weights this line scored
    for world_size in (1, 3):
        result = run(torchrun_cmd(EVALUATE, "--evaluate", "--snapshot_path", "trained.pt", *SMALL,
                                  nproc=world_size), cwd=tmp_path)
        (figures[world_size],) = evaluations(result.stdout)
        assert not epoch_lines(result.stdout), "--evaluate must not train"
    state = load_snapshot(tmp_path / "trained.pt")
    logits, labels = held_out_logits(state)
    correct = int((logits.argmax(1) == labels).sum())
    loss = F.cross_entropy(logits, labels).item()
    for world_size, (epochs, reported_loss, reported_correct, samples) in figures.items():
        assert (epochs, reported_correct, samples) == (2, correct, EVAL_SIZE), world_size
        assert reported_loss == pytest.approx(loss, abs=2e-6), world_size  # printed with 6 decimals

    # The trap: DistributedSampler evens the shards out by repeating samples, so the sum counts them twice.
    hits = (logits.argmax(1) == labels).tolist()
    for world_size in (2, 3):
        shards = [list(DistributedSampler(range(EVAL_SIZE), world_size, rank, shuffle=False))
                  for rank in range(world_size)]
        scored = [index for shard in shards for index in shard]
        assert len(scored) == 1002 and len(set(scored)) == EVAL_SIZE
        padded_accuracy = sum(hits[index] for index in scored) / len(scored)
        assert padded_accuracy != correct / EVAL_SIZE


def test_uneven_shards_train_with_join(uneven_run):
    """Rank 1 has twice rank 0's batches: with Join both finish every epoch and end with the same weights
    and the same optimizer state (Join only re-syncs the weights; the script copies the optimizer state of the
    rank that finished last), which is what the snapshot holds."""
    folder, stdout = uneven_run
    # 4096 samples dealt 1:2 are 1365 and 2731, in batches of 64.
    assert "Uneven shards: 22, 43 batches on ranks 0 to 1 | Join" in stdout
    epochs = epoch_lines(stdout)
    assert len(epochs) == 2 and summary(stdout).world_size == 2
    assert [line.samples for line in epochs] == [TRAIN_SIZE, TRAIN_SIZE]  # both ranks' shards, every sample once
    assert epochs[-1].accuracy > 0.85  # it learned (chance 0.5, label noise 5%)
    replicas = [torch.load(folder / "replicas" / f"rank{rank}.pt", weights_only=True) for rank in (0, 1)]
    assert_bitwise_equal(replicas[0], replicas[1], "rank 0 vs rank 1")
    snapshot = load_snapshot(folder / "uneven.pt")
    assert_bitwise_equal(snapshot["model"], replicas[1]["model"], "model")
    assert_bitwise_equal(snapshot["optimizer"], replicas[1]["optimizer"], "optimizer")


def test_uneven_shards_without_join_hang_and_diagnose_names_both_sides(tmp_path):
    """Without Join the rank that runs out first waits for the others (at a barrier), they for an all-reduce it
    never joins: a hang, which `python -m torchdiagnose --timeout 5` names with both sides, and the job ends; nothing
    aborts (run() fails the test on "terminate called" or SIGABRT, and when the launch outlives its own timeout)."""
    result = run([sys.executable, "-m", "torchdiagnose", "--timeout", "5",
                  *torchrun_cmd(UNEVEN, "--no_join", "--epochs", "2", "--snapshot_path", "uneven.pt", *SMALL)],
                 cwd=tmp_path, env=clean_env(PYTHONPATH=REPO), check=False, timeout=120)
    assert result.returncode != 0
    (line,) = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("diagnose: ")]
    assert "waited more than --timeout 5s: the ranks wait in different collectives: rank 0 in barrier" in line, line
    assert "rank 1 in all_reduce of [42], DDP's gradients in backward()" in line, line
    assert "Uneven shards: 22, 43 batches on ranks 0 to 1 | no Join" in result.stdout
    assert not epoch_lines(result.stdout) and not (tmp_path / "uneven.pt").exists()


@pytest.mark.quick
def test_evaluating_a_snapshot_that_is_not_there_is_one_line(tmp_path):
    result = run(python_cmd(EVALUATE, "--evaluate", "--snapshot_path", "absent.pt"), cwd=tmp_path, check=False,
                 timeout=60)
    assert_one_line_error(result, "--evaluate: no snapshot at absent.pt to evaluate")
