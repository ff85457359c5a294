"""The DDP tutorial series (singlegpu -> multigpu -> multigpu_torchrun -> multinode) under its real launchers."""
import os
import re
import shutil

import pytest
import torch

from conftest import (BIN, REPO, assert_bitwise_equal, assert_one_line_error, assert_same_training_state, clean_env,
                      epoch_lines, epoch_losses, finish, forked, free_port, load_snapshot, python_cmd, run, start,
                      summary, torchrun_cmd)
from models_and_data import MLP


def epochs(output):
    return [line.epoch for line in epoch_lines(output)]


@pytest.fixture(scope="module")
def singlegpu_six_epochs(tmp_path_factory):
    """Step 1, 6 epochs, a snapshot every 3: (folder, stdout). Also the uninterrupted run the resume is held to."""
    folder = tmp_path_factory.mktemp("singlegpu")
    out = run(python_cmd("singlegpu.py", "--total_epochs", "6", "--save_every", "3", "--batch_size", "64"),
              cwd=folder).stdout
    return folder, out


def test_singlegpu_learns_and_writes_a_complete_snapshot(singlegpu_six_epochs):
    tmp_path, out = singlegpu_six_epochs
    loss = epoch_losses(out)
    assert len(loss) == 6
    assert loss[-1] < 0.5 * loss[0], f"loss did not fall: {loss}"
    line = summary(out)
    assert (line.epochs, line.world_size, line.backend) == (6, 1, "none")
    state = load_snapshot(tmp_path / "singlegpu.pt")
    assert state["epochs_run"] == 6
    assert state["optimizer"]["state"], "the snapshot must hold the optimizer's momentum buffers"
    assert state["rng"].dtype == torch.uint8 and torch.equal(state["rng"], state["rng"])  # torch's generator
    assert sorted(os.listdir(tmp_path)) == ["singlegpu.pt"], "no temporary or lock file may be left behind"


@pytest.mark.slow
def test_singlegpu_positional_form_resumes_bitwise(singlegpu_six_epochs, tmp_path):
    """Stopped after 3 epochs and resumed to 6, in the positional form: the uninterrupted run is the shared one
    (the same numbers as flags)."""
    straight, stopped = singlegpu_six_epochs[0], tmp_path
    run(python_cmd("singlegpu.py", "3", "3", "--batch_size", "64"), cwd=stopped)
    out = run(python_cmd("singlegpu.py", "6", "3", "--batch_size", "64"), cwd=stopped).stdout
    assert "Resuming from singlegpu.pt at epoch 3" in out
    assert epochs(out) == [3, 4, 5], "resume must not repeat an epoch"
    assert_same_training_state(straight / "singlegpu.pt", stopped / "singlegpu.pt")

    finished = (stopped / "singlegpu.pt").read_bytes()
    out = run(python_cmd("singlegpu.py", "6", "3", "--batch_size", "64"), cwd=stopped).stdout
    assert "Nothing to do: singlegpu.pt already holds 6 epochs (--total_epochs 6)" in out
    assert (stopped / "singlegpu.pt").read_bytes() == finished


@pytest.fixture(scope="module")
def multigpu_after_singlegpu(singlegpu_six_epochs, tmp_path_factory):
    """Step 2, 4 epochs of 2 spawned ranks, in the folder where step 1 ran (its 6-epoch snapshot, copied): (folder,
    stdout)."""
    folder = tmp_path_factory.mktemp("multigpu")
    shutil.copy(singlegpu_six_epochs[0] / "singlegpu.pt", folder / "singlegpu.pt")
    out = run(python_cmd("multigpu.py", "--total_epochs", "4", "--save_every", "2", "--world_size", "2",
                         "--batch_size", "32"), cwd=folder).stdout
    return folder, out


