"""Step checkpoints (by_feature/step_checkpoints.py): SIGKILLs at arbitrary steps under torchrun --max_restarts end
bitwise equal to an uninterrupted run and lose at most N steps; a run stopped at one world size and resumed at
another uses every sample of the interrupted epoch exactly once. What each process trained on is counted from
outside the script (tests/support/sitecustomize.py, DDP_EXAMPLES_PROBE_SAMPLES): the indices of every batch it
fetched and every optimizer step it took.
"""
import json
import os
import re
import shutil
import signal
import sys
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from conftest import (BIN, ELASTIC, HANG_GUARD_S, RDZV_CONF, REPO, assert_bitwise_equal, assert_one_line_error,
                      children, clean_env, epoch_batches, epoch_lines, events, finish, forked, free_port, listening,
                      load_snapshot, release_when_stopped_by_torchrun, run, start, stopped_worker, summary,
                      torchrun_cmd, torchrun_worker, wait_for)



SCRIPT = "by_feature/step_checkpoints.py"
N = 4096  # the example's dataset
EVERY = 20  # --save_every_steps
SMALL = ("--input_size", "20", "--save_every_steps", str(EVERY))
RESUMED = re.compile(r"^Resuming from \S+ at epoch (\d+), sample (\d+) of \d+ "
                     r"\(step (\d+), saved at world size (\d+)\)", re.M)


def probe_env(directory, stop_at=None):
    """The probe's environment; stop_at="R:C:N,...": rank R of restart round C stops itself after its N-th step."""
    directory.mkdir(exist_ok=True)
    stop = {"DDP_EXAMPLES_PROBE_STOP_AT": stop_at} if stop_at else {}
    return clean_env(DDP_EXAMPLES_PROBE_SAMPLES=directory, **stop)


def steps_taken(directory, rank, restart=0):
    return sum("step" in event for event in events(directory, rank, restart))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """2 ranks, 2 epochs of 128 steps (16 samples per rank and step), output to a pipe: its folder and stdout."""
    directory = tmp_path_factory.mktemp("uninterrupted")
    out = run(torchrun_cmd(SCRIPT, *SMALL, "--epochs", "2", "--batch_size", "16"), cwd=directory, timeout=300).stdout
    return directory, out


@pytest.fixture(scope="module")
def uninterrupted(reference):
    """The reference run's snapshot."""
    return load_snapshot(reference[0] / "step_checkpoints.pt")


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """The reference's run under torchrun --max_restarts=2, rank 1 killed at step 33 of epoch 0, rank 0 of the
    restarted group 150 steps after its resume (step 170, mid-epoch 1): its folder, output, exit code, probes, the
    steps rank 0 took before the first kill; and in stopped/, copied while rank 0 stood stopped before its kill, the
    step-160 snapshot the last group resumed from: a 2-rank run stopped mid-epoch 1, which the resumes at other world
    sizes and with another global batch go on from (their probes: the restarted group's, restart round 1)."""
    folder = tmp_path_factory.mktemp("killed")
    probes, stopped = folder / "probe", folder / "stopped"
    job = start(torchrun_cmd(SCRIPT, *SMALL, "--epochs", "2", "--batch_size", "16", extra=("--max_restarts=2",)),
                cwd=folder, env=probe_env(probes, stop_at="1:0:33,0:1:150"))  # 150: into epoch 1, step 170
    os.kill(stopped_worker(job, 1), signal.SIGKILL)
    killed_at = steps_taken(probes, 0, 0)
    victim = stopped_worker(job, 0, restart=1)
    stopped.mkdir()
    shutil.copy(folder / "step_checkpoints.pt", stopped)  # whole: the script renames each save into place
    os.kill(victim, signal.SIGKILL)
    out = finish(job, HANG_GUARD_S)
    return SimpleNamespace(folder=folder, out=out, returncode=job.returncode, probes=probes, killed_at=killed_at,
                           stopped=stopped)


