"""Sending less: DDP communication hooks (by_feature/comm_hooks.py --comm_hook fp16, bf16, powersgd), the sharded
optimizer (by_feature/zero_optimizer.py) and both at once (by_feature/powersgd_with_zero.py). Every launch trains the
same 2-rank linear classifier for at most 2 epochs (64 steps); the launches are shared between the tests through one
module-scoped cache, so each runs once. What every rank ends with is saved by the test's probe
(tests/support/sitecustomize.py, DDP_EXAMPLES_PROBE_REPLICAS), not by the scripts."""
import re
import shutil

import pytest
import torch
from conftest import (assert_bitwise_equal, assert_one_line_error, clean_env, epoch_lines, epoch_losses, load_snapshot,
                      python_cmd, run, torchrun_cmd)

SMALL = ("--input_size", "20", "--epochs", "2")
HOOKS, ZERO, BOTH = "by_feature/comm_hooks.py", "by_feature/zero_optimizer.py", "by_feature/powersgd_with_zero.py"
# fp16/bf16: the weights after 64 steps stay within this of the fp32 all-reduce's (largest weight about 0.86;
# measured: bf16 2.3e-4), and the last epoch's training accuracy within this of it.
CAST_TOLERANCE, CAST_ACCURACY_TOLERANCE = 2e-3, 0.005
POWERSGD_FLOOR = 0.85  # training accuracy of the second epoch; chance is 0.5, the best possible about 0.95
OPTIMIZER_LINE = re.compile(r"^Optimizer state \| ([\d, ]+) bytes on ranks", re.M)