def test_multigpu_spawns_ranks_logs_once_and_learns(multigpu_after_singlegpu):
    tmp_path, out = multigpu_after_singlegpu
    assert epochs(out) == [0, 1, 2, 3], "rank 0 alone logs, once per epoch"
    steps = {line.steps for line in epoch_lines(out)}
    assert steps == {2048 // (32 * 2)}, "each rank sees half of the data"
    loss = epoch_losses(out)
    assert loss[-1] < 0.5 * loss[0], loss
    assert (summary(out).world_size, summary(out).backend) == (2, "gloo")
    assert load_snapshot(tmp_path / "multigpu.pt")["epochs_run"] == 4


@pytest.mark.slow
def test_the_tutorial_in_order_in_one_folder(multigpu_after_singlegpu, tmp_path):
    """Each step writes its own snapshot: step 2 after step 1 trains (the shared run: epochs 0 to 3 beside step 1's
    finished snapshot), it does not find step 1's finished run; going on from step 1's snapshot is a flag."""
    assert epochs(multigpu_after_singlegpu[1]) == [0, 1, 2, 3]
    shutil.copytree(multigpu_after_singlegpu[0], tmp_path, dirs_exist_ok=True)  # the fixture's own stays as it ended
    out = run(python_cmd("multigpu.py", "8", "2", "--snapshot_path", "singlegpu.pt"), cwd=tmp_path).stdout
    assert "Resuming from singlegpu.pt at epoch 6" in out and epochs(out) == [6, 7]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["multigpu.pt", "singlegpu.pt"]


TWO_RANKS = ("--save_every", "2", "--batch_size", "16")


@pytest.fixture(scope="module")
def two_ranks_two_epochs(tmp_path_factory):
    """Step 3, 2 ranks, 2 epochs of batches of 16: (folder, stdout); its snapshot ddp.pt. The reference of one
    process with batch 32, the first half of the resume below, and, on a Mac (FAKE_MPS: torch reports one mps
    device, tests/support/sitecustomize.py), 2 processes on 1 device."""
    folder = tmp_path_factory.mktemp("two_ranks")
    out = run(torchrun_cmd("multigpu_torchrun.py", "--total_epochs", "2", *TWO_RANKS, "--snapshot_path", "ddp.pt"),
              cwd=folder, env=clean_env(DDP_EXAMPLES_PROBE_FAKE_MPS=1)).stdout
    return folder, out


@pytest.mark.slow
def test_torchrun_resume_is_bitwise_identical_to_an_uninterrupted_run(two_ranks_two_epochs, tmp_path):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    straight.mkdir(), stopped.mkdir()
    run(torchrun_cmd("multigpu_torchrun.py", "--total_epochs", "4", *TWO_RANKS), cwd=straight)
    # Stopped after 2 epochs: the shared run's snapshot, copied (the fixture's own stays as it ended).
    shutil.copy(two_ranks_two_epochs[0] / "ddp.pt", stopped / "multigpu_torchrun.pt")
    out = run(torchrun_cmd("multigpu_torchrun.py", "--total_epochs", "4", *TWO_RANKS), cwd=stopped).stdout
    assert "Resuming from multigpu_torchrun.pt at epoch 2" in out
    assert epochs(out) == [2, 3]
    assert_same_training_state(straight / "multigpu_torchrun.pt", stopped / "multigpu_torchrun.pt")


def test_two_ranks_with_batch_b_match_one_process_with_batch_2b(two_ranks_two_epochs, tmp_path):
    folder, two = two_ranks_two_epochs
    one = run(torchrun_cmd("multigpu_torchrun.py", "--total_epochs", "2", "--batch_size", "32",
                           "--snapshot_path", "single.pt", nproc=1), cwd=tmp_path).stdout
    # The printed loss is the mean over both ranks' batches, so it is the one-process loss, not rank 0's half.
    assert epoch_losses(two) == pytest.approx(epoch_losses(one), rel=1e-4) and len(epoch_losses(one)) == 2
    ddp, single = load_snapshot(folder / "ddp.pt")["model"], load_snapshot(tmp_path / "single.pt")["model"]
    torch.manual_seed(0)
    initial = MLP(input_size=20).state_dict()
    for name in ddp:
        assert torch.allclose(ddp[name], single[name], rtol=1e-4, atol=1e-5), name
    assert any(not torch.allclose(ddp[n], initial[n]) for n in ddp), "the weights must have been trained"


def step3_on_two_machines(node_dirs, *args):
    """Step 3 as a user might run it on two machines: a torchrun a node, 1 process each, each node in a folder of its
    own (its own disk), over the c10d rendezvous on 127.0.0.1."""
    port = free_port()
    agents = [start([BIN / "torchrun", "--nnodes=2", f"--node_rank={node}", "--nproc_per_node=1", "--rdzv_id=step3",
                     "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", REPO / "multigpu_torchrun.py",
                     "--timeout", "60", *args], directory) for node, directory in enumerate(node_dirs)]
    outputs = [finish(agent, 600) for agent in agents]  # a hang guard, not a speed bound
    return [agent.returncode for agent in agents], outputs


def test_step3_on_two_machines_stops_ranks_that_resume_at_different_epochs(tmp_path):
    node_dirs = [tmp_path / "node0", tmp_path / "node1"]
    for directory in node_dirs:
        directory.mkdir()
    codes, outputs = step3_on_two_machines(node_dirs, "--total_epochs", "1")
    assert codes == [0, 0], outputs
    saved = [directory for directory in node_dirs if (directory / "multigpu_torchrun.pt").exists()]
    assert len(saved) == 1, "rank 0 alone saves, on its own node's disk"
    before = (saved[0] / "multigpu_torchrun.pt").read_bytes()

    # Run again: one rank finds epoch 1 on its disk, the other nothing. Each would train other epochs, and the
    # job would fail at the end; it stops before any step, every rank with the same line.
    codes, outputs = step3_on_two_machines(node_dirs, "--total_epochs", "3")
    assert codes == [1, 1], outputs
    both = "".join(outputs)
    errors = {line for line in both.splitlines() if line.startswith("error: ")}
    assert len(errors) == 1, both
    line = errors.pop()
    held = re.match(r"error: the ranks resume at different epochs \(rank 0 at epoch (\d), rank 1 at epoch (\d)\)", line)
    assert held and sorted(held.groups()) == ["0", "1"], line
    assert "multinode.py" in line, line
    assert not epoch_lines(both), "no rank may train"
    assert (saved[0] / "multigpu_torchrun.pt").read_bytes() == before


def multinode_agents(cwd, port, *args, nproc=2):
    """Two torchrun agents on 127.0.0.1, `nproc` processes each, forming one job over the c10d rendezvous."""
    agents = [start([BIN / "torchrun", "--nnodes=2", f"--node_rank={node}", f"--nproc_per_node={nproc}",
                     "--rdzv_id=test", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
                     REPO / "multinode.py", "--snapshot_path", f"node{node}.pt", "--timeout", "60", *args], cwd)
              for node in (0, 1)]
    outputs = [finish(agent, 600) for agent in agents]  # a hang guard, not a speed bound
    return [agent.returncode for agent in agents], outputs


@pytest.mark.slow
def test_multinode_two_agents_form_one_job_and_refuse_a_snapshot_of_another_run(tmp_path):
    codes, outputs = multinode_agents(tmp_path, free_port(), "--total_epochs", "4", "--save_every", "2")
    assert codes == [0, 0], outputs
    both = "".join(outputs)
    assert epochs(both) == [0, 1, 2, 3], "rank 0 alone logs, once an epoch"
    assert summary(both).world_size == 4
    node0, node1 = load_snapshot(tmp_path / "node0.pt"), load_snapshot(tmp_path / "node1.pt")
    assert_bitwise_equal(node0["model"], node1["model"], "node snapshots")
    assert node0["run"] == node1["run"], "both nodes' snapshots belong to the same run"

    # Node 1 gets a snapshot of another training run (a one-node run of its own): resuming from either would
    # lose the other (the next saves overwrite it), so every rank stops with the same line and both snapshots
    # stay as they were. (Snapshots of one run that differ, a node with an older one or none: test_elastic.py.)
    # A process a node is enough for that: the check is between the nodes' snapshots.
    (tmp_path / "node1.pt").unlink()
    run(torchrun_cmd("multinode.py", "--total_epochs", "2", "--snapshot_path", "node1.pt", nproc=1), cwd=tmp_path)
    before = [(tmp_path / f"node{n}.pt").read_bytes() for n in (0, 1)]
    codes, outputs = multinode_agents(tmp_path, free_port(), "--total_epochs", "6", "--save_every", "2", nproc=1)
    assert codes == [1, 1], outputs
    for out in outputs:
        errors = {line for line in out.splitlines() if line.startswith("error: ")}
        assert len(errors) == 1, out
        line = errors.pop()
        assert line.startswith("error: the snapshots come from 2 training runs: node"), line
        assert "node0.pt on rank" in line and "node1.pt on rank" in line and "move the others away" in line, line
        assert not epoch_lines(out)
    assert [(tmp_path / f"node{n}.pt").read_bytes() for n in (0, 1)] == before


# ---- bad input: one line, non-zero exit, in seconds, no snapshot lost ----


NON_POSITIVE = [("--total_epochs", "0", "must be positive"), ("--batch_size", "-4", "must be positive"),
                ("--save_every", "0", "must be positive"), ("--timeout", "0", "must be positive"),
                ("--world_size", "0", "--world_size must be positive"),
                ("--batch_size", "ten", "invalid int value: 'ten'")]
UNDER_PLAIN_PYTHON = ["multigpu_torchrun.py", "multinode.py", "fsdp.py"]


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """The bad-input cases below, each its script's command line in a folder of its own, in a child forked from one
    process that imported torch once (forked_runs): {case: (CompletedProcess, folder)}. multigpu_torchrun.py's nccl
    refusal as rank 0 of 2 alone, in the environment torchrun gives it: the check comes before the process group, and
    every rank makes it alike. Its snapshot of another model as rank 0 of 1, in a process group of its own (a port
    each): every rank reads the same file and stops with the same line (the 2-rank stop inside the group:
    test_step3_on_two_machines_stops_ranks_that_resume_at_different_epochs)."""
    root = tmp_path_factory.mktemp("refused")
    cases = {("nccl", "multigpu_torchrun.py"): ["multigpu_torchrun.py", ["--backend", "nccl", "--total_epochs", "1"],
                                                2],
             ("corrupt",): ["singlegpu.py", ["--total_epochs", "2"], None],
             ("other model",): ["multigpu_torchrun.py", ["--total_epochs", "4"], 1]}
    cases.update({("number", flag, value): ["multigpu.py", [flag, value], None] for flag, value, _ in NON_POSITIVE})
    cases.update({("plain", script): [script, [], None] for script in UNDER_PLAIN_PYTHON})
    folders = {}
    for i, key in enumerate(cases):
        folders[key] = root / str(i)
        folders[key].mkdir()
        cases[key].append({"cwd": folders[key], "env": {"MASTER_PORT": free_port()}})
    (folders[("corrupt",)] / "singlegpu.pt").write_bytes(b"not a snapshot at all")
    other = MLP(input_size=5)
    optimizer = torch.optim.SGD(other.parameters(), lr=0.1)
    torch.save({"model": other.state_dict(), "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state(),
                "epochs_run": 3}, root / "other_model.pt")  # kept here as written, to compare
    shutil.copy(root / "other_model.pt", folders[("other model",)] / "multigpu_torchrun.pt")
    results = forked(list(cases.values()), cwd=root)
    return {key: (result, folders[key]) for key, result in zip(cases, results)}


# ---- bad input: one line, non-zero exit, in seconds, no snapshot lost ----


@pytest.mark.quick
@pytest.mark.parametrize("script", ["multigpu.py", "multigpu_torchrun.py"])
def test_nccl_without_gpu_says_use_gloo(request, tmp_path, script):
    """multigpu.py's ranks check it (mp.spawn starts them first), under the script's own launch;
    multigpu_torchrun.py's rank 0 of 2 alone (`refused`)."""
    if script == "multigpu.py":
        result, folder = run(python_cmd(script, "--backend", "nccl", "--total_epochs", "1"), cwd=tmp_path, check=False,
                             timeout=60), tmp_path
    else:
        result, folder = request.getfixturevalue("refused")[("nccl", script)]
    assert_one_line_error(result, "--backend nccl needs a CUDA GPU", "leave --backend out for gloo", code=1)
    assert not (folder / f"{script[:-3]}.pt").exists()


@pytest.mark.quick
@pytest.mark.parametrize("flag,value,said", NON_POSITIVE)
def test_non_positive_numbers_are_refused(refused, flag, value, said):
    result, folder = refused[("number", flag, value)]
    assert_one_line_error(result, "multigpu.py: error: ", flag, said)
    assert not (folder / "multigpu.pt").exists()


@pytest.mark.quick
def test_corrupt_snapshot_is_reported_and_kept(refused):
    result, folder = refused[("corrupt",)]
    assert_one_line_error(result, "cannot read the snapshot singlegpu.pt (UnpicklingError: truncated, or not a "
                                  "snapshot); move it away", code=1)
    assert (folder / "singlegpu.pt").read_bytes() == b"not a snapshot at all"


def test_truncated_and_foreign_snapshots_are_named_as_such(singlegpu_six_epochs, tmp_path):
    """A snapshot cut short (a copy interrupted, a full disk: half of the shared run's) and a file torch.save wrote
    that is no snapshot of these scripts: each one line that names it, and the file is kept. Both in children
    forked from one process (forked_runs), each in a folder of its own."""
    whole = (singlegpu_six_epochs[0] / "singlegpu.pt").read_bytes()
    cut, foreign = tmp_path / "cut", tmp_path / "foreign"
    cut.mkdir(), foreign.mkdir()
    (cut / "singlegpu.pt").write_bytes(whole[:len(whole) // 2])
    torch.save({"weights": torch.zeros(3)}, foreign / "singlegpu.pt")
    truncated, other = forked([["singlegpu.py", ["8", "1"], None, {"cwd": cut}],
                               ["singlegpu.py", ["8", "1"], None, {"cwd": foreign}]], cwd=tmp_path)
    assert_one_line_error(truncated, "cannot read the snapshot singlegpu.pt (", "truncated, or not a snapshot", code=1)
    assert (cut / "singlegpu.pt").read_bytes() == whole[:len(whole) // 2]
    assert_one_line_error(other, "the snapshot singlegpu.pt is of another model or optimizer ('model')", code=1)
    assert load_snapshot(foreign / "singlegpu.pt").keys() == {"weights"}


def test_snapshot_of_another_model_is_reported_and_kept(refused):
    """A snapshot of an MLP of 5 inputs (`refused`: multigpu_torchrun.py as rank 0 of 1, in its process group)."""
    result, folder = refused[("other model",)]
    assert_one_line_error(result, "the snapshot multigpu_torchrun.pt is of another model or optimizer",
                          "size mismatch", code=1)
    assert (folder / "multigpu_torchrun.pt").read_bytes() == (folder.parent / "other_model.pt").read_bytes()


@pytest.mark.quick
@pytest.mark.parametrize("script", UNDER_PLAIN_PYTHON)
def test_torchrun_script_under_plain_python_says_how_to_launch(refused, script):
    result, _ = refused[("plain", script)]
    assert_one_line_error(result, f"start it with torchrun: torchrun --standalone --nproc_per_node=2 {REPO / script}")


def test_more_processes_than_devices_train_on_the_cpu(two_ranks_two_epochs, tmp_path):
    """A Mac: torch reports one mps device (the probe DDP_EXAMPLES_PROBE_FAKE_MPS in tests/support/sitecustomize.py,
    loaded by every launched process). Two processes under torchrun (the shared 2-rank run, launched so) do not share
    it: both train on the CPU, with gloo, and the first line says so."""
    env = clean_env(DDP_EXAMPLES_PROBE_FAKE_MPS=1)
    seen = run([BIN / "python", "-c", "import torch; print(torch.accelerator.current_accelerator("
                "check_available=True), torch.accelerator.device_count(), torch.backends.mps.is_available())"],
               cwd=tmp_path, env=env)
    assert seen.stdout.split() == ["mps", "1", "True"], "the probe must make torch report one mps device"
    out = two_ranks_two_epochs[1]
    assert out.splitlines()[0] == "Training on 2 processes | device cpu | backend gloo", out[-2000:]
    assert summary(out).backend == "gloo" and len(epoch_lines(out)) == 2
