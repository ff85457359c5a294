"""The examples under the launch clients users already drive, each the real client in a subprocess: accelerate's
`accelerate launch`, `python -m torch.distributed.run` and `python -m torch.distributed.launch --use-env`. Every
rank takes part (the job's world size is the processes started) and later launches resume from the first's
snapshot, under accelerate or under another client (a snapshot does not depend on the launcher that wrote it).
"""
import json
import shutil
import sys

from conftest import BIN, MNIST, REPO, clean_env, epoch_lines, free_port, run, summary

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


# accelerate sets up the processes its own way; what it runs is the script's own main, as torchrun runs it. So one
# example, step 4 (multinode.py: step 3 plus node-local snapshots; the by_feature scripts parse and run as step 3
# does), trains under accelerate and resumes under it, then under torch.distributed.launch --use-env; train.py, the
# other kind of script (Hugging Face's Trainer), trains under accelerate and resumes under torch.distributed.run.
# torch.distributed.run is torchrun's own code, and launch --use-env a thin layer over it: torchrun runs every
# script from scratch and resumes it elsewhere.
def test_step_4_trains_on_every_rank_under_accelerate_and_resumes_under_it_and_under_torch_distributed_launch(
        tmp_path):
    out = run(accelerate("multinode.py", "2", "1"), cwd=tmp_path, env=ENV, timeout=180).stdout
    assert summary(out).world_size == 2 and [line.epoch for line in epoch_lines(out)] == [0, 1], out[-3000:]
    out = run(accelerate("multinode.py", "4", "1"), cwd=tmp_path, env=ENV, timeout=180).stdout
    assert "Resuming from" in out and [line.epoch for line in epoch_lines(out)] == [2, 3], out[-3000:]
    assert summary(out).world_size == 2, out[-3000:]
    out = run(torch_distributed("launch", "multinode.py", "6", "1"), cwd=tmp_path, env=ENV, timeout=180).stdout
    assert "Resuming from" in out and [line.epoch for line in epoch_lines(out)] == [4, 5], out[-3000:]
    assert summary(out).world_size == 2, out[-3000:]


def test_train_py_trains_on_both_ranks_under_accelerate_and_resumes_under_torch_distributed_run(tmp_path):
    """The resume takes the newest complete checkpoint: a newer folder that a rank killed while saving left unmarked
    (no `complete`, a torn rng_state_1.pth) is passed by."""
    out_dir = tmp_path / "out"
    common = ("--data_dir", MNIST, "--output_dir", out_dir, "--max_train_samples", "256", "--max_eval_samples",
              "128", "--disable_tqdm", "True")
    out = run(accelerate("train.py", *common, "--num_train_epochs", "1"), cwd=tmp_path, env=ENV, timeout=300).stdout
    assert summary(out).world_size == 2 and "weights identical on all 2 ranks" in out, out[-3000:]
    steps = json.loads((out_dir / "trainer_state.json").read_text())["global_step"]
    torn = out_dir / f"checkpoint-{steps + 1}"
    shutil.copytree(out_dir / f"checkpoint-{steps}", torn)
    (torn / "complete").unlink()
    (torn / "rng_state_1.pth").write_bytes((torn / "rng_state_1.pth").read_bytes()[:100])
    out = run(torch_distributed("run", "train.py", *common, "--num_train_epochs", "2", "--resume_from_checkpoint",
                                "last"), cwd=tmp_path, env=ENV, timeout=300).stdout
    assert f"resuming from {out_dir / f'checkpoint-{steps}'}" in out, out[-3000:]
    assert (summary(out).epochs, summary(out).steps, summary(out).world_size) == (1.0, steps, 2), out[-3000:]
    state = json.loads((out_dir / "trainer_state.json").read_text())
    assert state["global_step"] == 2 * steps and (out_dir / f"checkpoint-{2 * steps}").is_dir()
    assert [entry["epoch"] for entry in state["log_history"] if "eval_accuracy" in entry] == [1.0, 2.0]
