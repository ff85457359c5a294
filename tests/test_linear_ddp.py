"""The linear classifier: torchrun_ddp.py (the base) and by_feature/gradient_accumulation.py and
mixed_precision.py under torchrun, ddp.py under its own mp.spawn with the rendezvous from a .env file:
reduction over ranks, no_sync accumulation (counted), bf16 autocast (seen in the losses), resume, normal
training against DDP (from the saved weights), and one-line errors."""
import shutil
import socket

import pytest
import torch

from conftest import (BIN, REPO, assert_one_line_error, clean_env, collectives_issued, epoch_lines, forked, free_port,
                      load_snapshot, python_cmd, rank_0_env, run, summary)

from models_and_data import LinearClassifier

SMALL = ("--input_size", "20")
DATASET = 4096  # torchrun_ddp.py's and ddp.py's synthetic dataset


def torchrun_ddp_cmd(*args, script="torchrun_ddp.py", backend="gloo"):
    """The documented launch line (a static rendezvous on 127.0.0.1), on a free port instead of 29500; backend None:
    the script's own choice."""
    return [BIN / "torchrun", "--nproc_per_node=2", "--nnodes=1", "--node_rank=0", "--master_addr=127.0.0.1",
            f"--master_port={free_port()}", REPO / script, *(("--backend", backend) if backend else ()), *SMALL, *args]


def accumulation_cmd(*args):
    return torchrun_ddp_cmd(*args, script="by_feature/gradient_accumulation.py")


def assert_learned(lines, count):
    assert len(lines) == count, lines
    assert lines[-1].loss < lines[0].loss, lines
    assert lines[-1].accuracy > 0.85, lines  # chance is 0.5, the label noise caps it near 0.95


@pytest.fixture(scope="module")
def big_batch_run(tmp_path_factory):
    """The base, 3 epochs of one batch of 64 per rank and step: the reference for learning, accumulation and
    resume, and bf16's fp32 counterpart. torch made to report 1 GPU (FAKE_GPUS) and the backend left to the script:
    2 ranks on it, one too many, train on the CPU with gloo (test_more_ranks_on_a_node_than_gpus_is_refused)."""
    directory = tmp_path_factory.mktemp("big_batch")
    result = run(torchrun_ddp_cmd("--total_epochs", "3", "--batch_size", "64", backend=None), cwd=directory,
                 env=clean_env(DDP_EXAMPLES_PROBE_FAKE_GPUS=1))
    return result, load_snapshot(directory / "torchrun_ddp.pt"), directory


def test_torchrun_learns_and_counts_every_sample_of_both_ranks(big_batch_run):
    result, state, _ = big_batch_run
    lines = epoch_lines(result.stdout)
    assert_learned(lines, 3)
    # Each rank trains on half of the 4096 samples: the figures printed by rank 0 are the sums over both
    # ranks only if the epoch statistics were all-reduced (rank 0's own would count 2048).
    assert [line.samples for line in lines] == [DATASET] * 3
    assert "32 steps per epoch of 64 samples per rank" in result.stdout  # 4096 / 2 ranks / 64
    assert summary(result.stdout)[:3] == (3, 96, lines[-1].loss)
    assert state["epochs_run"] == 3


COUNTED = clean_env(DDP_EXAMPLES_PROBE_COLLECTIVES=1)  # each rank prints the collectives it issued (sitecustomize.py)
ACCUMULATE = ("--batch_size", "16", "--accumulation_steps", "4", "--snapshot_path", "small.pt")


@pytest.fixture(scope="module")
def accumulated_run(tmp_path_factory):
    """The accumulation example, 2 epochs of 4 micro-batches of 16 per step, collectives counted: the no_sync count,
    and the first half of the accumulation's resume."""
    directory = tmp_path_factory.mktemp("accumulated")
    result = run(accumulation_cmd("--total_epochs", "2", *ACCUMULATE), cwd=directory, env=COUNTED)
    return directory, result


