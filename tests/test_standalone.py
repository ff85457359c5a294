"""Every example stands alone: copied into an empty folder with the one shared module it imports (and the MNIST
files for train.py, a .env for ddp.py), it runs its documented command there, with nothing of this repository
importable. Each example's imports are also read from its source: torch, the standard library, the package its
lesson is about, and at most models_and_data.py (fsdp.py: and its checkpoint sibling).

The copies' launches are the quick subset's core (`python -m pytest -m quick tests`): every script once under its
launcher, at a small size, learns (its loss falls) or checks its collectives, and exits cleanly.
"""
import ast
import hashlib
import json
import re
import shutil
import sys
import time

import pytest

from conftest import (BIN, MNIST, REPO, check_no_abort, clean_env, epoch_lines, finish, free_port, listening, mpi_env,
                      run, start, summary)

# Top-level packages an example may import besides torch and the standard library, per example.
LESSON_PACKAGES = {
    "train.py": {"transformers", "datasets", "numpy", "mpi4py"},
    "run_with_mpirun.py": {"mpi4py"},
    "ddp.py": {"dotenv"},
    "fault_tolerant.py": {"torchft"},
    "diloco.py": {"torchft"},
}
# fsdp.py's checkpoint protocol serves the steps after it too (tensor, pipeline and N-D parallelism), whose model
# is the decoder of language_model.py; step 8 adds the attention of context parallelism and the experts' dispatch.
SIBLINGS = {"fsdp.py": {"models_and_data", "fsdp_checkpoint"},
            **{name: {"language_model", "fsdp_checkpoint"} for name in ("tensor_parallel.py", "pipeline_parallel.py",
                                                                       "hf_checkpoint.py")},
            "nd_parallel.py": {"language_model", "fsdp_checkpoint", "context_parallel", "expert_parallel"},
            "plan.py": {"language_model", "nd_parallel"}}  # the planner traces what step 8 builds, by its functions
# diagnose is an installed tool (pip install ./diagnose; requirements-dev.txt), importable anywhere by design.
REPOSITORY_PACKAGES = ("benchmarks", "models_and_data", "fsdp_checkpoint", "language_model", "context_parallel",
                       "expert_parallel")


def examples():
    top = sorted(p.name for p in REPO.glob("*.py") if p.stem not in REPOSITORY_PACKAGES)
    return top + sorted(f"by_feature/{p.name}" for p in (REPO / "by_feature").glob("*.py"))


