"""torch.compile under torchrun on gloo: by_feature/compiled.py (DDP) and fsdp.py --compile. The graphs as torch's
own counters count them (DDPOptimizer splits the model's graph at DDP's first bucket; compiled autograd traces the
backward pass whole, without a graph break), snapshots that resume across compiled and eager runs, bad input in
one line.

Inductor compiles C++ with g++ here, seconds per graph on a busy core: every launch of this module shares one
inductor cache (TORCHINDUCTOR_CACHE_DIR), so a graph compiled once is loaded by the launches after it.
"""
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, assert_bitwise_equal, assert_one_line_error, clean_env, epoch_lines, forked, \
    free_port, load_snapshot, python_cmd, rank_0_env, run, torchrun_cmd

# Two hidden layers of 512: the last two layers hold more than DDP's first bucket (1 MiB), so DDPOptimizer splits.
MODEL = ("--hidden_size", "512", "--input_size", "20")
GRAPHS = re.compile(r"^Graphs \| mode (\S+) \| traced (\d+) \| compiled (\d+) \| graph breaks (\d+) \| "
                    r"compiled autograd (\d+) \| compile ([\d.]+)s$", re.M)
STEP_TIME = re.compile(r"^Step time \| eager ([\d.]+) ms(?: \| compiled ([\d.]+) ms)? \|", re.M)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    # One compile thread: no pool of compile workers (each one a Python importing torch) beside 2 ranks on 2 cores.
    return clean_env(TORCHINDUCTOR_CACHE_DIR=tmp_path_factory.mktemp("inductor_cache"),
                     TORCHINDUCTOR_COMPILE_THREADS=1)


def compiled_py(folder, env, snapshot, *args, check=True):
    return run(torchrun_cmd("by_feature/compiled.py", *MODEL, "--snapshot_path", snapshot, *args), cwd=folder,
               env=env, timeout=600, check=check)


def graphs(output):
    match = GRAPHS.search(output)
    assert match, output[-3000:]
    mode, *counts = match.groups()
    return mode, *map(int, counts[:4])


@pytest.fixture(scope="module")
def runs(env, tmp_path_factory):
    """Epoch 0 compiled (DDPOptimizer) and eager; then each snapshot resumed for epoch 1 the other way: the
    compiled one eagerly, the eager one with compiled autograd."""
    folder = tmp_path_factory.mktemp("compiled")
    out = {"compiled": compiled_py(folder, env, "compiled.pt", "--epochs", "1", "--compile", "default").stdout,
           "eager": compiled_py(folder, env, "eager.pt", "--epochs", "1").stdout}
    shutil.copy(folder / "compiled.pt", folder / "compiled_then_eager.pt")
    shutil.copy(folder / "eager.pt", folder / "eager_then_compiled.pt")
    out["compiled_then_eager"] = compiled_py(folder, env, "compiled_then_eager.pt", "--epochs", "2").stdout
    out["eager_then_compiled"] = compiled_py(folder, env, "eager_then_compiled.pt", "--epochs", "2", "--compile",
                                             "default", "--compiled_autograd").stdout
    return folder, out


def test_ddp_splits_the_compiled_graph_at_its_first_bucket(runs):
    """One graph traced, compiled as two: DDPOptimizer cut it after the first 1 MiB of parameters (counted from
    the output, the order gradients come in), so DDP can all-reduce that bucket while the rest runs backward.
    Dynamo itself broke nothing."""
    _, out = runs
    assert graphs(out["compiled"]) == ("default", 1, 2, 0, 0), out["compiled"][-2000:]
    assert "Graphs |" not in out["eager"]
    eager, compiled = STEP_TIME.search(out["compiled"]).groups()
    assert float(eager) > 0 and float(compiled) > 0
    assert STEP_TIME.search(out["eager"])[2] is None  # no compiled time without --compile


def test_compiled_autograd_traces_the_backward_pass_and_its_all_reduces_whole(runs):
    """With compiled autograd (DDP's Python reducer) the forward is one graph, not split, and the backward pass,
    the all-reduces inside, a second one: torch promises no graph break there (fullgraph=True would fail)."""
    _, out = runs
    assert graphs(out["eager_then_compiled"]) == ("default", 2, 2, 0, 1), out["eager_then_compiled"][-2000:]