@pytest.mark.slow
def test_accumulation_then_resume_gives_the_big_batch_weights(big_batch_run, accumulated_run, tmp_path):
    """4 micro-batches of 16, stopped after 2 epochs and resumed for the 3rd, end where one batch of 64 per step
    does: wrong loss scaling, a premature step, or a resume that loses the momentum or the shuffle move the
    weights far beyond this tolerance."""
    _, big, _ = big_batch_run
    folder, first = accumulated_run
    assert "32 steps per epoch of 4 x 16 samples per rank" in first.stdout
    shutil.copy(folder / "small.pt", tmp_path / "small.pt")  # the fixture's own stays as it ended
    resumed = run(accumulation_cmd("--total_epochs", "3", *ACCUMULATE), cwd=tmp_path)
    assert "Resuming from small.pt at epoch 2" in resumed.stdout
    assert [line.epoch for line in epoch_lines(resumed.stdout)] == [2]
    small = load_snapshot(tmp_path / "small.pt")
    assert small["epochs_run"] == 3
    for name, weight in big["model"].items():
        difference = (small["model"][name] - weight).abs().max().item()
        assert torch.allclose(small["model"][name], weight, rtol=1e-5, atol=1e-6), (name, difference)
    momentum = small["optimizer"]["state"][0]["momentum_buffer"]
    assert torch.allclose(momentum, big["optimizer"]["state"][0]["momentum_buffer"], rtol=1e-4, atol=1e-6)


def test_no_sync_all_reduces_once_per_optimizer_step(accumulated_run, tmp_path):
    """Averaging is linear, so all-reducing every micro-batch gives the same weights as no_sync: only a count of
    the collectives tells them apart. Two epochs of 128 micro-batches per rank, as 32 optimizer steps of 4 an epoch
    and as 128 steps of 1; each rank's process group counts what it issued (tests/support/sitecustomize.py). All
    else is the same both ways, so the counts differ by one all-reduce per extra step, 2 x 96; without no_sync they
    would be equal."""
    def issued(result):
        counts = collectives_issued(result.stderr)
        assert len(counts) == 2 and len(set(counts.values())) == 1, result.stderr[-2000:]
        return counts[0]

    accumulated = issued(accumulated_run[1])  # 2 x 32 steps, 2 x 128 micro-batches
    small_steps = issued(run(accumulation_cmd("--total_epochs", "2", "--batch_size", "16", "--accumulation_steps", "1",
                                              "--snapshot_path", "steps1.pt"), cwd=tmp_path, env=COUNTED))
    assert small_steps - accumulated == 2 * (128 - 32), "with no_sync, micro-batches within a step must not all-reduce"


def test_amp_trains_in_bf16_on_cpu(big_batch_run, tmp_path):
    """Same seed, flags and data as the fp32 reference: every loss differs from fp32's by bf16 rounding, small
    but never zero (autocast that did nothing would reproduce the fp32 losses exactly)."""
    result = run(torchrun_ddp_cmd("--total_epochs", "3", "--batch_size", "64", script="by_feature/mixed_precision.py"),
                 cwd=tmp_path)
    assert "device cpu | autocast torch.bfloat16" in result.stdout
    amp, fp32 = epoch_lines(result.stdout), epoch_lines(big_batch_run[0].stdout)
    assert_learned(amp, 3)
    for a, f in zip(amp, fp32):
        assert a.loss != f.loss and abs(a.loss - f.loss) < 0.05 * f.loss, (amp, fp32)


