"""The quick subset's core: every script launched once under its launcher, at a small size, learns (its loss falls)
or checks its collectives, and exits cleanly. `python -m pytest -m quick tests` runs this file and the one-line
error tests marked quick elsewhere; CI also runs it with the CUDA build of torch on a machine without a GPU.
"""
import json

import pytest

from conftest import (MNIST, epoch_lines, mpi_env, mpirun_cmd, python_cmd, run, summary, torchrun_cmd)

pytestmark = pytest.mark.quick

SMALL = ("--input_size", "20", "--epochs", "3")
# name: (launcher, script, arguments). Every one trains three epochs (or checks the collectives) in seconds.
LAUNCHES = {
    "singlegpu.py": (python_cmd, "singlegpu.py", ("3", "1")),
    "multigpu.py": (python_cmd, "multigpu.py", ("3", "1", "--world_size", "2")),
    "multigpu_torchrun.py": (torchrun_cmd, "multigpu_torchrun.py", ("3", "1")),
    "multinode.py": (torchrun_cmd, "multinode.py", ("3", "1")),
    "fsdp.py": (torchrun_cmd, "fsdp.py", ("3", "1", "--batch_size", "256")),
    "torchrun_ddp.py": (torchrun_cmd, "torchrun_ddp.py", SMALL),
    "gradient_accumulation.py": (torchrun_cmd, "by_feature/gradient_accumulation.py", SMALL),
    "mixed_precision.py": (torchrun_cmd, "by_feature/mixed_precision.py", SMALL),
    "exact_evaluation.py": (torchrun_cmd, "by_feature/exact_evaluation.py", SMALL),
    "uneven_inputs.py": (torchrun_cmd, "by_feature/uneven_inputs.py", SMALL),
    "comm_hooks.py": (torchrun_cmd, "by_feature/comm_hooks.py", (*SMALL, "--comm_hook", "powersgd")),
    "zero_optimizer.py": (torchrun_cmd, "by_feature/zero_optimizer.py", SMALL),
    "powersgd_with_zero.py": (torchrun_cmd, "by_feature/powersgd_with_zero.py", (*SMALL, "--comm_hook", "powersgd")),
    "ddp.py": (python_cmd, "ddp.py", (*SMALL, "--world_size", "2", "--batch_size", "256")),
    "run_with_mpirun.py --train": (mpirun_cmd, "run_with_mpirun.py", ("--train", "3", "1")),
}
COLLECTIVES = {
    "run_with_torchrun.py": torchrun_cmd("run_with_torchrun.py"),
    "run_with_python.py": python_cmd("run_with_python.py", "--world_size", "2"),
    "run_with_mpirun.py": mpirun_cmd("run_with_mpirun.py"),
}


def env_for(command):
    return mpi_env() if command is mpirun_cmd else None


@pytest.mark.parametrize("name", LAUNCHES)
def test_every_training_script_learns_under_its_launcher(tmp_path, name):
    command, script, args = LAUNCHES[name]
    out = run(command(script, *args), cwd=tmp_path, env=env_for(command), timeout=180).stdout
    lines = epoch_lines(out, "DDP" if script == "ddp.py" else None)
    assert len(lines) == 3 and lines[-1].loss < lines[0].loss, out[-3000:]
    assert summary(out).backend in ("gloo", "nccl", "none"), out[-3000:]


@pytest.mark.parametrize("name", COLLECTIVES)
def test_every_launcher_checks_its_collectives(tmp_path, name):
    command = COLLECTIVES[name]
    out = run(command, cwd=tmp_path, env=mpi_env() if "mpirun" in str(command[0]) else None, timeout=120).stdout
    assert "Collectives on 2 rank(s), as rank 0 saw them" in out and "| NO on rank" not in out, out[-3000:]


def test_train_py_learns_on_the_shipped_data(tmp_path):
    run(torchrun_cmd("train.py", "--data_dir", MNIST, "--output_dir", tmp_path / "out", "--max_train_samples", "512",
                     "--max_eval_samples", "256", "--num_train_epochs", "2", "--disable_tqdm", "True"),
        cwd=tmp_path, timeout=300)
    history = json.loads((tmp_path / "out" / "trainer_state.json").read_text())["log_history"]
    accuracy = [entry["eval_accuracy"] for entry in history if "eval_accuracy" in entry]
    assert len(accuracy) == 2 and accuracy[-1] > 0.5, history  # chance is 0.1