def test_a_compiled_run_saves_the_plain_models_snapshot(runs):
    """The same keys, epoch and RNG as the eager run's, no _orig_mod. prefix; the weights and momentum the same
    up to the order inductor adds in (fused kernels round differently from eager's)."""
    folder, _ = runs
    compiled, eager = load_snapshot(folder / "compiled.pt"), load_snapshot(folder / "eager.pt")
    assert list(compiled["model"]) == list(eager["model"]) and not any("_orig_mod" in k for k in compiled["model"])
    assert_bitwise_equal(compiled["rng"], eager["rng"], "rng")  # compile drew no random numbers: the same next batch
    assert compiled["epochs_run"] == eager["epochs_run"] == 1
    for what in ("model", "optimizer"):
        flat = [(k, v) for k, v in torch.utils._pytree.tree_flatten_with_path(compiled[what])[0]]
        other = torch.utils._pytree.tree_flatten_with_path(eager[what])[0]
        assert [k for k, _ in flat] == [k for k, _ in other], what
        for (key, a), (_, b) in zip(flat, other):
            if isinstance(a, torch.Tensor):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=f"{what} {key}")
            else:
                assert a == b, (what, key)


def test_snapshots_resume_across_compiled_and_eager(runs):
    """The compiled snapshot resumed eagerly and the eager one resumed compiled train epoch 1 to the same weights,
    momentum and loss, within what inductor's rounding leaves: a lost momentum or another epoch's shuffle moves
    them a hundred times further."""
    folder, out = runs
    for name in ("compiled_then_eager", "eager_then_compiled"):
        assert f"Resuming from {name}.pt at epoch 1" in out[name], out[name][-2000:]
    losses = [epoch_lines(out[name])[0] for name in ("compiled_then_eager", "eager_then_compiled")]
    assert [line.epoch for line in losses] == [1, 1]
    assert losses[0].loss == pytest.approx(losses[1].loss, abs=1e-5), losses
    a, b = (load_snapshot(folder / f"{name}.pt") for name in ("compiled_then_eager", "eager_then_compiled"))
    assert a["epochs_run"] == b["epochs_run"] == 2
    for key in a["model"]:
        torch.testing.assert_close(a["model"][key], b["model"][key], rtol=0, atol=1e-4, msg=key)
    for index, state in a["optimizer"]["state"].items():
        torch.testing.assert_close(state["momentum_buffer"], b["optimizer"]["state"][index]["momentum_buffer"],
                                   rtol=0, atol=1e-4)


def test_a_snapshot_of_torch_compile_model_with_its_prefix_resumes_exactly(runs, tmp_path):
    """torch.compile(model).state_dict() names every key _orig_mod.*: such a snapshot resumes as the plain one
    does, bit for bit. Both resumed eagerly by one process each (rank 0 of 1, a port each for its process group
    of one), forked from one process that imported torch once (conftest.forked)."""
    folder, _ = runs
    state = load_snapshot(folder / "compiled.pt")
    (tmp_path / "plain").mkdir()
    (tmp_path / "prefixed").mkdir()
    shutil.copy(folder / "compiled.pt", tmp_path / "plain" / "compiled.pt")
    state["model"] = {f"_orig_mod.{key}": value for key, value in state["model"].items()}
    torch.save(state, tmp_path / "prefixed" / "compiled.pt")
    said = forked([["by_feature/compiled.py", [*MODEL, "--snapshot_path", "compiled.pt", "--epochs", "2"], 1,
                    {"cwd": tmp_path / name, "env": {"MASTER_PORT": free_port()}}] for name in ("plain", "prefixed")],
                  cwd=tmp_path)
    for result in said:
        assert result.returncode == 0 and "Resuming from compiled.pt at epoch 1" in result.stdout, result.stderr[-2000:]
        assert "1 ranks |" in result.stdout, result.stdout[-2000:]
    assert_bitwise_equal(load_snapshot(tmp_path / "prefixed" / "compiled.pt"),
                         load_snapshot(tmp_path / "plain" / "compiled.pt"))


BAD_FLAGS = [
    (("--compile", "fast"), "argument --compile: torch 2"),
    (("--compiled_autograd",), "--compiled_autograd compiles the backward pass with torch.compile: add --compile"),
]


@pytest.fixture(scope="module")
def said(tmp_path_factory):
    """The bad flags, each compiled.py's command line in a process forked from one that imported torch once
    (conftest.forked), one process for both. (Not the missing compiler: inductor reads $CXX when it is
    imported, which the forking process has done.)"""
    cases = [["by_feature/compiled.py", list(args), None] for args, _ in BAD_FLAGS]
    return forked(cases, cwd=tmp_path_factory.mktemp("one-line"))