def imported_modules(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: relative import"
            yield node.module.split(".")[0]


@pytest.mark.parametrize("name", examples())
def test_an_example_imports_only_torch_the_standard_library_its_lesson_and_one_module(name):
    allowed = {"torch"} | LESSON_PACKAGES.get(name, set())
    if "/" not in name:  # by_feature/ examples hold their few lines of model and data themselves
        allowed |= SIBLINGS.get(name, {"models_and_data"})
    foreign = {m for m in imported_modules(REPO / name) if m not in sys.stdlib_module_names and m not in allowed}
    assert not foreign, f"{name} imports {sorted(foreign)}"
    source = (REPO / name).read_text()
    assert "sys.path" not in source, f"{name} edits sys.path"


# language_model.py: the decoder, and its mixture-of-experts option (about 90 lines).
@pytest.mark.parametrize("name, lines", [("models_and_data.py", 160), ("language_model.py", 300),
                                         ("context_parallel.py", 175), ("expert_parallel.py", 100)])
def test_the_shared_modules_are_small_and_import_only_torch(name, lines):
    path = REPO / name
    assert len(path.read_text().splitlines()) <= lines
    assert {m for m in imported_modules(path) if m not in sys.stdlib_module_names} == {"torch"}


SMALL = ("--input_size", "20", "--epochs", "3")
# Steps 6 to 8: a small decoder on the first 6,000 characters of the default text (data/shakespeare).
LM = ("--dim", "32", "--n_layers", "2", "--hidden", "64", "--seq_len", "32", "--global_batch_size", "16",
      "--total_epochs", "3", "--data", "text.txt", "--log_every", "0", "--sample", "40")
TORCHRUN = (BIN / "torchrun", "--standalone", "--nproc_per_node=2")
# script: (launcher argv before the script, arguments). The commands of the scripts' docstrings, at a small size.
COMMANDS = {
    "singlegpu.py": ((sys.executable,), ("3", "1")),
    "multigpu.py": ((sys.executable,), ("3", "1", "--world_size", "2")),
    "multigpu_torchrun.py": (TORCHRUN, ("3", "1")),
    "multinode.py": (TORCHRUN, ("3", "1")),
    "fsdp.py": (TORCHRUN, ("3", "1", "--batch_size", "256")),
    "tensor_parallel.py": (TORCHRUN, LM),
    "pipeline_parallel.py": (TORCHRUN, LM),
    "nd_parallel.py": (TORCHRUN, ("--tp", "2", *LM)),
    "torchrun_ddp.py": (TORCHRUN, SMALL),
    "ddp.py": ((sys.executable,), (*SMALL, "--world_size", "2", "--batch_size", "256")),
    "run_with_torchrun.py": (TORCHRUN, ()),
    "run_with_python.py": ((sys.executable,), ("--world_size", "2")),
    "run_with_mpirun.py": ((BIN / "mpirun", "-np", "2", "--oversubscribe", "--bind-to", "none", sys.executable),
                           ("--train", "3", "1")),
    "train.py": (TORCHRUN, ("--data_dir", "mnist", "--output_dir", "out", "--max_train_samples", "512",
                            "--max_eval_samples", "256", "--num_train_epochs", "2", "--disable_tqdm", "True")),
}
COMMANDS.update({f"by_feature/{p.name}": (TORCHRUN, SMALL + (("--comm_hook", "powersgd") if "powersgd" in p.name
                                                               or p.name == "comm_hooks.py" else ()))
                 for p in (REPO / "by_feature").glob("*.py")})


def copy_alone(name, folder):
    """The example and the repository modules it imports, alone in `folder`; returns the copied script's name."""
    folder.mkdir()
    shutil.copy(REPO / name, folder)
    for module in set(imported_modules(REPO / name)) & set(REPOSITORY_PACKAGES):
        shutil.copy(REPO / f"{module}.py", folder)
    if name == "train.py":
        shutil.copytree(MNIST, folder / "mnist")
    if name == "ddp.py":
        shutil.copy(REPO / ".env.example", folder / ".env")
    if "language_model" in set(imported_modules(REPO / name)):
        from language_model import read_text
        (folder / "text.txt").write_text(read_text()[0][:6000])
    return folder / name.split("/")[-1]


def env_alone(name):
    env = (mpi_env if "mpirun" in name else clean_env)()
    env.pop("PYTHONPATH", None)  # tests/support's probe alone goes on it (conftest.run): it checks the clean exit
    return env


def test_the_default_text_is_the_one_its_readme_names_and_a_lone_copy_has_one_too(tmp_path):
    """Steps 6 to 8 train on data/shakespeare/input.txt, as its README describes it (size and MD5); language_model.py
    copied without it trains on Python's own help text, and says so."""
    readme = (REPO / "data" / "shakespeare" / "README.md").read_text()
    data = (REPO / "data" / "shakespeare" / "input.txt").read_bytes()
    assert f"{len(data):,} bytes" in readme and f"MD5 `{hashlib.md5(data).hexdigest()}`" in readme
    shutil.copy(REPO / "language_model.py", tmp_path)
    code = "import language_model; text, about = language_model.read_text(); print(len(text), about)"
    said = run([sys.executable, "-c", code], cwd=tmp_path, env=env_alone("")).stdout
    assert "Python's help text (pydoc_data: no data/shakespeare/input.txt here)" in said, said
    assert int(said.split()[0]) > 100_000, said


def test_nothing_of_the_repository_can_be_imported_in_an_empty_folder(tmp_path):
    for package in REPOSITORY_PACKAGES:
        result = run([sys.executable, "-c", f"import {package}"], cwd=tmp_path, env=env_alone(""), check=False)
        assert result.returncode != 0 and "ModuleNotFoundError" in result.stderr, (package, result.stderr[-500:])


@pytest.mark.quick
@pytest.mark.parametrize("name", [n for n in examples() if n in COMMANDS])
def test_a_copied_example_runs_its_documented_command_alone(tmp_path, name):
    script = copy_alone(name, tmp_path / "copy")
    launcher, args = COMMANDS[name]
    out = run([*launcher, script.name, *args], cwd=script.parent, env=env_alone(name), timeout=300).stdout
    if name == "train.py":  # two epochs of 512 shipped digits
        history = json.loads((script.parent / "out" / "trainer_state.json").read_text())["log_history"]
        accuracy = [entry["eval_accuracy"] for entry in history if "eval_accuracy" in entry]
        assert len(accuracy) == 2 and accuracy[-1] > 0.5, history  # chance is 0.1
    elif name.startswith("run_with_") and "--train" not in args:
        assert "Collectives on 2 rank(s), as rank 0 saw them" in out and "| NO on rank" not in out, out[-3000:]
    else:
        lines = epoch_lines(out, "DDP" if name == "ddp.py" else None)
        assert len(lines) == 3 and lines[-1].loss < lines[0].loss, out[-3000:]
        if "--sample" in args:  # the decoder's last words: the prompt, then 40 bytes it wrote
            assert re.search(r'^Sample: "The .+"$', out, re.M), out[-3000:]
        assert summary(out).backend in ("gloo", "nccl", "none"), out[-3000:]
    check_no_abort(out, name)


def test_every_example_has_a_copy_test():
    untested = set(examples()) - set(COMMANDS) - {"hangs.py", "fault_tolerant.py", "diloco.py",  # tests of their own
                                                  "hf_checkpoint.py",  # test_parallelism's export
                                                  "plan.py"}  # a tool beside step 8: test_plan.py
    assert not untested, f"examples without a command in COMMANDS: {sorted(untested)}"


@pytest.mark.parametrize("name, args, done", [
    ("fault_tolerant.py", ("--steps", "20"), r"^Step 20 \|"),
    ("diloco.py", ("--sync_every", "5", "--steps", "20"), r"^Summary: steps 20 \|")])
def test_a_copied_torchft_example_trains_one_group_with_a_lighthouse(tmp_path, name, args, done):
    script = copy_alone(name, tmp_path / "copy")
    port = free_port()
    lighthouse = start([BIN / "torchft_lighthouse", "--bind", f"127.0.0.1:{port}", "--min_replicas", "1",
                        "--join_timeout_ms", "1000"], cwd=tmp_path, env={**env_alone(""), "RUST_LOG": "warn"})
    try:
        while not listening(port):
            assert lighthouse.poll() is None, lighthouse.stdout.read()
            time.sleep(0.05)
        out = run([*TORCHRUN[:-1], "--nproc_per_node=1", script.name, "--replica_id", "0", "--num_replicas", "1",
                   *args, "--lighthouse", f"http://127.0.0.1:{port}"], cwd=script.parent, env=env_alone(name),
                  timeout=300).stdout
    finally:
        lighthouse.kill()
        finish(lighthouse, 30)
    assert re.search(done, out, re.M), out[-3000:]


def test_a_copied_hangs_py_trains_without_a_fault_and_shows_a_stall_as_torchs_timeout_without_the_tool(tmp_path):
    script = copy_alone("hangs.py", tmp_path / "copy")
    out = run([*TORCHRUN, script.name, "--steps", "10"], cwd=script.parent, env=env_alone("hangs.py")).stdout
    assert "Trained 10 steps: no fault, no hang" in out, out[-3000:]
    # As its docstring says: without the tool, the others wait --timeout and end with torch's own timeout.
    result = run([*TORCHRUN, script.name, "--fault", "stall", "--timeout", "5"], cwd=script.parent,
                 env=env_alone("hangs.py"), timeout=120, check=False)
    assert result.returncode != 0 and "rank 1: --fault stall at step 5" in result.stdout, result.stdout[-3000:]
    assert "timed out" in result.stdout + result.stderr or "Timed out" in result.stdout + result.stderr, \
        result.stderr[-3000:]
