"""slurm/*.sbatch submitted with the real sbatch to a real SLURM cluster: three nodes (three slurmds) on
127.0.0.1, brought up by tests/slurm_cluster.py and torn down after the module; the jobs take two.

The jobs are submitted as a user of a CPU cluster would: from a checkout of the repository, with
sbatch options that override the files' GPU and CPU requests (#SBATCH lines give way to the command
line) and the files' own environment knobs (EPOCHS, NPROC_PER_NODE, ...).
"""
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path
from subprocess import PIPE

import pytest

from conftest import (BIN, REPO, assert_bitwise_equal, check_no_abort, clean_env, collectives_issued,
                      epoch_lines, load_snapshot, process_state, run, summary, torchrun_cmd)
from slurm_cluster import NODES, WHY_NOT, job_env, launched_on, site_libmpi
from slurm_cluster import slurm_cluster  # noqa: F401  the fixture `cluster` (its name=), a cluster for this module

pytestmark = [pytest.mark.slow, pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))]

# Each job is bounded twice: Slurm ends it after JOB_MINUTES, the test stops waiting a little later.
JOB_MINUTES = 5
SBATCH_TIMEOUT = JOB_MINUTES * 60 + 60
# The nodes have no GPUs and os.cpu_count() CPUs each; the files ask for GPUs and more CPUs.
ON_CPUS = ("--gpus-per-node=0", f"--time={JOB_MINUTES}")
# 2 nodes x 1 rank, 32 steps an epoch: a few seconds of training. Two ranks, because then a resumed run
# ends bitwise equal to an uninterrupted one: the sum of two gradients is the same in either order. With
# more, gloo's summation order follows DDP's bucket layout, which a fresh process lays out anew (4 ranks
# resumed after epoch 1 or 2 end equal only to float rounding).
MULTINODE = {"NPROC_PER_NODE": "1", "EPOCHS": "4", "SAVE_EVERY": "1", "BATCH_SIZE": "32"}
STEPS_PER_EPOCH = 32
EPOCHS = int(MULTINODE["EPOCHS"])
# Where both ranks of the job whose node dies stop themselves (the probe's DDP_EXAMPLES_PROBE_STOP_AT): mid-way
# through epoch 1, after the first snapshot (epoch 0) and before the second. Waiting from outside for the first
# snapshot raced the job, which trains an epoch in a fraction of a second and could finish before the node died.
STOP_STEP = STEPS_PER_EPOCH + STEPS_PER_EPOCH // 2


def checkout(directory):
    """A user's copy of the repository to submit from (sbatch files unchanged; no tests, no snapshots). The jobs
    run the suite's own Python; the README's .venv in the clone (2 GB) stays out of the copy."""
    shutil.copytree(REPO, directory, ignore=shutil.ignore_patterns(
        ".git", ".venv", "tests", "__pycache__", ".pytest_cache", "snapshots", "*.pt", "*.out", "results"))
    return directory


def sbatch(cluster, submit_dir, script, *options, env, timeout=SBATCH_TIMEOUT):
    """sbatch --wait of a file of slurm/, from submit_dir; returns (job id, the job's output)."""
    result = cluster.run(["sbatch", "--wait", *ON_CPUS, *options, f"slurm/{script}"], cwd=submit_dir, env=env,
                         timeout=timeout, check=False)
    job_id = re.search(r"Submitted batch job (\d+)", result.stdout)
    assert job_id, result.stdout + result.stderr
    output = job_output(submit_dir, job_id[1])
    check_no_abort(output, f"job {job_id[1]}")
    assert result.returncode == 0, f"job {job_id[1]} exited {result.returncode}\n{result.stderr}\n{output[-6000:]}"
    # sbatch --wait exits 0, with this message, when it missed the finished job before Slurm forgot it.
    assert "no longer found" not in result.stderr, result.stderr
    return job_id[1], output


def job_output(submit_dir, job_id):
    """The files' --output=%x-%j.out, in the submit directory."""
    (path,) = submit_dir.glob(f"*-{job_id}.out")
    return path.read_text()


def allocated(output):
    """The nodes the job ran on, from the line the sbatch files print first."""
    return re.search(r"^nodes: (\S+) \|", output, re.M)[1]


@pytest.fixture(scope="module")
def uninterrupted(cluster, tmp_path_factory):
    """multinode.sbatch run to the end: its submit directory, job id, output and final snapshot."""
    submit_dir = checkout(tmp_path_factory.mktemp("multinode") / "repo")
    job_id, output = sbatch(cluster, submit_dir, "multinode.sbatch", "--cpus-per-task=1", env=job_env(**MULTINODE))
    return submit_dir, job_id, output, load_snapshot(multinode_snapshot(submit_dir))


def multinode_snapshot(submit_dir):
    return submit_dir / "snapshots" / "multinode-ddp-multinode.pt"


