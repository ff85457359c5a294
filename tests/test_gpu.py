"""The GPU path: every script with NCCL on real GPUs, at world size 1 and (with two GPUs) 2, DataParallel
beside DDP in ddp.py, mixed precision on the GPU, torchft's NCCL group, python -m torchdiagnose over an NCCL job, and
more ranks than GPUs. Every launch here names gpu_env(): the other tests' launches have the GPUs hidden. Skipped,
with the reason, where torch sees no CUDA GPU; on a GPU machine:

    python -m pytest -q tests/test_gpu.py
"""
import json
import re
import sys

import pytest
import torch

from conftest import (REPO, assert_one_line_error, epoch_losses, gpu_env, load_snapshot, mpi_env, mpirun_cmd,
                      python_cmd, run, start_lighthouse, summary, torchrun_cmd)

from language_model import read_text

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(GPUS == 0, reason="needs CUDA GPUs: torch sees none on this machine")
WORLD_SIZES = [1, 2] if GPUS >= 2 else [1]


def assert_trained_on_nccl(output, world_size):
    line = summary(output)
    assert (line.world_size, line.backend) == (world_size, "nccl"), output[-2000:]
    losses = epoch_losses(output)
    assert losses and losses[-1] < losses[0], losses


def test_singlegpu_trains_on_the_gpu(tmp_path):
    out = run(python_cmd("singlegpu.py", "4", "2"), cwd=tmp_path, env=gpu_env()).stdout
    assert summary(out).backend == "none"
    losses = epoch_losses(out)
    assert losses[-1] < losses[0]
    # The model is made on the CPU and shuffling draws from the CPU generator: the snapshot holds its state.
    assert load_snapshot(tmp_path / "singlegpu.pt")["rng"].dtype == torch.uint8


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_tutorial_steps_train_with_nccl(tmp_path, world_size):
    out = run(python_cmd("multigpu.py", "4", "2", "--world_size", world_size, "--snapshot_path", "spawn.pt"),
              cwd=tmp_path, env=gpu_env()).stdout
    assert_trained_on_nccl(out, world_size)
    for script in ("multigpu_torchrun.py", "multinode.py"):
        out = run(torchrun_cmd(script, "4", "2", "--snapshot_path", f"{script}.pt", nproc=world_size),
                  cwd=tmp_path, env=gpu_env()).stdout
        assert_trained_on_nccl(out, world_size)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_launcher_runs_the_collectives_on_nccl(tmp_path, world_size):
    outputs = [run(torchrun_cmd("run_with_torchrun.py", nproc=world_size), cwd=tmp_path, env=gpu_env()).stdout,
               run(python_cmd("run_with_python.py", "--world_size", world_size), cwd=tmp_path, env=gpu_env()).stdout,
               run(mpirun_cmd("run_with_mpirun.py", np_=world_size), cwd=tmp_path, env=gpu_env(mpi_env)).stdout]
    for out in outputs:
        for rank in range(world_size):
            assert f"Process {rank}: Default device is set to {rank}" in out, out
        rows = re.findall(r"^(\S.*?)\s*\| .*\| (yes|NO on rank [\d, ]+)$", out, re.MULTILINE)
        assert rows and all(ok == "yes" for _, ok in rows), out


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_linear_classifier_with_nccl_and_amp(tmp_path, world_size):
    out = run(torchrun_cmd("by_feature/mixed_precision.py", "--total_epochs", "3", nproc=world_size),
              cwd=tmp_path, env=gpu_env()).stdout
    dtype = "torch.bfloat16" if torch.cuda.is_bf16_supported() else "torch.float16"
    assert f"device cuda:0 | autocast {dtype}" in out, out
    assert summary(out).backend == "nccl"


RESUMED = ["fsdp.py", *(f"by_feature/{name}" for name in ("comm_hooks.py", "exact_evaluation.py",
           "gradient_accumulation.py", "mixed_precision.py", "powersgd_with_zero.py", "step_checkpoints.py",
           "uneven_inputs.py", "zero_optimizer.py"))]


@pytest.mark.parametrize("script", RESUMED)
def test_trains_and_resumes_on_the_gpu(tmp_path, script):
    """A snapshot written from the GPU (PowerSGD's error feedback, ZeRO's shards, FSDP's DTensors) loads back onto it
    and training goes on where it stopped."""
    args = ["--batch_size", "256"] if script == "fsdp.py" else ["--input_size", "20"]
    if "powersgd" in script or "comm_hooks" in script:
        args += ["--comm_hook", "powersgd"]
    first = run(torchrun_cmd(script, *args, "--total_epochs", "2", nproc=1), cwd=tmp_path, env=gpu_env()).stdout
    assert_trained_on_nccl(first, 1)
    second = run(torchrun_cmd(script, *args, "--total_epochs", "4", nproc=1), cwd=tmp_path, env=gpu_env()).stdout
    assert re.search(r"Resuming from \S+ at epoch 2", second), second[-3000:]
    assert summary(second).backend == "nccl"
    resumed = epoch_losses(second)
    assert len(resumed) == 2 and resumed[-1] < epoch_losses(first)[0], (first[-2000:], second[-2000:])


# dp x tp x pp: every axis a mesh dimension of size 1 on one GPU; FSDP2 x TP and 3-D where there are GPUs enough.
ND_LAYOUTS = [(dp, tp, pp) for dp, tp, pp in [(1, 1, 1), (1, 2, 1), (2, 2, 1), (2, 2, 2)]
              if dp * tp * pp <= max(GPUS, 1)]


