"""The examples under Ray Train (pinned in requirements-dev.txt): launch/ray_train.py calls each example's own
main(args) in a TorchTrainer's workers, where Ray Train already started the process group. Every rank takes part
and a second run resumes from the first's snapshot. Ray runs on 127.0.0.1 only, as every test here binds only
loopback, and the test checks that it did: Ray's node and the group's master address.

The training runs join one Ray that `ray start --head` started for this file (RAY_ADDRESS, as on a cluster): a
Ray of its own costs each run about half as much CPU again. The runner's own Ray (--local, the docs' command)
starts in the bad-input test (too many workers: it starts, names its node and stops), whose ray.shutdown() stops
it; the fixture that checks for leftovers finds any of Ray's processes that outlive a run. Never `ray stop`: it
stops every Ray on the machine, other tests' too.
"""
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import BIN, MNIST, REPO, clean_env, epoch_lines, free_port, run, summary

RUNNER = (sys.executable, REPO / "launch" / "ray_train.py")
# "(RayTrainWorker pid=123) Epoch 0 | ...": Ray's prefix (colored) on each line a worker prints.
PREFIX = re.compile(r"^(?:\x1b\[\d+m)?\([^)\n]*\)(?:\x1b\[0m)? ", re.MULTILINE)
WORKER = re.compile(r"^Ray Train worker: rank (\d+) of (\d+) \| master (\S+):(\d+)$", re.MULTILINE)
# script: (first run's arguments, the second's); each run's epochs are 0, 1, then 2, 3. multinode.py is step 3
# (multigpu_torchrun.py) plus its node-local snapshots, and the by_feature scripts parse and run as step 3 does:
# under Ray the same main(args) runs them all. One example, then: a Ray run costs some 35 CPU-s.
SCRIPTS = {
    "multinode.py": (("2", "1"), ("4", "1")),
}


def ray_folder_env():
    # Ray's session folder holds Unix sockets, whose paths may not exceed 107 bytes: a short folder, not tmp_path.
    # HOME too: Ray writes its auth token to ~/.ray and the run's records to ~/ray_results.
    folder = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    return folder, clean_env(OMP_NUM_THREADS=1, RAY_TMPDIR=folder, HOME=folder, RAY_USAGE_STATS_ENABLED=0,
                             RAY_DEDUP_LOGS=0)  # else Ray prints one of the ranks' lines that differ only in numbers