LAUNCHES = {  # name: (script, flags, the launch whose snapshot it resumes from a copy, or None)
    "none": (HOOKS, (), None),
    "fp16": (HOOKS, ("--comm_hook", "fp16"), None),
    "bf16": (HOOKS, ("--comm_hook", "bf16"), None),
    "powersgd": (HOOKS, ("--comm_hook", "powersgd"), None),
    "zero": (ZERO, (), None),
    # Stopped after epoch 1 with PowerSGD and ZeRO, then resumed to epoch 2 from a copy of its snapshot, once
    # without ZeRO and once with it: both the same run as "powersgd".
    "powersgd zero 1 epoch": (BOTH, ("--comm_hook", "powersgd", "--epochs", "1"), None),
    "powersgd resumed": (HOOKS, ("--comm_hook", "powersgd"), "powersgd zero 1 epoch"),
    "powersgd zero resumed": (BOTH, ("--comm_hook", "powersgd"), "powersgd zero 1 epoch"),
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """launched(name) -> (folder, stdout) of LAUNCHES[name] (and of the launch it resumes), run on first use."""
    root, done = tmp_path_factory.mktemp("sending-less"), {}

    def get(name):
        if name not in done:
            script, flags, resumes = LAUNCHES[name]
            folder = root / name.replace(" ", "-")
            (folder / "replicas").mkdir(parents=True)
            if resumes:
                shutil.copy(get(resumes)[0] / "run.pt", folder / "run.pt")
            result = run(torchrun_cmd(script, *SMALL, "--snapshot_path", "run.pt", *flags), cwd=folder,
                         env=clean_env(DDP_EXAMPLES_PROBE_REPLICAS=folder / "replicas"))
            done[name] = (folder, result.stdout)
        return done[name]
    return get


def replicas(folder):
    return [torch.load(folder / "replicas" / f"rank{rank}.pt", weights_only=True) for rank in (0, 1)]


def final_accuracy(stdout):
    lines = epoch_lines(stdout)
    assert [line.epoch for line in lines][-1] == 1 and lines[-1].samples == 4096, lines
    return lines[-1].accuracy


@pytest.mark.parametrize("hook", ["none", "fp16", "bf16", "powersgd"])
def test_ranks_hold_identical_weights_under_each_hook(launched, hook):
    """Each rank decompresses the same all-reduced result, so the replicas stay bitwise equal; the snapshot holds
    them. A hook that ran changes the weights (fp16/bf16 round the gradients, PowerSGD approximates them); the
    16-bit casts stay within CAST_TOLERANCE of the fp32 all-reduce."""
    folder, stdout = launched(hook)
    rank0, rank1 = replicas(folder)
    assert_bitwise_equal(rank0, rank1, f"{hook}: rank 0 vs rank 1")
    assert_bitwise_equal(load_snapshot(folder / "run.pt")["model"], rank0["model"], "snapshot")
    if hook == "none":
        return
    reference_folder, reference_stdout = launched("none")
    reference = replicas(reference_folder)[0]["model"]
    gap = max((rank0["model"][k] - reference[k]).abs().max().item() for k in reference)
    assert gap > 0, f"{hook}: the weights are those of the fp32 all-reduce: was the hook registered?"
    if hook in ("fp16", "bf16"):
        assert gap < CAST_TOLERANCE, (hook, gap)
        assert abs(final_accuracy(stdout) - final_accuracy(reference_stdout)) <= CAST_ACCURACY_TOLERANCE


def test_powersgd_learns_and_keeps_its_error_feedback(launched):
    """PowerSGD (rank 1, 10 plain steps) learns: the loss falls and the accuracy clears the floor. The
    snapshot holds each rank's state: rank-1 factors of the 2 x 20 weight and an error feedback that differs
    between the ranks (each keeps what compression left out of its own gradient)."""
    folder, stdout = launched("powersgd")
    losses = epoch_losses(stdout)
    assert len(losses) == 2 and losses[1] < losses[0]
    assert final_accuracy(stdout) > POWERSGD_FLOOR
    states = load_snapshot(folder / "run.pt")["comm_hook"]
    assert len(states) == 2 and all(state["iter"] == 64 for state in states)
    for state in states:
        assert [p.shape for p in state["p"].values()] == [(2,)] and [q.shape for q in state["q"].values()] == [(20,)]
    errors = [torch.cat(list(state["error"].values())) for state in states]
    assert errors[0].abs().sum() > 0 and not torch.equal(errors[0], errors[1])


@pytest.mark.slow
@pytest.mark.parametrize("resumed", ["powersgd resumed", "powersgd zero resumed"])
def test_powersgd_resumed_from_a_zero_snapshot_equals_the_uninterrupted_run(launched, resumed):
    """Stopped after epoch 1 with PowerSGD and ZeRO and resumed without ZeRO, or with it: the weights,
    the (consolidated) optimizer state and every rank's PowerSGD state end bitwise equal to those of the run that
    never stopped and never sharded. (ZeRO steps each parameter with the same SGD arithmetic as the unsharded
    optimizer, on the rank that owns it, then broadcasts it: no rounding differs.)"""
    uninterrupted, _ = launched("powersgd")
    folder, stdout = launched(resumed)
    assert "Resuming from run.pt at epoch 1" in stdout
    a, b = load_snapshot(uninterrupted / "run.pt"), load_snapshot(folder / "run.pt")
    for key in ("epochs_run", "model", "optimizer", "comm_hook"):
        assert_bitwise_equal(a[key], b[key], key)
    reference = replicas(uninterrupted)
    for rank, replica in enumerate(replicas(folder)):
        assert_bitwise_equal(replica["model"], reference[rank]["model"], f"rank {rank}")


# The resumed combination is two more launches, which the whole suite's resume test makes anyway.
@pytest.mark.parametrize("name", ["zero", pytest.param("powersgd zero resumed", marks=pytest.mark.slow)])
def test_zero_shards_the_optimizer_state(launched, name):
    """Under ZeRO each rank holds the momentum of its own parameters only (ZeRO shards whole tensors: the 2 x 20
    weight on one rank, the bias on the other), read from what each rank holds at the end, and the script prints
    those figures; the snapshot's state is consolidated, every parameter's momentum in it."""
    folder, stdout = launched(name)
    assert load_snapshot(folder / "run.pt")["optimizer"]["state"].keys() == {0, 1}
    shards = [replica["optimizer"]["state"] for replica in replicas(folder)]
    held = [sum(s["momentum_buffer"].numel() * 4 for s in shard.values()) for shard in shards]
    assert sorted(held) == [2 * 4, 40 * 4], held  # the bias's momentum on one rank, the weight's on the other
    assert [int(b) for b in OPTIMIZER_LINE.search(stdout)[1].split(", ")] == held
    unsharded = [load_snapshot(path)["optimizer"]["state"] for path in (launched("none")[0] / "replicas").glob("*.pt")]
    assert [sum(s["momentum_buffer"].numel() * 4 for s in state.values()) for state in unsharded] == [168, 168]


@pytest.mark.quick
@pytest.mark.parametrize("args, expected", [
    (["--comm_hook", "batched_powersgd"], "invalid choice: 'batched_powersgd'"),  # torch's fails on its first step
    (["--comm_hook", "powersgd", "--powersgd_warmup", "1"], "--powersgd_warmup 1: PowerSGD needs at least 2"),
])
def test_bad_hook_flags(tmp_path, args, expected):
    result = run(python_cmd(HOOKS, *args), cwd=tmp_path, check=False, timeout=60)
    assert_one_line_error(result, expected)