@pytest.mark.parametrize("script, args, world_size",
                         [("tensor_parallel.py", (), n) for n in WORLD_SIZES]
                         + [("pipeline_parallel.py", (), n) for n in WORLD_SIZES]
                         + [("nd_parallel.py", ("--dp", dp, "--tp", tp, "--pp", pp), dp * tp * pp)
                            for dp, tp, pp in ND_LAYOUTS])
def test_tensor_pipeline_and_nd_parallel_train_and_resume_on_the_gpu(tmp_path, script, args, world_size):
    """DTensor's all-gathers and reduce-scatters (sequence parallelism) and loss_parallel, the pipeline's sends and
    FSDP's collectives on NCCL, training the decoder; a checkpoint written from the GPUs loads back onto them."""
    (tmp_path / "text.txt").write_text(read_text()[0][:20000])
    args = [*map(str, args), "--data", "text.txt", "--sample", "40"]
    first = run(torchrun_cmd(script, *args, "--total_epochs", "2", nproc=world_size), cwd=tmp_path,
                env=gpu_env()).stdout
    assert_trained_on_nccl(first, world_size)
    second = run(torchrun_cmd(script, *args, "--total_epochs", "3", nproc=world_size), cwd=tmp_path,
                 env=gpu_env()).stdout
    assert re.search(r"Resuming from \S+ at epoch 2", second), second[-3000:]
    assert summary(second).backend == "nccl" and len(epoch_losses(second)) == 1, second[-3000:]
    assert re.search(r'^Sample: "The .+"$', second, re.M), second[-3000:]


def test_ddp_py_compares_dataparallel_with_ddp(tmp_path):
    out = run(python_cmd("ddp.py", "--total_epochs", "3"), cwd=tmp_path, env=gpu_env()).stdout
    assert summary(out).backend == "nccl"
    rows = re.findall(r"^(normal|DDP \(\d+ ranks\)|DataParallel \(\d+ GPUs\)) +\|", out, re.MULTILINE)
    assert ("DataParallel" in " ".join(rows)) == (GPUS >= 2), out
    difference = float(re.search(r"Largest \|normal - DDP\| weight difference: (\S+)", out)[1])
    assert difference < 1e-4, out  # GPU kernels round differently from the CPU, still far below a real difference


def test_train_py_trains_with_nccl(tmp_path, mnist_dir):
    run(torchrun_cmd("train.py", "--data_dir", mnist_dir, "--output_dir", tmp_path / "out", "--max_train_samples",
                     "2000", "--num_train_epochs", "2", nproc=min(GPUS, 2)), cwd=tmp_path, env=gpu_env(), timeout=600)
    results = json.loads((tmp_path / "out" / "all_results.json").read_text())
    assert results["eval_accuracy"] > 0.9


def test_allreduce_benchmark_with_nccl(tmp_path):
    out = run(torchrun_cmd("benchmarks/allreduce.py", "--quick", "--out", tmp_path, nproc=min(GPUS, 2)),
              cwd=tmp_path, env=gpu_env()).stdout
    assert "backend nccl" in out and "Peak busbw" in out


def test_fault_tolerant_commits_every_step_on_nccl(tmp_path):
    """torchft's ProcessGroupNCCL, rebuilt at each quorum, on the GPU. One replica group: NCCL refuses two ranks of
    one communicator on the same GPU, so a second group needs a second GPU."""
    lighthouse, address = start_lighthouse()
    try:
        out = run(torchrun_cmd("fault_tolerant.py", "--replica_id", "0", "--num_replicas", "1", "--steps", "30",
                               "--lighthouse", address, "--save_weights", tmp_path / "weights.pt", nproc=1),
                  cwd=tmp_path, env=gpu_env()).stdout
    finally:
        lighthouse.kill()
        lighthouse.communicate()
    assert "device cuda:0 | backend nccl" in out, out[-3000:]
    line = re.search(r"^Summary: steps committed (\d+) \| by this group (\d+) tried \| groups per step 1-1 .*"
                     r"\| backend nccl$", out, re.M)
    assert line and line[1] == line[2] == "30", out[-3000:]
    assert load_snapshot(tmp_path / "weights.pt")["step"] == 30


def test_diagnose_leaves_a_healthy_nccl_job_alone(tmp_path):
    """The tool's watchdog reads NCCL's flight recorder and each group's count of collectives: on a job that does
    not hang it says nothing, and the job trains and exits 0 as without it."""
    result = run([sys.executable, "-m", "torchdiagnose", "--timeout", "30",
                  *torchrun_cmd("multigpu_torchrun.py", "4", "2", nproc=min(GPUS, 2))],
                 cwd=tmp_path, env=gpu_env(PYTHONPATH=REPO))
    assert_trained_on_nccl(result.stdout, min(GPUS, 2))
    assert "diagnose:" not in result.stdout + result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize("script", ["by_feature/comm_hooks.py", "by_feature/powersgd_with_zero.py"])
def test_powersgd_with_more_ranks_than_gpus(tmp_path, script):
    """More processes than GPUs train on the CPU, where torch's PowerSGD hook fails while a GPU is visible (it
    synchronizes the bucket's device as a CUDA device): one line, and with the GPUs hidden, as it says, training."""
    cmd = torchrun_cmd(script, "--input_size", "20", "--total_epochs", "3", "--comm_hook", "powersgd", nproc=GPUS + 1)
    assert_one_line_error(run(cmd, cwd=tmp_path, env=gpu_env(), check=False), "CUDA_VISIBLE_DEVICES=", code=1)
    out = run(cmd, cwd=tmp_path, env=gpu_env(CUDA_VISIBLE_DEVICES="")).stdout
    assert (summary(out).world_size, summary(out).backend) == (GPUS + 1, "gloo"), out[-2000:]