def test_multinode_sbatch_trains_on_both_nodes(cluster, uninterrupted):
    # The same file run again resumes from the snapshot: the requeued job of the dead node's test below.
    submit_dir, job_id, output, _ = uninterrupted
    assert allocated(output) == "node[1-2]" and "| rendezvous: 127.0.0.1:" in output, output
    assert launched_on(cluster, job_id) == ["node1", "node2"], "one torchrun per node"
    trained = summary(output)
    assert (trained.epochs, trained.world_size, trained.backend) == (EPOCHS, 2, "gloo"), output[-3000:]
    assert [line.epoch for line in epoch_lines(output)] == list(range(EPOCHS)), output[-3000:]
    # Only rank 0 logs; the probe's count shows that both ranks took part in every step.
    issued = collectives_issued(output)
    assert issued.keys() == {0, 1} and issued[0] == issued[1] >= trained.steps, output[-3000:]
    assert load_snapshot(multinode_snapshot(submit_dir))["epochs_run"] == EPOCHS


def test_mpirun_sbatch_under_srun_pmix_equals_torchrun_bitwise(cluster, tmp_path):
    submit_dir = checkout(tmp_path / "repo")
    training = {"EPOCHS": "2", "SAVE_EVERY": "1", "BATCH_SIZE": "64", "OMP_NUM_THREADS": "1"}
    env = job_env(
        **training,
        # The cluster's MPI, as on a site: Debian's Open MPI, built with the PMIx that Slurm serves, loaded
        # by mpi4py's binary wheel in place of the PyPI Open MPI (which fails under srun --mpi=pmix of
        # Slurm 22.05: every message between ranks ends in MPI_ERR_INTERN).
        MPI4PY_LIBMPI=site_libmpi(),
        # Two "nodes" on one host: Open MPI's shared memory would name both nodes' segments alike, and its
        # TCP transport skips loopback unless told.
        OMPI_MCA_btl="self,tcp", OMPI_MCA_btl_tcp_if_include="lo")
    job_id, mpi_out = sbatch(cluster, submit_dir, "mpirun_train.sbatch", "--cpus-per-task=1", env=env)
    assert "| ranks: 4 | master: 127.0.0.1 (node" in mpi_out, mpi_out
    assert len(launched_on(cluster, job_id)) == 2
    # Ranks 0, 1 on node1 and 2, 3 on node2: local ranks from MPI itself.
    for rank, local_rank in ((0, 0), (1, 1), (2, 0), (3, 1)):
        assert f"Process {rank}: rank from MPI.COMM_WORLD.Get_rank(), local rank {local_rank} from" in mpi_out

    torchrun_out = run(torchrun_cmd("multigpu_torchrun.py", "--total_epochs", "2", "--save_every", "1",
                                    "--batch_size", "64", "--snapshot_path", tmp_path / "torchrun.pt", nproc=4),
                       cwd=tmp_path, env=clean_env(OMP_NUM_THREADS=1), timeout=180).stdout
    mpi_summary, torchrun_summary = summary(mpi_out), summary(torchrun_out)
    assert (mpi_summary.world_size, mpi_summary.backend) == (4, "gloo")
    for field in ("epochs", "steps", "loss", "world_size", "backend"):
        assert getattr(mpi_summary, field) == getattr(torchrun_summary, field), field
    assert epoch_lines(mpi_out) == epoch_lines(torchrun_out)
    mpi_state = load_snapshot(submit_dir / "snapshots" / "mpirun-ddp-mpirun.pt")
    torchrun_state = load_snapshot(tmp_path / "torchrun.pt")
    assert mpi_state["epochs_run"] == torchrun_state["epochs_run"] == 2
    for key in ("model", "optimizer"):
        assert_bitwise_equal(mpi_state[key], torchrun_state[key], key)


