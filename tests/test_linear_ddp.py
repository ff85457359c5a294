"""torchrun_ddp.py under torchrun and ddp.py under its own mp.spawn, with the rendezvous from a .env file:
learning, no_sync accumulation, AMP, resume, normal training against DDP, and one-line errors."""
import re
import socket

import pytest
import torch

from conftest import BIN, REPO, clean_env, free_port, load_snapshot, python_cmd, run

SMALL = ("--input_size", "20")


def torchrun_ddp_cmd(*args):
    """The documented launch line (a static rendezvous on 127.0.0.1), on a free port instead of 29500."""
    return [BIN / "torchrun", "--nproc_per_node=2", "--nnodes=1", "--node_rank=0", "--master_addr=127.0.0.1",
            f"--master_port={free_port()}", REPO / "torchrun_ddp.py", "--backend", "gloo", *SMALL, *args]


def epoch_lines(stdout, prefix=""):
    pattern = rf"^{re.escape(prefix)}Epoch \d+ \| loss ([\d.]+) \| accuracy ([\d.]+)"
    return [(float(loss), float(accuracy)) for loss, accuracy in re.findall(pattern, stdout, re.M)]


def summary(stdout):
    match = re.search(r"^Summary: epochs (\d+) \| steps (\d+) \| final loss ([\d.]+) .*"
                      r"\| world size (\d+) \| backend (\w+)$", stdout, re.M)
    assert match, stdout
    return match.groups()


def assert_learned(epochs, count):
    assert len(epochs) == count, epochs
    (first_loss, _), (last_loss, last_accuracy) = epochs[0], epochs[-1]
    assert last_loss < first_loss, epochs
    assert last_accuracy > 0.85, epochs  # chance is 0.5, the label noise caps it near 0.95


@pytest.fixture(scope="module")
def big_batch_run(tmp_path_factory):
    """3 epochs of one batch of 64 per rank and step: the reference for learning, accumulation and resume."""
    directory = tmp_path_factory.mktemp("big_batch")
    result = run(torchrun_ddp_cmd("--epochs", "3", "--batch_size", "64", "--snapshot_path", "big.pt"),
                 cwd=directory)
    return result, load_snapshot(directory / "big.pt")


def test_torchrun_learns_and_reduces_over_ranks(big_batch_run):
    result, state = big_batch_run
    assert_learned(epoch_lines(result.stdout), 3)
    # 4096 samples / 2 ranks / 64 per step = 32 steps per epoch
    assert "32 steps per epoch of 1 x 64 samples per rank" in result.stdout
    assert summary(result.stdout) == ("3", "96", f"{epoch_lines(result.stdout)[-1][0]:.6f}", "2", "gloo")
    assert state["epochs_run"] == 3


def test_accumulation_then_resume_gives_the_big_batch_weights(big_batch_run, tmp_path):
    """4 micro-batches of 16 with no_sync, stopped after 2 epochs and resumed for the 3rd, end where one
    batch of 64 per step does: wrong loss scaling, a premature all-reduce or step, or a resume that loses
    the momentum or the shuffle all move the weights far beyond this tolerance."""
    _, big = big_batch_run
    accumulate = ("--batch_size", "16", "--accumulation_steps", "4", "--snapshot_path", "small.pt")
    first = run(torchrun_ddp_cmd("--epochs", "2", *accumulate), cwd=tmp_path)
    assert "32 steps per epoch of 4 x 16 samples per rank" in first.stdout
    resumed = run(torchrun_ddp_cmd("--epochs", "3", *accumulate), cwd=tmp_path)
    assert "Resuming from small.pt at epoch 2" in resumed.stdout
    assert len(epoch_lines(resumed.stdout)) == 1
    small = load_snapshot(tmp_path / "small.pt")
    assert small["epochs_run"] == 3
    for name, weight in big["model"].items():
        difference = (small["model"][name] - weight).abs().max().item()
        assert torch.allclose(small["model"][name], weight, rtol=1e-5, atol=1e-6), (name, difference)
    momentum = small["optimizer"]["state"][0]["momentum_buffer"]
    assert torch.allclose(momentum, big["optimizer"]["state"][0]["momentum_buffer"], rtol=1e-4, atol=1e-6)


def test_amp_on_cpu_learns(tmp_path):
    result = run(torchrun_ddp_cmd("--epochs", "3", "--amp"), cwd=tmp_path)
    assert "amp torch.bfloat16 | device cpu" in result.stdout
    assert_learned(epoch_lines(result.stdout), 3)


def ddp_py(*args):
    return python_cmd("ddp.py", "--backend", "gloo", "--world_size", "2", *SMALL, *args)


def test_ddp_py_matches_normal_training(tmp_path):
    port = free_port()
    (tmp_path / ".env").write_text(f"MASTER_ADDR=127.0.0.1\nMASTER_PORT={port}\n")
    result = run(ddp_py("--epochs", "3", "--batch_size", "64"), cwd=tmp_path)
    out = result.stdout
    assert f"MASTER_PORT={port} (from {tmp_path / '.env'})" in out
    normal, ddp = epoch_lines(out, "[normal] "), epoch_lines(out, "[DDP] ")
    assert_learned(normal, 3)
    assert_learned(ddp, 3)
    assert max(abs(a - b) for pair in zip(normal, ddp) for a, b in zip(*pair)) < 1e-5
    rows = {row[0].strip(): [float(value.rstrip("s")) for value in row[1:]]
            for row in re.findall(r"^(normal|DDP \(2 ranks\)) +\| +([\d.]+s) \| +([\d.]+) \| +([\d.]+) \| +([\d.]+)$",
                                  out, re.M)}
    assert rows.keys() == {"normal", "DDP (2 ranks)"}, out
    (_, _, normal_loss, normal_accuracy), (_, _, ddp_loss, ddp_accuracy) = rows["normal"], rows["DDP (2 ranks)"]
    assert abs(normal_loss - ddp_loss) < 1e-5 and abs(normal_accuracy - ddp_accuracy) < 1e-3
    assert ddp_accuracy > 0.85
    difference = float(re.search(r"Largest \|normal - DDP\| weight difference: (\S+)", out).group(1))
    assert difference < 1e-5  # float rounding, not a different training run (those differ by ~1e-2)
    if torch.cuda.device_count() < 2:
        assert "[DataParallel] skipped: it splits each batch over 2 or more CUDA GPUs" in out
    assert summary(out)[1:] == ("96", f"{ddp_loss:.6f}", "2", "gloo")  # 4096 / 2 ranks / 64 = 32 steps an epoch