@pytest.mark.slow  # a second launch of mixed_precision.py; test_amp_trains_in_bf16_on_cpu keeps autocast in the loop
def test_amp_resumes_a_snapshot_of_the_base(big_batch_run, tmp_path):
    """The base's snapshot (the reference run's, copied) holds no scaler state: mixed_precision.py goes on from it
    with a fresh scaler."""
    shutil.copy(big_batch_run[2] / "torchrun_ddp.pt", tmp_path / "base.pt")
    assert "scaler" not in torch.load(tmp_path / "base.pt", weights_only=False)
    result = run(torchrun_ddp_cmd("--total_epochs", "4", "--batch_size", "64", "--snapshot_path", "base.pt",
                                  script="by_feature/mixed_precision.py"), cwd=tmp_path)
    assert "Resuming from base.pt at epoch 3" in result.stdout, result.stdout[-3000:]
    assert [line.epoch for line in epoch_lines(result.stdout)] == [3], result.stdout[-3000:]
    assert "scaler" in torch.load(tmp_path / "base.pt", weights_only=False), "the next save holds the scaler's state"


def ddp_py(*args):
    return python_cmd("ddp.py", "--backend", "gloo", "--world_size", "2", *SMALL, *args)


@pytest.fixture(scope="module")
def ddp_py_run(tmp_path_factory):
    """ddp.py, 3 epochs, its rendezvous from a .env file and the environment: (folder, stdout, port). The .env's
    address would stop the run (it does not resolve); the environment's wins."""
    folder, port = tmp_path_factory.mktemp("ddp_py"), free_port()
    (folder / ".env").write_text(f"MASTER_ADDR=no-such-host.invalid\nMASTER_PORT={port}\n")
    out = run(ddp_py("--total_epochs", "3", "--batch_size", "64", "--weights_dir", "weights"), cwd=folder,
              env=clean_env(MASTER_ADDR="127.0.0.1")).stdout
    return folder, out, port


def test_ddp_py_matches_normal_training(ddp_py_run):
    tmp_path, out, port = ddp_py_run
    assert f"MASTER_PORT={port} (from {tmp_path / '.env'})" in out
    normal, ddp = epoch_lines(out, "normal"), epoch_lines(out, "DDP")
    assert_learned(normal, 3)
    assert_learned(ddp, 3)
    # From the weights each mode ended with, not from the script's printout: equal to float rounding, while
    # a different run (another seed) ends about 1e-2 away.
    weights = {mode: torch.load(tmp_path / "weights" / f"{mode}.pt", weights_only=True) for mode in ("normal", "ddp")}
    difference = max((weights["normal"][k] - weights["ddp"][k]).abs().max().item() for k in weights["normal"])
    assert difference < 1e-5
    torch.manual_seed(0)
    initial = LinearClassifier(20).state_dict()
    assert max((weights["ddp"][k] - initial[k]).abs().max().item() for k in initial) > 0.1, "trained, not initial"
    printed = float(out.split("Largest |normal - DDP| weight difference: ")[1].split()[0])
    assert printed == pytest.approx(difference, rel=1e-3, abs=1e-12)
    assert "[DataParallel] skipped: it splits each batch over 2 or more CUDA GPUs" in out  # launches hide GPUs
    line = summary(out)
    assert (line.steps, line.world_size, line.backend) == (96, 2, "gloo")  # 4096 / 2 ranks / 64 = 32 steps an epoch


def test_ddp_py_without_env_file_uses_defaults(tmp_path):
    out = run(ddp_py("--total_epochs", "1", "--batch_size", "256"), cwd=tmp_path).stdout
    assert f"MASTER_ADDR=127.0.0.1 (default, no env file at {tmp_path / '.env'})" in out
    assert "MASTER_PORT=" in out and f"(a free port, no env file at {tmp_path / '.env'})" in out
    assert summary(out).epochs == 1


def test_environment_wins_over_env_file(ddp_py_run):
    """The .env's MASTER_ADDR does not resolve (alone it stops the run: test_ddp_py_bad_address_or_port_in_env_file);
    the environment's is used, and the .env's MASTER_PORT, which the environment leaves unset."""
    tmp_path, out, port = ddp_py_run
    assert "MASTER_ADDR=127.0.0.1 (from the environment)" in out
    assert f"MASTER_PORT={port} (from {tmp_path / '.env'})" in out
    assert summary(out).epochs == 3