@pytest.fixture
def ray_env():
    folder, env = ray_folder_env()
    yield env
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_cluster():
    """The environment of a runner that joins a Ray head on 127.0.0.1 (Ray swaps 127.0.0.1 for the host's address
    unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0). Its workers take ports the OS picks (worker ports 0), not Ray's
    default 10002-19999, where free_port() picks. SIGTERM to `ray start --block` stops every process it started."""
    folder, env = ray_folder_env()
    port = free_port()
    log = Path(folder) / "head.log"
    with open(log, "w") as out:
        head = subprocess.Popen([BIN / "ray", "start", "--head", "--block", "--node-ip-address=127.0.0.1",
                                 f"--port={port}", "--include-dashboard=false", "--num-cpus=2", "--min-worker-port=0",
                                 "--max-worker-port=0"],
                                env={**env, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                                     "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",  # else SIGTERM waits 30 s
                                     # Else the raylet starts idle workers (one a CPU, more for the first driver)
                                     # that no run uses: each run's actors need workers of its own runtime_env.
                                     "RAY_enable_worker_prestart": "0", "RAY_prestart_worker_first_driver": "0"},
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while "Ray runtime started" not in log.read_text():
        if head.poll() is not None or time.monotonic() > deadline:
            head.kill()
            pytest.fail(f"ray start --head did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    yield {**env, "RAY_ADDRESS": f"127.0.0.1:{port}"}
    head.terminate()
    head.wait(60)
    shutil.rmtree(folder, ignore_errors=True)


def ray_train(script, args, env, cwd, timeout=300):
    """The runner's stdout, each worker line without Ray's prefix; checks that Ray and the group ran on 127.0.0.1
    with both ranks."""
    out = PREFIX.sub("", run([*RUNNER, REPO / script, "--", *args], cwd=cwd, env=env, timeout=timeout).stdout)
    assert re.search(r"^Ray nodes: 127\.0\.0\.1$", out, re.MULTILINE), out[-3000:]
    workers = {(int(rank), int(size), addr) for rank, size, addr, _ in WORKER.findall(out)}
    assert workers == {(0, 2, "127.0.0.1"), (1, 2, "127.0.0.1")}, out[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_an_example_trains_on_both_ranks_and_resumes_under_ray_train(tmp_path, ray_cluster, script):
    snapshot = tmp_path / "snapshot.pt"  # absolute: Ray's workers run in its session folder
    first, second = SCRIPTS[script]
    out = ray_train(script, [*first, "--snapshot_path", snapshot], ray_cluster, tmp_path)
    assert summary(out).world_size == 2 and [line.epoch for line in epoch_lines(out)] == [0, 1], out[-3000:]
    out = ray_train(script, [*second, "--snapshot_path", snapshot], ray_cluster, tmp_path)
    assert f"Resuming from {snapshot}" in out and [line.epoch for line in epoch_lines(out)] == [2, 3], out[-3000:]
    assert summary(out).world_size == 2, out[-3000:]


@pytest.mark.slow
def test_train_py_trains_on_both_ranks_under_ray_train(tmp_path, ray_cluster):
    # One run: a resume under Ray (a new session folder, absolute paths) is multinode.py's above, and train.py's resume
    # on two ranks is Hugging Face's own code once the ranks run (test_clients.py resumes it).
    out_dir = tmp_path / "out"
    common = ("--data_dir", MNIST, "--output_dir", out_dir, "--max_train_samples", "256", "--max_eval_samples",
              "128", "--disable_tqdm", "True")
    out = ray_train("train.py", [*common, "--num_train_epochs", "1"], ray_cluster, tmp_path)
    assert summary(out).world_size == 2 and "weights identical on all 2 ranks" in out, out[-3000:]
    assert json.loads((out_dir / "trainer_state.json").read_text())["global_step"] > 0, out[-3000:]


def last_line_error(result, *fragments):
    assert result.returncode != 0, result.stdout[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(("error: ", "ray_train.py: error: ")), result.stderr[-3000:]
    for fragment in fragments:
        assert fragment in last, last
    return last


@pytest.mark.slow
def test_bad_input_to_the_runner_stops_it_with_one_line(tmp_path, ray_env, ray_cluster):
    result = run([*RUNNER, tmp_path / "nope.py", "--local"], cwd=tmp_path, env=ray_env, check=False, timeout=60)
    last_line_error(result, "nope.py is not a Python file")
    # More workers than this machine's CPUs: Ray would wait for them forever. The Ray it started first (--local)
    # is on 127.0.0.1.
    result = run([*RUNNER, REPO / "multinode.py", "--local", "--num_workers", "1000"], cwd=tmp_path, env=ray_env,
                 check=False, timeout=120)
    last_line_error(result, "--num_workers 1000, but this machine has")
    assert re.search(r"^Ray nodes: 127\.0\.0\.1$", result.stdout, re.MULTILINE), result.stdout[-3000:]  # --local
    # The example stops (sys.exit on every rank, before any collective): the runner says why in one line. On the
    # file's Ray: a Ray of its own would cost half as much CPU again.
    (tmp_path / "bad.pt").write_bytes(b"not a snapshot")
    result = run([*RUNNER, REPO / "multigpu_torchrun.py", "--", "2", "1", "--snapshot_path", tmp_path / "bad.pt"],
                 cwd=tmp_path, env=ray_cluster, check=False, timeout=300)
    # Every rank fails alike; Ray Train stops the others once it sees one fail, so the lowest rank it saw may be 1.
    last = last_line_error(result, f"under Ray Train: cannot read the snapshot {tmp_path / 'bad.pt'}")
    assert re.search(r"multigpu_torchrun\.py failed on rank [01] under", last), last