def test_a_dead_node_ends_the_job_within_the_timeout_and_the_requeued_job_resumes_bitwise(cluster, uninterrupted,
                                                                                          tmp_path):
    timeout = 30
    submit_dir = checkout(tmp_path / "repo")
    snapshot = multinode_snapshot(submit_dir)
    probes = tmp_path / "probe"
    probes.mkdir()
    # Both ranks stop after STOP_STEP: which node's torchrun gets which rank follows the order of their pids.
    # Each stop happens once in the job (a marker file in the probe's folder): the requeued job trains through.
    env = cluster.env(job_env(**MULTINODE, TIMEOUT=timeout, DDP_EXAMPLES_PROBE_SAMPLES=probes,
                              DDP_EXAMPLES_PROBE_STOP_AT=f"0:0:{STOP_STEP},1:0:{STOP_STEP}"))
    waiter = cluster.popen(["sbatch", "--wait", *ON_CPUS, "--cpus-per-task=1", "slurm/multinode.sbatch"],
                           cwd=submit_dir, env=env, stdout=PIPE, stderr=PIPE, text=True)
    try:
        cluster.wait_for(lambda: len(training_nodes(cluster)) == 2 or waiter.poll() is not None, 180,
                         "training on two nodes")
        first, second = training_nodes(cluster)
        cluster.wait_for(lambda: all(stopped(training_processes(cluster, node)) for node in (first, second))
                         or waiter.poll() is not None, 180, f"both ranks to stop after step {STOP_STEP}")
        assert waiter.poll() is None, "the job ended before a node could die"
        assert load_snapshot(snapshot)["epochs_run"] == 1
        survivors = training_processes(cluster, first)
        cluster.kill_node(second)
        died = time.monotonic()
        for pid in survivors:  # the rank on the node still alive trains on, into its dead peer
            os.kill(pid, signal.SIGCONT)
        (job_id,) = cluster.run(["squeue", "--noheader", "--format=%i"], cwd=submit_dir, env=env,
                                timeout=30).stdout.split()
        cluster.wait_for(lambda: not any(map(alive, survivors)), timeout + 30, f"end of {first}'s workers")
        workers_gone = time.monotonic() - died
        cluster.wait_for(lambda: job_state(cluster, job_id) == ("PENDING", "1"), timeout + 60, "the job requeued")
        requeued = time.monotonic() - died
        print(f"{second} killed: {first}'s workers gone after {workers_gone:.1f}s, job requeued after {requeued:.1f}s")
        assert workers_gone < timeout and requeued < timeout
        assert not any(map(alive, survivors))
        at_death = load_snapshot(snapshot)
        epochs_at_death = at_death["epochs_run"]
        assert epochs_at_death == 1, "the surviving rank cannot end epoch 1 without its peer"

        # Slurm holds a requeued batch job back for two minutes; the spare node is ready now.
        cluster.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], cwd=submit_dir, env=env, timeout=30)
        out, err = waiter.communicate(timeout=SBATCH_TIMEOUT)
    finally:
        if waiter.poll() is None:
            waiter.kill()
            waiter.communicate()
    output = job_output(submit_dir, job_id)
    assert waiter.returncode == 0, f"{err}\n{output[-6000:]}"
    (spare,) = set(NODES) - {first, second}
    assert spare in launched_on(cluster, job_id), "the requeued job runs on the nodes still alive"
    resumed = re.findall(rf"^Resuming from {re.escape(str(snapshot))} at epoch (\d+)", output, re.M)
    assert resumed and int(resumed[-1]) == epochs_at_death, output[-4000:]
    # The requeued run's own lines (the file prints "nodes: " first in each run; a requeued job's output may keep
    # the first run's): only the missing epochs.
    requeued_run = re.split(r"^nodes: ", output, flags=re.M)[-1]
    assert [line.epoch for line in epoch_lines(requeued_run)] == list(range(epochs_at_death, EPOCHS)), output[-4000:]
    state, reference = load_snapshot(snapshot), uninterrupted[3]
    assert not all(state["model"][k].equal(at_death["model"][k]) for k in at_death["model"]), "it trained on"
    for key in ("epochs_run", "model", "optimizer"):
        assert_bitwise_equal(state[key], reference[key], key)


def job_state(cluster, job_id):
    job = cluster.job(job_id)
    return job["JobState"], job["Restarts"]


def training_nodes(cluster):
    return [node for node in NODES if training_processes(cluster, node)]


def training_processes(cluster, node):
    """multinode.py's workers on a node (torchrun's agent names the script too, but is not one)."""
    return [pid for pid in cluster.processes(node)
            if b"multinode.py" in cmdline(pid) and b"torchrun" not in cmdline(pid)]


def cmdline(pid):
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def alive(pid):
    """Running, not a zombie waiting for its parent to reap it."""
    return process_state(pid) not in (None, "Z")


def stopped(pids):
    """Whether there are processes and each has stopped itself (DDP_EXAMPLES_PROBE_STOP_AT)."""
    return bool(pids) and all(process_state(pid) == "T" for pid in pids)


def test_diagnose_under_srun_names_a_stalled_rank_and_its_line(cluster, tmp_path):
    """torchdiagnose in front of srun: the user's own script (tests/test_diagnose.py's), one task on each of
    two nodes; rank 1 stalls, and the one line names it, its line and the collective the other waits in."""
    from test_diagnose import TIMEOUT, line_of, user_script
    script = user_script(tmp_path)
    env = job_env(FAULT="stall", MASTER_ADDR="127.0.0.1", MASTER_PORT="29555")
    # The tool as installed (requirements-dev.txt), from the test's folder (its dumps go there).
    result = cluster.run([BIN / "torchdiagnose", "--timeout", TIMEOUT, "srun", "--time=3", "-N", "2",
                          "--ntasks-per-node=1", "--cpus-per-task=1", sys.executable, script],
                         cwd=tmp_path, env=env, timeout=180, check=False)
    output = result.stdout + result.stderr
    found = [line for line in output.splitlines() if line.startswith("diagnose: ")]
    assert result.returncode != 0 and len(found) == 1, output[-4000:]
    assert f"at {line_of('the backward line')}) waited more than --timeout {TIMEOUT}s" in found[0], found[0]
    assert f"rank 1 did not arrive: it is alive, in its own code at {line_of('the stall')}" in found[0], found[0]