ENV_FILE_CASES = [
    ("127.0.0.1", "abc", "MASTER_PORT='abc' from {env}: expected a port number"),
    ("127.0.0.1", "70000", "MASTER_PORT='70000' from {env}: expected a port number, 1 to 65535"),
    ("no-such-host.invalid", "29500", "MASTER_ADDR='no-such-host.invalid' (from {env}) does not resolve"),
]
DDP_PY_FLAGS = [
    ("--backend", "foo", "invalid choice: 'foo'"),
    ("--input_size", "0", "--input_size: must be a positive integer, got 0"),
    ("--batch_size", "-4", "--batch_size: must be a positive integer, got -4"),
    ("--epochs", "0", "--total_epochs/--epochs: must be a positive integer, got 0"),
]
# torchrun_ddp.py's own flags, and the accumulation example's (by_feature/ files copy the base's parser).
TORCHRUN_DDP_FLAGS = [
    ("torchrun_ddp.py", "--backend", "foo", "invalid choice: 'foo'"),
    ("torchrun_ddp.py", "--total_epochs", "-1", "--total_epochs/--epochs: must be a positive integer, got -1"),
    ("torchrun_ddp.py", "--batch_size", "x", "--batch_size: must be a positive integer, got x"),
    ("torchrun_ddp.py", "--timeout", "0", "--timeout and --lr must be positive"),
    ("by_feature/gradient_accumulation.py", "--accumulation_steps", "0",
     "--accumulation_steps: must be a positive integer, got 0"),
]


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """The bad-input cases below, which stop before any process starts: each its script's command line in a folder
    of its own (where ddp.py looks for its .env), in a child forked from one process that imported torch once
    (forked_runs); the port of the .env in use held by a listener meanwhile. ({case: (CompletedProcess, folder)},
    that port)."""
    root = tmp_path_factory.mktemp("refused")
    cases = {("env file", address, port): ["ddp.py", ddp_py()[2:]] for address, port, _ in ENV_FILE_CASES}
    cases.update({("flag", "ddp.py", flag, value): ["ddp.py", [flag, value]] for flag, value, _ in DDP_PY_FLAGS})
    cases.update({("flag", script, flag, value): [script, [flag, value]] for script, flag, value, _ in
                  TORCHRUN_DDP_FLAGS})
    cases.update({("port in use",): ["ddp.py", ddp_py()[2:]], ("absent env file",): ["ddp.py", ddp_py(
        "--env_file", "absent.env")[2:]], ("nccl",): ["ddp.py", ["--backend", "nccl"]]})
    folders = {}
    for i, (key, case) in enumerate(cases.items()):
        folders[key] = root / str(i)
        folders[key].mkdir()
        case += [None, {"cwd": folders[key]}]
    for address, port, _ in ENV_FILE_CASES:
        (folders[("env file", address, port)] / ".env").write_text(f"MASTER_ADDR={address}\nMASTER_PORT={port}\n")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        (folders[("port in use",)] / ".env").write_text(f"MASTER_PORT={port}\n")
        results = forked(list(cases.values()), cwd=root)
    return {key: (result, folders[key]) for key, result in zip(cases, results)}, port


@pytest.mark.parametrize("address, port, expected", ENV_FILE_CASES)
def test_ddp_py_bad_address_or_port_in_env_file(refused, address, port, expected):
    result, folder = refused[0][("env file", address, port)]
    assert_one_line_error(result, expected.format(env=folder / ".env"), code=1)
    assert len(result.stderr.strip().splitlines()) == 1


def test_ddp_py_port_in_use(refused):
    (result, _), port = refused[0][("port in use",)], refused[1]
    assert_one_line_error(result, f"port {port} on 127.0.0.1 is already in use", code=1)


