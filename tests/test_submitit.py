"""The examples under submitit 1.5.4's SlurmExecutor, on the tests' real SLURM cluster (tests/slurm_cluster.py):
launch/submitit_job.py submits, as a user would, from inside the cluster's network; submitit's sbatch, srun and
pickled function run each task, which calls the example's own main(). Every rank takes part (world size 2, and the
probe's count of collectives on each rank) and a second submission resumes from the first's snapshot.
"""
import json
import re
import subprocess
import sys
import time

import pytest

import conftest
from conftest import (CLIENT_SCRIPTS, MNIST, REPO, assert_bitwise_equal, check_no_abort, collectives_issued,
                      epoch_lines, free_port, load_snapshot, summary)
from slurm_cluster import WHY_NOT, job_env, launched_on
from slurm_cluster import slurm_cluster  # noqa: F401  the fixture `cluster` (its name=), a cluster for this module

pytestmark = [pytest.mark.slow, pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))]
# script: (first submission's arguments, the second's). Step 3 on one node: the by_feature scripts run as it does,
# main(parse_args(argv)) in each task, and step 4 (multinode.py) is step 3 plus node-local snapshots, which train
# and resume on two nodes below.
SCRIPTS = {"multigpu_torchrun.py": CLIENT_SCRIPTS["multigpu_torchrun.py"]}

RUNNER = REPO / "launch" / "submitit_job.py"
# A submission takes 10 to 30 s here: each is bounded by the job's time limit and, a little later, by the test.
MINUTES = 4
TIMEOUT = MINUTES * 60 + 60


def runner_argv(folder, nodes, tasks, script, *args):
    timeout = ("--ddp_timeout",) if script == "train.py" else ("--timeout",)
    return [sys.executable, RUNNER, "--nodes", nodes, "--tasks_per_node", tasks, "--minutes", MINUTES,
            "--folder", folder / "logs", REPO / script, *args, *timeout, "120"]


def runner_env(**extra):
    # Tagged like conftest.start's launches (sbatch passes the environment on to the tasks): no task may outlive
    # its test.
    return {**job_env(**extra), conftest.TOKEN_VARIABLE: conftest._current_token}


def job_logs(folder, job_id):
    """Every task's stdout and stderr (submitit's <job>_<task>_log.out/.err), one text."""
    paths = sorted((folder / "logs").glob(f"{job_id}_*_log.*"))
    return "\n".join(f"--- {path.name}\n{path.read_text()}" for path in paths)


def finished(folder, process_or_result, output):
    """The job id and its tasks' logs, after the runner exited 0."""
    job_id = re.search(r"^Submitted job (\d+)", output, re.M)
    assert job_id, output[-3000:]
    logs = job_logs(folder, job_id[1])
    check_no_abort(logs, f"job {job_id[1]}")
    assert process_or_result.returncode == 0, f"{output[-3000:]}\n{logs[-6000:]}"
    return job_id[1], logs


