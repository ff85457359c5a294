"""The examples under the launch clients users already drive, each the real client in a subprocess: accelerate's
`accelerate launch`, `python -m torch.distributed.run` and `python -m torch.distributed.launch --use-env`. Every
rank takes part (the job's world size is the processes started) and a second launch resumes from the first's
snapshot, under accelerate or under another client (a snapshot does not depend on the launcher that wrote it).
"""
import json
import sys

import pytest

from conftest import BIN, CLIENT_SCRIPTS, MNIST, REPO, clean_env, epoch_lines, free_port, run, summary

ENV = clean_env(OMP_NUM_THREADS=1)  # as torchrun sets it for 2 processes a machine


def accelerate(script, *args):
    # --multi_gpu with --num_processes 2 is accelerate's DDP launch; on CPUs it starts 2 gloo processes too.
    return [BIN / "accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
            REPO / script, *args]


def torch_distributed(module, script, *args):
    extra = ("--use-env",) if module == "launch" else ()
    return [sys.executable, "-m", f"torch.distributed.{module}", *extra, "--standalone", "--nproc_per_node=2",
            REPO / script, *args]


CLIENTS = {
    "accelerate": accelerate,
    "torch.distributed.run": lambda script, *args: torch_distributed("run", script, *args),
    "torch.distributed.launch": lambda script, *args: torch_distributed("launch", script, *args),
}


# accelerate sets up the processes its own way: every kind of example trains under it, and train.py.
# torch.distributed.run is torchrun's own code, and launch --use-env a thin layer over it (torchrun runs every script
# from scratch and resumes it elsewhere): each resumes one example that accelerate trained, one launch a client
# where a launch for each client and script cost twice as much. The developer loop (-m "not slow") keeps accelerate
# with step 3 and train.py.
SLOW = pytest.mark.slow
# (script, the client of the first launch, that of the second, which resumes)
CHAINS = [("multigpu_torchrun.py", "accelerate", "accelerate"),
          pytest.param("multinode.py", "accelerate", "torch.distributed.run", marks=SLOW),
          pytest.param("by_feature/gradient_accumulation.py", "accelerate", "torch.distributed.launch", marks=SLOW)]


@pytest.mark.parametrize("script, client, resumer", CHAINS)
def test_an_example_trains_on_every_rank_under_the_client_and_resumes_under_the_resumer(tmp_path, script, client,
                                                                                         resumer):
    first, second = CLIENT_SCRIPTS[script]
    out = run(CLIENTS[client](script, *first), cwd=tmp_path, env=ENV, timeout=180).stdout
    assert summary(out).world_size == 2 and [line.epoch for line in epoch_lines(out)] == [0, 1], out[-3000:]
    out = run(CLIENTS[resumer](script, *second), cwd=tmp_path, env=ENV, timeout=180).stdout
    assert "Resuming from" in out and [line.epoch for line in epoch_lines(out)] == [2, 3], out[-3000:]
    assert summary(out).world_size == 2, out[-3000:]


def test_train_py_trains_on_both_ranks_and_resumes_under_accelerate(tmp_path):
    out_dir = tmp_path / "out"
    common = ("--data_dir", MNIST, "--output_dir", out_dir, "--max_train_samples", "256", "--max_eval_samples",
              "128", "--disable_tqdm", "True")
    out = run(accelerate("train.py", *common, "--num_train_epochs", "1"), cwd=tmp_path, env=ENV, timeout=300).stdout
    assert summary(out).world_size == 2 and "weights identical on all 2 ranks" in out, out[-3000:]
    steps = json.loads((out_dir / "trainer_state.json").read_text())["global_step"]
    out = run(accelerate("train.py", *common, "--num_train_epochs", "2", "--resume_from_checkpoint", "last"),
              cwd=tmp_path, env=ENV, timeout=300).stdout
    assert f"resuming from {out_dir / f'checkpoint-{steps}'}" in out, out[-3000:]
    assert json.loads((out_dir / "trainer_state.json").read_text())["global_step"] == 2 * steps