@pytest.mark.quick
def test_ddp_py_missing_env_file_named(refused):
    result, folder = refused[0][("absent env file",)]
    assert_one_line_error(result, f"env file {folder / 'absent.env'} not found", code=1)


@pytest.mark.quick
@pytest.mark.parametrize("flag, value, expected", DDP_PY_FLAGS)
def test_ddp_py_bad_flags(refused, flag, value, expected):
    result, _ = refused[0][("flag", "ddp.py", flag, value)]
    assert_one_line_error(result, expected)


@pytest.mark.parametrize("script, flag, value, expected", TORCHRUN_DDP_FLAGS)
def test_torchrun_ddp_bad_flags(refused, script, flag, value, expected):
    result, _ = refused[0][("flag", script, flag, value)]
    assert_one_line_error(result, expected)


def test_ddp_py_nccl_without_gpus_says_use_gloo(refused):
    result, _ = refused[0][("nccl",)]
    assert_one_line_error(result, "backend nccl needs CUDA GPUs", "--backend gloo")


@pytest.mark.parametrize("script", ["ddp.py", "torchrun_ddp.py"])
def test_more_ranks_on_a_node_than_gpus_is_refused(request, tmp_path, script):
    """torch is made to report 1 GPU and NCCL (the check runs before any GPU is touched), also on a machine with
    GPUs: the tests' launches have those hidden. 2 ranks on it: one too many, as 9 on 8 GPUs."""
    env, ranks = clean_env(DDP_EXAMPLES_PROBE_FAKE_GPUS=1), 2
    if script == "ddp.py":
        result = run(python_cmd("ddp.py", "--backend", "nccl", "--world_size", ranks), cwd=tmp_path, env=env,
                     check=False, timeout=60)
        assert_one_line_error(result, f"{ranks} ranks on this node but only {ranks - 1} cuda device(s)")
    else:  # torchrun_ddp.py trains them all on the CPU (a Mac has one mps device), where NCCL cannot run
        # The refusal comes before the process group: rank 0 of 2 alone, in the environment torchrun gives it, says
        # what every rank would (a rank that went on would wait for the others until the timeout). The training
        # under torchrun itself, with the backend left to the script, is the shared reference run's (big_batch_run).
        result = run(python_cmd(script, *SMALL, "--backend", "nccl"), cwd=tmp_path, check=False, timeout=90,
                     env=rank_0_env(ranks, DDP_EXAMPLES_PROBE_FAKE_GPUS=1))
        assert_one_line_error(result, "--backend nccl needs a CUDA GPU for each process", "gloo on the CPU", code=1)
        out = request.getfixturevalue("big_batch_run")[0].stdout
        assert f"{ranks} ranks | " in out and "| device cpu" in out, out[-2000:]
        assert (summary(out).world_size, summary(out).backend) == (ranks, "gloo")


@pytest.mark.parametrize("content, expected", [
    ("garbage", "cannot read the snapshot torchrun_ddp.pt (UnpicklingError: truncated, or not a snapshot)"),
    ("other model", "the snapshot torchrun_ddp.pt is of another model or optimizer (Error(s) in loading state_dict"),
])
def test_a_snapshot_that_does_not_fit_is_named_in_one_line_and_left_alone(request, tmp_path, content, expected):
    path = tmp_path / "torchrun_ddp.pt"
    if content == "garbage":
        path.write_bytes(b"not a snapshot")
        features = SMALL
    else:  # a snapshot of the base with 20 features (the reference run's, copied), resumed with 30
        shutil.copy(request.getfixturevalue("big_batch_run")[2] / "torchrun_ddp.pt", path)
        features = ("--input_size", "30")  # after SMALL's: argparse takes the last
    before = path.read_bytes()
    result = run(torchrun_ddp_cmd("--total_epochs", "4", *features), cwd=tmp_path, check=False, timeout=90)
    assert_one_line_error(result, expected, "move it away or pass another --snapshot_path", code=1)
    assert path.read_bytes() == before and not epoch_lines(result.stdout)