@pytest.mark.slow
def test_sigkills_at_arbitrary_steps_lose_at_most_n_steps_and_end_bitwise_equal(killed, uninterrupted):
    """Rank 1 killed at step 33 of epoch 0, rank 0 of the restarted group 150 steps after its resume, mid-epoch 1:
    each restart resumes from the last step snapshot, mid-epoch, and the run ends where the uninterrupted one did, to
    the bit."""
    out, probes = killed.out, killed.probes
    assert killed.returncode == 0, out

    resumes = [(int(e), int(p), int(s), int(w)) for e, p, s, w in RESUMED.findall(out)]
    assert len(resumes) == 2, out
    killed_at = [killed.killed_at, resumes[0][2] + steps_taken(probes, 0, 1)]
    for (epoch, position, step, world_size), killed_step in zip(resumes, killed_at):
        assert world_size == 2 and position == (step - 128 * epoch) * 32 and 0 < position < N, resumes
        assert 0 <= killed_step - step <= EVERY, f"lost {killed_step - step} steps, more than {EVERY}"
    assert [r[0] for r in resumes] == [0, 1], "resumed mid-epoch 0, then mid-epoch 1"
    final = load_snapshot(killed.folder / "step_checkpoints.pt")
    for key in ("model", "optimizer", "rng", "epochs_run", "position", "steps"):
        assert_bitwise_equal(final[key], uninterrupted[key], key)


def samples_of_interrupted_epoch(probes_before, probes_after, epoch, position, global_batch, world_before,
                                 world_after, restart_before=0):
    """Every sample the final weights were trained on in the interrupted epoch: the steps before the snapshot's
    position (the steps after it, lost to the stop, were trained again), then the resumed run's first pass. `epoch`:
    the pass of the run before (of its restart round `restart_before`) that the snapshot was saved in."""
    steps_before = position // global_batch
    used = Counter()
    for rank in range(world_before):
        for batch in epoch_batches(probes_before, rank, restart_before)[epoch][:steps_before]:
            used.update(batch)
    for rank in range(world_after):
        for batch in epoch_batches(probes_after, rank)[0]:
            used.update(batch)
    return used


def stop_at_step(folder, nproc, probes, step):
    """A run of `nproc` ranks in `folder` (it resumes from the snapshot there, if any) stopped (SIGKILL, torchrun and
    every rank) once rank 0 took `step` steps: its output."""
    job = start(torchrun_cmd(SCRIPT, *SMALL, "--epochs", "2", "--global_batch_size", "32", nproc=nproc), cwd=folder,
                env=probe_env(probes, stop_at=f"0:0:{step}"))
    stopped_worker(job, 0)
    for pid in [job.pid] + [torchrun_worker(job.pid, r) for r in range(nproc)]:
        os.kill(pid, signal.SIGKILL)
    return finish(job, 60)