def test_ddp_py_without_env_file_uses_defaults(tmp_path):
    result = run(ddp_py("--epochs", "1"), cwd=tmp_path)
    assert f"MASTER_ADDR=127.0.0.1 (default, no env file at {tmp_path / '.env'})" in result.stdout
    assert re.search(r"^MASTER_PORT=\d+ \(a free port, no env file at ", result.stdout, re.M)
    assert summary(result.stdout)[0] == "1"


def test_environment_wins_over_env_file(tmp_path):
    (tmp_path / ".env").write_text("MASTER_ADDR=127.0.0.1\nMASTER_PORT=abc\n")  # would stop the run
    port = free_port()
    result = run(ddp_py("--epochs", "1"), cwd=tmp_path, env=clean_env(MASTER_PORT=port))
    assert f"MASTER_PORT={port} (from the environment)" in result.stdout
    assert f"MASTER_ADDR=127.0.0.1 (from {tmp_path / '.env'})" in result.stdout
    assert summary(result.stdout)[0] == "1"


def assert_one_line_error(result, *expected):
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for text in expected:
        assert text in lines[0], lines[0]


@pytest.mark.parametrize("port, expected", [
    ("abc", "MASTER_PORT='abc' from {env}: expected a port number"),
    ("70000", "MASTER_PORT='70000' from {env}: port must be between 1 and 65535, got 70000"),
])
def test_ddp_py_bad_port_in_env_file(tmp_path, port, expected):
    (tmp_path / ".env").write_text(f"MASTER_ADDR=127.0.0.1\nMASTER_PORT={port}\n")
    result = run(ddp_py(), cwd=tmp_path, check=False, timeout=60)
    assert_one_line_error(result, expected.format(env=tmp_path / ".env"))


def test_ddp_py_port_in_use(tmp_path):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        (tmp_path / ".env").write_text(f"MASTER_PORT={port}\n")
        result = run(ddp_py(), cwd=tmp_path, check=False, timeout=60)
    assert_one_line_error(result, f"port {port} on 127.0.0.1 is already in use")


def test_ddp_py_missing_env_file_named(tmp_path):
    result = run(ddp_py("--env_file", "absent.env"), cwd=tmp_path, check=False, timeout=60)
    assert_one_line_error(result, f"env file {tmp_path / 'absent.env'} not found")


def test_ddp_py_nccl_with_more_ranks_than_gpus(tmp_path):
    ranks = torch.cuda.device_count() + 1
    result = run(python_cmd("ddp.py", "--backend", "nccl", "--world_size", ranks), cwd=tmp_path, check=False,
                 timeout=60)
    gpus = torch.cuda.device_count()
    assert_one_line_error(result, f"{ranks} ranks on this node but only {gpus} GPU(s)" if gpus
                          else "backend nccl needs CUDA GPUs")


@pytest.mark.parametrize("flag, value, expected", [
    ("--backend", "foo", "invalid choice: 'foo'"),
    ("--input_size", "0", "--input_size: must be a positive integer, got 0"),
    ("--batch_size", "-4", "--batch_size: must be a positive integer, got -4"),
    ("--epochs", "0", "--epochs: must be a positive integer, got 0"),
])
def test_ddp_py_bad_flags(tmp_path, flag, value, expected):
    result = run(python_cmd("ddp.py", flag, value), cwd=tmp_path, check=False, timeout=60)
    assert_one_line_error(result, expected)


# The size flags share cli.positive_int with ddp.py's, tested above; these are torchrun_ddp.py's own.
@pytest.mark.parametrize("flag, value, expected", [
    ("--backend", "foo", "invalid choice: 'foo'"),
    ("--epochs", "-1", "--epochs: must be a positive integer, got -1"),
    ("--accumulation_steps", "0", "--accumulation_steps: must be a positive integer, got 0"),
])
def test_torchrun_ddp_bad_flags(tmp_path, flag, value, expected):
    result = run(python_cmd("torchrun_ddp.py", flag, value), cwd=tmp_path, check=False, timeout=60)
    assert_one_line_error(result, expected)


def test_torchrun_ddp_nccl_with_more_ranks_than_gpus(tmp_path):
    """The variables torchrun would set for one rank more than there are GPUs (a single process suffices:
    check_backend runs before the rendezvous)."""
    gpus = torch.cuda.device_count()
    env = clean_env(RANK=0, LOCAL_RANK=0, WORLD_SIZE=gpus + 1, LOCAL_WORLD_SIZE=gpus + 1)
    result = run(python_cmd("torchrun_ddp.py", "--backend", "nccl"), cwd=tmp_path, env=env, check=False,
                 timeout=60)
    assert_one_line_error(result, f"{gpus + 1} ranks on this node but only {gpus} GPU(s)" if gpus
                          else "backend nccl needs CUDA GPUs")
