"""What a new user runs into, under the real launchers: snapshot paths that cannot be written (found before the
first step, in one line, by every script that writes), mpirun from a venv that is not activated, a
node whose peers never come. (The tutorial's steps in one folder: test_tutorial.py, on its shared runs.)
"""
import json
import os
import re
import shlex
import shutil
import subprocess
import time

import pytest

from conftest import (BIN, MNIST, REPO, assert_one_line_error, clean_env, epoch_lines, free_port, mpi_env, python_cmd,
                      run, torchrun_cmd)

# Every script that writes a snapshot, checkpoints or an output directory, with the flag that says where, under
# the launcher it is made for.
WRITERS = {
    "singlegpu.py": (python_cmd, "--snapshot_path"),
    "multigpu.py": (python_cmd, "--snapshot_path"),
    "multigpu_torchrun.py": (torchrun_cmd, "--snapshot_path"),
    "multinode.py": (torchrun_cmd, "--snapshot_path"),
    "fsdp.py": (torchrun_cmd, "--snapshot_path"),
    "torchrun_ddp.py": (torchrun_cmd, "--snapshot_path"),
    "by_feature/comm_hooks.py": (torchrun_cmd, "--snapshot_path"),
    "train.py": (torchrun_cmd, "--output_dir"),
    "ddp.py": (python_cmd, "--weights_dir"),
}
EXTRA = {"train.py": ("--data_dir", str(MNIST), "--max_steps", "2"), "ddp.py": ("--world_size", "2")}


def launch(script, place, cwd, **kwargs):
    command, flag = WRITERS[script]
    return run(command(script, "--total_epochs" if script != "train.py" else "--num_train_epochs", "2", flag, place,
                       *EXTRA.get(script, ())), cwd=cwd, check=False, timeout=120, **kwargs)


def assert_refused_before_training(result, place, reasons):
    """One line naming the place and the system's reason (one of `reasons`), said by the one process that writes,
    before the process group exists: no other rank waits for it, no epoch trains."""
    line = assert_one_line_error(result, place, code=1)
    assert any(reason in line for reason in reasons), line
    assert result.stderr.count(line) == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr.split(line)[0]
    assert not epoch_lines(result.stdout) and "'loss'" not in result.stdout, result.stdout[-2000:]


# Every writer is refused once in the developer loop: these four at /proc (the quick subset), the others at a file
# where a directory should be. Both are the same check's errors (one text in every script: test_copies.py), and
# the read-only mount below tries every writer again.
PROC = ["singlegpu.py", "multigpu_torchrun.py", "fsdp.py", "train.py"]


@pytest.mark.parametrize("script", [s for s in WRITERS if s not in PROC])
def test_a_file_where_a_directory_should_be_is_found_before_training(tmp_path, script):
    (tmp_path / "README.md").write_text("a file, not a directory")
    result = launch(script, "README.md/out", tmp_path)
    assert_refused_before_training(result, "README.md/out", ("Not a directory", "File exists"))


@pytest.mark.quick
@pytest.mark.parametrize("script", PROC)
def test_proc_is_found_before_training(tmp_path, script):
    result = launch(script, "/proc/out", tmp_path)
    assert_refused_before_training(result, "/proc/out", ("No such file or directory",))


@pytest.mark.slow
def test_a_read_only_mount_is_found_before_training(tmp_path):
    """A read-only filesystem, mounted in a mount namespace of the test's own (the host's mounts stay as they
    were): every writer stops at once, naming it. One namespace, all scripts, so it costs one mount; each script's
    command line in a child forked from one process there that imported torch and train.py's modules once
    (tests/support/forked_runs.py). The torchrun scripts run as rank 0 of 2 alone, in the environment torchrun gives
    it: the check is rank 0's, before the process group (one that waited for the group would wait for rank 1 until
    the launch's timeout), and the tests above refuse each of them under torchrun itself (2 ranks and the agent:
    7 CPU-s a script more)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("mount namespaces need root and unshare (util-linux)")
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    cases = [[script, ["--total_epochs" if script != "train.py" else "--num_train_epochs", "2", flag,
                       str(read_only / "out"), *EXTRA.get(script, ())], 2 if command is torchrun_cmd else None]
             for script, (command, flag) in WRITERS.items()]
    forked = shlex.join(map(str, python_cmd(REPO / "tests" / "support" / "forked_runs.py", json.dumps(cases), "train")))
    done = run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                f"mount -t tmpfs -o ro tmpfs '{read_only}' && {forked}"], cwd=tmp_path, timeout=600)
    said = json.loads(done.stdout.splitlines()[-1])
    assert len(said) == len(WRITERS), done.stdout[-3000:]
    for script, result in zip(WRITERS, said):
        assert_refused_before_training(subprocess.CompletedProcess(script, *result), str(read_only / "out"),
                                       ("Read-only file system",))


def test_mpirun_from_a_venv_that_is_not_activated(tmp_path):
    """The docs' form names the venv's mpirun and python: it works with a PATH that has neither (no activate)."""
    env = mpi_env()
    env["PATH"] = "/usr/bin:/bin"
    env.pop("VIRTUAL_ENV", None)
    python = BIN / "python"
    result = run([BIN / "mpirun", "-np", "2", "--oversubscribe", python, REPO / "run_with_mpirun.py"], cwd=tmp_path,
                 env=env, timeout=120)
    assert "Collectives on 2 rank(s)" in result.stdout


def test_a_node_whose_peers_never_come_says_it_is_waiting_and_ends_at_the_join_timeout(tmp_path):
    """The docs' multi-node command sets --rdzv_conf=join_timeout=...; with LOGLEVEL=INFO torchrun says that it is
    waiting for the others. Here node 0 alone, a 5 s join timeout."""
    began = time.monotonic()
    result = run([BIN / "torchrun", "--nnodes=2", "--nproc_per_node=1", "--rdzv_id=alone", "--rdzv_backend=c10d",
                  f"--rdzv_endpoint=127.0.0.1:{free_port()}", "--rdzv_conf=join_timeout=5", REPO / "multinode.py",
                  "2", "1"], cwd=tmp_path, env=clean_env(LOGLEVEL="INFO"), check=False, timeout=90)
    assert result.returncode != 0 and time.monotonic() - began < 60
    assert re.search(r"Rendezvous'ing worker group", result.stderr), result.stderr[-3000:]
    assert "RendezvousTimeoutError" in result.stderr
    assert not (tmp_path / "multinode.pt").exists()