@pytest.mark.slow
def test_a_run_stopped_at_one_world_size_resumes_at_another_with_every_sample_once(tmp_path, uninterrupted, killed):
    """One run with the same global batch of 32 throughout, stopped (SIGKILL) mid-epoch 1 (killed's, at 2 ranks, its
    snapshot at step 160 taken before torchrun restarted the group: it stands for a job that was not restarted) and
    resumed at another world size three times: 2 -> 1 -> 2 -> 3 ranks, each resumed run but the last stopped again
    30 steps in (10 steps past its first snapshot). Each resume goes on from the snapshot saved at the world size
    before it; every sample of epoch 1 is trained on once (each run's steps up to the next snapshot, the last run's
    to the end), and the final weights are those of the uninterrupted 2-rank run but for the order of float
    additions (measured: differences below 1e-6; allowed 1e-5)."""
    shutil.copy(killed.stopped / "step_checkpoints.pt", tmp_path)
    # (world size, probes, their restart round, its pass of epoch 1, the position it started at)
    runs = [(2, killed.probes, 1, 1, 0)]
    used = Counter()
    for hop, after in enumerate((1, 2, 3)):
        before, probes, restart, epoch_pass, began = runs[-1]
        saved = load_snapshot(tmp_path / "step_checkpoints.pt")
        assert (saved["epochs_run"], saved["world_size"]) == (1, before) and began < saved["position"] < N, saved
        for rank in range(before):  # the steps of the run before that its snapshot holds
            for batch in epoch_batches(probes, rank, restart)[epoch_pass][:(saved["position"] - began) // 32]:
                used.update(batch)
        probes = tmp_path / f"hop{hop}"
        if after == 3:
            out = run(torchrun_cmd(SCRIPT, *SMALL, "--epochs", "2", "--global_batch_size", "32", nproc=after),
                      cwd=tmp_path, env=probe_env(probes), timeout=300).stdout
        else:
            out = stop_at_step(tmp_path, after, probes, 30)
        assert f"Resuming from step_checkpoints.pt at epoch 1, sample {saved['position']} of {N}" in out, out[-2000:]
        runs.append((after, probes, 0, 0, saved["position"]))
    for rank in range(3):  # the last run: the rest of epoch 1
        for batch in epoch_batches(probes, rank)[0]:
            used.update(batch)
    assert sorted(used) == list(range(N)) and set(used.values()) == {1}, "every sample of the epoch exactly once"
    final = load_snapshot(tmp_path / "step_checkpoints.pt")
    assert (final["epochs_run"], final["position"], final["steps"]) == (2, 0, 256)
    for name, weight in uninterrupted["model"].items():
        assert torch.allclose(final["model"][name], weight, rtol=0, atol=1e-5), (name, final["model"][name] - weight)


@pytest.mark.slow
def test_another_global_batch_goes_on_through_the_same_order(tmp_path, killed):
    """Resumed with another global batch: the order is the epoch's, not the batch's, so the rest of the epoch
    goes on from the same sample, in steps of the new size, and every sample is still used once (the run is then
    not the uninterrupted one's, and the script says so). From the 2-rank run stopped mid-epoch 1 (killed.stopped)."""
    first, second = killed.probes, tmp_path / "second"
    shutil.copy(killed.stopped / "step_checkpoints.pt", tmp_path)
    saved = load_snapshot(tmp_path / "step_checkpoints.pt")
    assert saved["global_batch"] == 32 and 0 < saved["position"] < N, saved["position"]
    out = run(torchrun_cmd(SCRIPT, *SMALL, "--epochs", "2", "--batch_size", "48"), cwd=tmp_path,
              env=probe_env(second), timeout=300).stdout
    assert "Note: steps of 96 samples from here on, not 32" in out
    used = samples_of_interrupted_epoch(first, second, 1, saved["position"], 32, 2, 2, restart_before=1)
    assert sorted(used) == list(range(N)) and set(used.values()) == {1}


@pytest.mark.slow
def test_bad_input_is_one_line_and_overwrites_nothing(tmp_path, reference):
    """The reference run's snapshot, changed: every rank reads it and stops with the same line. Another dataset size
    at 2 ranks under torchrun (one line, though both ranks say it); another seed at 1 rank (with the environment
    torchrun gives it), the same check. The bad flag and the seed case run forked (conftest.forked)."""
    state = load_snapshot(reference[0] / "step_checkpoints.pt")
    seed_folder = tmp_path / "seed"
    seed_folder.mkdir()
    torch.save({**state, "dataset_size": 1000}, tmp_path / "step_checkpoints.pt")
    torch.save({**state, "seed": 7}, seed_folder / "step_checkpoints.pt")
    before = {folder: (folder / "step_checkpoints.pt").read_bytes() for folder in (tmp_path, seed_folder)}
    args = (*SMALL, "--epochs", "3", "--batch_size", "16")
    flag, seed = forked([[SCRIPT, ["--save_every_steps", "0"], None],
                         [SCRIPT, args, 1, {"cwd": seed_folder, "env": {"MASTER_PORT": free_port()}}]], cwd=tmp_path,
                        timeout=120)
    assert_one_line_error(flag, "argument --save_every_steps: must be a positive integer, got 0")
    size = run(torchrun_cmd(SCRIPT, *args), cwd=tmp_path, check=False, timeout=120)
    for result, folder, said in ((size, tmp_path, "another dataset size (1000, here 4096)"),
                                 (seed, seed_folder, "another seed (7, here 0)")):
        assert_one_line_error(result, f"step_checkpoints.pt was made with {said}", code=1)
        assert (folder / "step_checkpoints.pt").read_bytes() == before[folder] and not epoch_lines(result.stdout)


def test_progress_within_the_epoch_and_the_checkpoints_it_writes(reference):
    """Output to a pipe (the reference run's): a plain progress line every tenth of the epoch (steps done,
    samples/s, time left), and a line for every step checkpoint written."""
    out = reference[1]
    for epoch in (0, 1):
        progress = re.findall(rf"^Epoch {epoch} \| step (\d+)/128 \| [\d.]+ samples/s \| \d+s left in the epoch$", out,
                              re.M)
        assert [int(step) for step in progress] == list(range(12, 128, 12)), out
        saved = re.findall(rf"^Epoch {epoch} \| step (\d+)/128 \| Snapshot saved at step_checkpoints.pt$", out, re.M)
        # Every EVERY steps of the run: in epoch 0 at steps 20 to 120, in epoch 1 at 12 (the run's step 140) to 112.
        assert [int(step) for step in saved] == [step for step in range(1, 129) if (128 * epoch + step) % EVERY == 0]
    assert re.findall(r"^Epoch 0 \| step (\d+)/128 \| Snapshot saved", out, re.M) == ["20", "40", "60", "80", "100",
                                                                                       "120"]
    assert summary(out).steps == 256


def processes(directory):
    """Every process the probe saw: (start time, rank, world size, its batches in order, its steps), by start."""
    found = []
    for path in directory.glob("rank*.jsonl"):
        lines = [json.loads(line) for line in path.read_text().split("\n")[:-1]]  # whole lines: it may be writing
        if not lines:
            continue
        head = lines[0]
        found.append((head["start"], head["rank"], head["world_size"], [e["batch"] for e in lines if "batch" in e],
                      sum("step" in e for e in lines)))
    return sorted(found)


EPOCHS = 6  # of the elastic run: long enough that node 0 alone is still training when node 2 joins


@pytest.mark.slow
def test_nodes_that_die_and_join_mid_epoch_lose_at_most_n_steps_and_train_every_sample_once(tmp_path):
    """torchrun --nnodes=1:2, one process a node, one folder for the snapshot (as a shared filesystem would be):
    two nodes; node 1's agent killed mid-epoch (its worker goes with it), node 0 goes on alone from the last step
    snapshot, mid-epoch; node 2 joins, and the two go on from where node 0 got to. Every restart loses at most N
    steps, and every epoch's samples are each trained on once (counted from the probe). Each node runs under
    `python -m torchdiagnose`, which ties a worker's life to its agent's (the script does not)."""
    probes, port = tmp_path / "probe", free_port()
    probes.mkdir()
    # 10 ms a step: node 0 alone must still be training when the test stops it (it would finish in a second).
    env = {**ELASTIC, "DDP_EXAMPLES_PROBE_SAMPLES": str(probes), "DDP_EXAMPLES_PROBE_STEP_DELAY": "0.01",
           "PYTHONPATH": str(REPO)}

    def agent(job):  # the torchrun that diagnose started
        wait_for(lambda: children(job.pid) or job.poll() is not None, 60, "torchrun under diagnose")
        return children(job.pid)[0]

    def node(number):
        return start([sys.executable, "-m", "torchdiagnose", "--timeout", "30", BIN / "torchrun", "--nnodes=1:2",
                      "--nproc_per_node=1", "--max_restarts=3", "--rdzv_id=steps",
                      "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
                      f"--rdzv_conf={RDZV_CONF.replace('last_call_timeout=1', 'last_call_timeout=5')}",
                      REPO / SCRIPT, *SMALL, "--epochs", str(EPOCHS), "--global_batch_size", "32", "--timeout", "30"],
                     tmp_path, env)
    # Node 0 hosts the rendezvous store (the first agent to bind the port does): node 1, the one killed, must not.
    first = node(0)
    wait_for(lambda: listening(port) or first.poll() is not None, 60, "node 0's rendezvous store")
    second = node(1)
    wait_for(lambda: len(processes(probes)) == 2 and all(p[2] == 2 for p in processes(probes))
             or first.poll() is not None, 120, "both nodes in one group")
    wait_for(lambda: processes(probes)[0][4] >= 128 + 15 or first.poll() is not None, 120, "mid-epoch 1")
    worker = torchrun_worker(agent(second), 0, 0)
    os.kill(agent(second), signal.SIGKILL)  # the node's agent; its worker dies with it
    wait_for(lambda: torchrun_worker(agent(first), 0, restart=1) or first.poll() is not None, 120, "node 0 alone")
    alone = torchrun_worker(agent(first), 0, restart=1)
    wait_for(lambda: len(processes(probes)) == 3 or first.poll() is not None, 120, "node 0 alone training")
    assert first.poll() is None, finish(first, 30)
    (path,) = probes.glob("rank0-restart1-*.jsonl")
    # Past its first step snapshot, then held (SIGSTOP, as a slow machine would be) while node 2 joins.
    wait_for(lambda: path.read_text().count('"step"') >= EVERY + 5 or first.poll() is not None, 120, "steps alone")
    os.kill(alone, signal.SIGSTOP)
    third = node(2)
    release_when_stopped_by_torchrun(alone)
    outputs = [finish(first, HANG_GUARD_S), finish(third, HANG_GUARD_S)]
    finish(second, 30)
    assert [first.returncode, third.returncode] == [0, 0], outputs
    assert worker and not os.path.exists(f"/proc/{worker}"), "node 1's worker died with its agent"

    resumes = sorted((int(s), int(e), int(p), int(w)) for e, p, s, w in RESUMED.findall("".join(outputs)))
    assert [w for *_, w in resumes] == [2, 1], f"resumed once at world size 1, once at 2: {resumes}"
    rounds = [[p for p in processes(probes) if p[2] == 2][:2], [p for p in processes(probes) if p[2] == 1],
              [p for p in processes(probes) if p[2] == 2][2:]]
    assert [len(r) for r in rounds] == [2, 1, 2], rounds
    starts = [0] + [step for step, *_ in resumes]
    ends = [step for step, *_ in resumes] + [EPOCHS * 128]
    assert 0 < resumes[0][2] < N, "node 0 went on alone mid-epoch"
    for (step, *_), previous in zip(resumes, rounds):
        assert 0 <= max(p[4] for p in previous) + starts[rounds.index(previous)] - step <= EVERY, "lost more than N"
    used = [Counter() for _ in range(EPOCHS)]
    for start_step, end_step, group in zip(starts, ends, rounds):
        for _, _, _, batches, _ in group:
            for offset, batch in enumerate(batches[:end_step - start_step]):
                used[(start_step + offset) // 128].update(batch)
    for epoch, counts in enumerate(used):
        assert sorted(counts) == list(range(N)) and set(counts.values()) == {1}, f"epoch {epoch}"


# train.py: 512 images, 3 epochs, the Trainer's own checkpoints every 3 steps (--save_strategy steps).
TRAINER = ("--max_train_samples", "512", "--max_eval_samples", "64", "--num_train_epochs", "3", "--save_strategy",
           "steps", "--save_steps", "3", "--eval_strategy", "no", "--disable_tqdm", "True")


@pytest.fixture(scope="module")
def trainer_killed(tmp_path_factory, mnist_dir):
    """train.py at 2 ranks of 64 (4 steps an epoch) under torchrun --max_restarts=2, rank 1 killed after step 7,
    mid-epoch 1: its output folder, output, exit code, probes, and the checkpoints complete when the restarted group
    started (torchrun stops the old group before it starts the new one: the checkpoints there are then all there
    are)."""
    folder = tmp_path_factory.mktemp("trainer-killed")
    out_dir, probes = folder / "out", folder / "probe"
    # Rank 1 stopped by the probe after step 7 (rank 0 marked checkpoint-6 complete before step 7's all-reduce).
    job = start(torchrun_cmd("train.py", "--data_dir", mnist_dir, "--output_dir", out_dir, *TRAINER,
                             extra=("--max_restarts=2",)), cwd=folder, env=probe_env(probes, stop_at="1:0:7"))
    os.kill(stopped_worker(job, 1), signal.SIGKILL)
    wait_for(lambda: torchrun_worker(job.pid, local_rank=0, restart=1) or job.poll() is not None, 120,
             "the restarted group")
    complete = [int(p.parent.name.split("-")[1]) for p in out_dir.glob("checkpoint-*/complete")]
    out = finish(job, HANG_GUARD_S)
    return SimpleNamespace(out_dir=out_dir, out=out, returncode=job.returncode, probes=probes, complete=complete)


@pytest.mark.slow
def test_train_py_restarted_by_torchrun_resumes_mid_epoch_from_its_newest_checkpoint_bitwise(tmp_path, mnist_dir,
                                                                                             trainer_killed):
    """The Trainer's own checkpoints every 3 steps, rank 1 killed after step 7, mid-epoch 1 (trainer_killed): the
    restarted group goes on from the newest complete checkpoint (6), skipping the batches of the epoch it had done,
    and ends with the weights of a run that was never killed, to the bit. (A kill while rank 1 saves:
    tests/test_reliability.py, test_a_worker_killed_while_saving_leaves_the_previous_snapshot, and the step
    snapshots above.)"""
    straight = tmp_path / "straight"
    run(torchrun_cmd("train.py", "--data_dir", mnist_dir, "--output_dir", straight, *TRAINER), cwd=tmp_path,
        timeout=HANG_GUARD_S)
    out, out_dir, complete = trainer_killed.out, trainer_killed.out_dir, trainer_killed.complete
    assert trainer_killed.returncode == 0, out
    resumed = re.search(r"resuming from \S*/checkpoint-(\d+)", out)
    assert max(complete) == 6 and resumed and int(resumed[1]) == 6, (complete, out[-2000:])
    # 512 images, 2 ranks of 64: 4 steps an epoch. The restarted group ran what was left after that checkpoint.
    assert json.loads((out_dir / "trainer_state.json").read_text())["global_step"] == 12
    assert summary(out).steps == 12 - max(complete), out[-2000:]
    straight_model, resumed_model = (load_file(d / "model.safetensors") for d in (straight, out_dir))
    assert_bitwise_equal(resumed_model, straight_model, "the killed run's model against the uninterrupted one's")


@pytest.mark.slow
def test_the_trainer_resumes_mid_epoch_at_another_world_size_with_every_sample_once(tmp_path, mnist_dir,
                                                                                     trainer_killed):
    """train.py: checkpoint-3 of the 2-rank run of 64 that trainer_killed's first group wrote (complete: rank 1 was
    killed after step 7), alone in an output folder, resumed at 1 rank of 128 (the same global batch). accelerate
    shards one global order of batches among the ranks, and the Trainer skips the steps the checkpoint counts: every
    image of the interrupted epoch (epoch 0: 3 of its 4 steps done) trained on once, as with step_checkpoints.py.
    (With another global batch it would skip the wrong number of images: the Trainer counts steps, not samples;
    docs/features.md, step checkpoints.)"""
    second, out_dir = tmp_path / "second", tmp_path / "out"
    source = trainer_killed.out_dir / "checkpoint-3"
    assert (source / "complete").exists(), "checkpoint-3 marked complete"
    shutil.copytree(source, out_dir / "checkpoint-3")
    out = run(torchrun_cmd("train.py", "--data_dir", mnist_dir, "--output_dir", out_dir, *TRAINER,
                           "--per_device_train_batch_size", "128", "--resume_from_checkpoint", "last", nproc=1),
              cwd=tmp_path, env=probe_env(second), timeout=300).stdout
    assert "resuming from" in out and "checkpoint-3" in out, out[-2000:]
    used = samples_of_interrupted_epoch(trainer_killed.probes, second, 0, 3 * 128, 128, 2, 1)
    assert sorted(used) == list(range(512)) and set(used.values()) == {1}, "every image of the epoch once"