def submit(cluster, folder, nodes, tasks, script, *args, env=None):
    try:
        result = cluster.run(runner_argv(folder, nodes, tasks, script, *args), cwd=folder, env=env or runner_env(),
                             timeout=TIMEOUT, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail(f"submitit_job.py still running after {TIMEOUT}s\n{job_logs(folder, '*')[-6000:]}")
    return finished(folder, result, result.stdout + result.stderr)


def assert_every_rank_trained(logs, epochs):
    assert summary(logs).world_size == 2 and [line.epoch for line in epoch_lines(logs)] == epochs, logs[-4000:]
    # Only rank 0 logs the epochs; the probe's count shows that both ranks took part in every step.
    issued = collectives_issued(logs)
    assert issued.keys() == {0, 1} and issued[0] == issued[1] > 0, logs[-4000:]



@pytest.mark.parametrize("script", SCRIPTS)
def test_one_node_two_tasks_train_on_both_ranks_and_a_resubmission_resumes(cluster, tmp_path, script):
    first, second = SCRIPTS[script]
    snapshot = tmp_path / "snapshot.pt"
    _, logs = submit(cluster, tmp_path, 1, 2, script, *first, "--snapshot_path", snapshot)
    assert_every_rank_trained(logs, [0, 1])
    # MASTER_PORT set where the user submits: sbatch passes it on, and export(overwrite=True) takes it.
    _, logs = submit(cluster, tmp_path, 1, 2, script, *second, "--snapshot_path", snapshot,
                     env=runner_env(MASTER_PORT=free_port()))
    assert f"Resuming from {snapshot} at epoch 2" in logs, logs[-4000:]
    assert_every_rank_trained(logs, [2, 3])


def test_train_py_trains_on_both_ranks(cluster, tmp_path):
    # One submission: train.py makes its own group in each task, as under torchrun, and its resume on two ranks is
    # Hugging Face's own code once the ranks run (test_clients.py resumes it); a resubmission under
    # submitit is step 3's and step 4's above.
    out_dir = tmp_path / "out"
    common = ("--data_dir", MNIST, "--output_dir", out_dir, "--max_train_samples", "256", "--max_eval_samples", "128",
              "--disable_tqdm", "True")
    _, logs = submit(cluster, tmp_path, 1, 2, "train.py", *common, "--num_train_epochs", "1")
    assert summary(logs).world_size == 2 and "weights identical on all 2 ranks" in logs, logs[-4000:]
    assert json.loads((out_dir / "trainer_state.json").read_text())["global_step"] > 0, logs[-4000:]


def test_two_nodes_share_one_snapshot_path_train_and_a_resubmission_resumes(cluster, tmp_path):
    # One path for both nodes, as on NFS: multinode.py's local rank 0 of each node (ranks 0 and 1 here) saves to it.
    snapshot = tmp_path / "shared" / "multinode.pt"
    replicas = tmp_path / "replicas"  # each rank's model and optimizer at its end (tests/support/sitecustomize.py)
    replicas.mkdir()
    argv = runner_argv(tmp_path, 2, 1, "multinode.py", "6", "1", "--snapshot_path", snapshot)
    with open(tmp_path / "runner.out", "w+") as out:
        process = cluster.popen(argv, cwd=tmp_path, env=runner_env(DDP_EXAMPLES_PROBE_REPLICAS=replicas), stdout=out,
                                stderr=subprocess.STDOUT)
        # While both nodes save, every read of the snapshot finds a whole one, never half a file.
        seen, deadline = set(), time.monotonic() + TIMEOUT
        while process.poll() is None and time.monotonic() < deadline:
            if snapshot.exists():
                seen.add(load_snapshot(snapshot)["epochs_run"])
            time.sleep(0.02)
        if process.poll() is None:
            process.kill()
            process.wait()
            pytest.fail(f"submitit_job.py still running after {TIMEOUT}s\n{job_logs(tmp_path, '*')[-6000:]}")
        out.seek(0)
        job_id, logs = finished(tmp_path, process, out.read())
    assert launched_on(cluster, job_id) == ["node1", "node2"], "a task on each of two nodes"
    assert "node=0(2), global_rank=0(2)" in logs and "node=1(2), global_rank=1(2)" in logs, logs[-4000:]
    assert_every_rank_trained(logs, list(range(6)))
    assert len(seen) >= 2, f"the snapshot was read while training at {seen} epochs only"
    assert "error:" not in logs and "another run" not in logs, logs[-4000:]
    state = load_snapshot(snapshot)
    assert state["epochs_run"] == 6 and state["world_size"] == 2
    for rank in (0, 1):  # whichever node's save came last, the snapshot is what every rank trained
        replica = load_snapshot(replicas / f"rank{rank}.pt")
        assert_bitwise_equal(state["model"], replica["model"], f"rank {rank}'s model")
        assert_bitwise_equal(state["optimizer"], replica["optimizer"], f"rank {rank}'s optimizer")
    assert [path.name for path in snapshot.parent.iterdir()] == ["multinode.pt"], "no temporary left"

    _, logs = submit(cluster, tmp_path, 2, 1, "multinode.py", "8", "1", "--snapshot_path", snapshot)
    assert f"Resuming from {snapshot} at epoch 6" in logs, logs[-4000:]
    assert_every_rank_trained(logs, [6, 7])
    assert "another run" not in logs and "training runs" not in logs
    assert load_snapshot(snapshot)["epochs_run"] == 8


def test_a_rank_that_stops_fails_the_job_in_one_line(cluster, tmp_path):
    # Rank 0 alone checks the snapshot's folder: rank 1 waits for it in init_process_group, and is ended by srun
    # (--kill-on-bad-exit), where it leaves no result; the runner says why, without sacct (the cluster keeps no
    # accounting), well before the examples' --timeout.
    start = time.monotonic()
    result = cluster.run(runner_argv(tmp_path, 2, 1, "multinode.py", "2", "1", "--snapshot_path", "/proc/none/x.pt"),
                         cwd=tmp_path, env=runner_env(), timeout=TIMEOUT, check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 1 and len(errors) == 1, result.stdout + result.stderr[-3000:]
    assert "failed: RuntimeError: error: cannot write the snapshot /proc/none/x.pt" in errors[0], errors[0]
    assert time.monotonic() - start < 100, "not the examples' --timeout of 120 s"