@pytest.mark.parametrize("case", range(len(BAD_FLAGS)), ids=[fragment for _, fragment in BAD_FLAGS])
def test_bad_compile_flags_are_one_line(said, case):
    args, fragment = BAD_FLAGS[case]
    line = assert_one_line_error(said[case], fragment)
    if "fast" in args:
        assert "knows none, default, " in line and "reduce-overhead" in line and "got 'fast'" in line


def test_a_missing_cxx_compiler_is_one_line_before_any_work(tmp_path, env):
    """Inductor compiles with $CXX (else g++): one missing is inductor's own error, in one line that says what to
    do, before the process group starts, not a traceback at the first step. Rank 0 of 2 alone, in torchrun's
    environment: a check after the process group would wait there for rank 1 until the timeout."""
    result = run(python_cmd("by_feature/compiled.py", *MODEL, "--snapshot_path", "s.pt", "--compile", "default"),
                 cwd=tmp_path, env=rank_0_env(2, TORCHINDUCTOR_CACHE_DIR=env["TORCHINDUCTOR_CACHE_DIR"],
                                              CXX=tmp_path / "missing" / "g++"), timeout=120, check=False)
    assert_one_line_error(result, "No working C++ compiler found", "missing/g++", "install g++", "--compile none",
                          code=1)
    assert "Epoch" not in result.stdout and not (tmp_path / "s.pt").exists()


def test_fsdp_trains_an_epoch_compiled_and_an_uncompiled_run_resumes_it(env, tmp_path):
    """fsdp.py --compile compiles each block in place before fully_shard: its checkpoint holds the plain model's
    keys, an uncompiled run resumes it, and both epochs match an uncompiled run's within inductor's rounding.
    The uncompiled runs are one process each, with the compiled run's global batch (fsdp.py's epochs do not depend
    on the world size): the resume reshards the 2 ranks' checkpoint, and both are forked from one process that
    imported torch once (conftest.forked), a port each for its process group of one."""
    cache = Path(env["TORCHINDUCTOR_CACHE_DIR"])
    cached = sum(1 for _ in cache.rglob("*"))
    (tmp_path / "compiled").mkdir()
    (tmp_path / "eager").mkdir()
    compiled = run(torchrun_cmd("fsdp.py", "--batch_size", "256", "--epochs", "1", "--compile"),
                   cwd=tmp_path / "compiled", env=env, timeout=600).stdout
    assert sum(1 for _ in cache.rglob("*")) > cached  # inductor compiled the blocks (no other launch builds them)
    uncompiled = ["fsdp.py", ["--global_batch_size", "512", "--epochs", "2"], 1]
    resumed, eager = forked([[*uncompiled, {"cwd": tmp_path / folder, "env": {"MASTER_PORT": free_port()}}]
                             for folder in ("compiled", "eager")], cwd=tmp_path, env=env, modules=["fsdp"])
    for result in (resumed, eager):
        assert result.returncode == 0 and "Training on 1 process |" in result.stdout, result.stderr[-2000:]
    assert re.search(r"^Resuming from \S+ at epoch 1$", resumed.stdout, re.M), resumed.stdout[-2000:]
    assert "Resuming" not in eager.stdout
    losses = [line.loss for line in epoch_lines(compiled) + epoch_lines(resumed.stdout)]
    assert losses == pytest.approx([line.loss for line in epoch_lines(eager.stdout)], rel=1e-4), \
        (losses, eager.stdout[-2000:])


def test_the_benchmark_times_eager_and_compiled_steps_and_the_compile_apart(env, tmp_path):
    result = run([sys.executable, REPO / "benchmarks/compile.py", "--models", "mlp", "--steps", "20", "--warmup", "5",
                  "--out", tmp_path], cwd=REPO, env=env, timeout=600)
    data = json.loads((tmp_path / "compile.json").read_text())
    assert data["device"] == "cpu" and data["device_name"] == data["machine"]["cpu_model"]
    assert data["torch"] == torch.__version__ and data["inductor_cache"] == "given"
    (row,) = data["results"]
    assert row["model"] == "mlp" and row["parameters"] == 5569
    assert row["speedup"] == pytest.approx(row["eager_ms"] / row["compiled_ms"])
    assert row["compile_s"] > 10 * row["compiled_ms"] / 1000  # the first compiled step: a compile, not a step
    saved_s = (row["eager_ms"] - row["compiled_ms"]) / 1000
    assert row["break_even_steps"] == (round(row["compile_s"] / saved_s) if saved_s > 0 else None)
    assert "break-even steps" in result.stdout and (tmp_path / "compile.png").read_bytes()[:4] == b"\x89PNG"
