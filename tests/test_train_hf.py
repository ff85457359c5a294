"""train.py (the Hugging Face Trainer script) under python, torchrun and mpirun, on real MNIST digits."""
import gzip
import json
import math
import re
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from datasets import ClassLabel, Dataset, DatasetDict, Features, Image
from safetensors.torch import load_file
from conftest import (MNIST, assert_bitwise_equal, assert_one_line_error, clean_env, forked, free_port, load_snapshot,
                      mpi_env, mpirun_cmd, python_cmd, run, summary, torchrun_cmd, write_idx)
from models_and_data import load_mnist, read_idx
from train import SimpleCNN, collate, load_splits

TINY = ("--max_train_samples", "512", "--max_eval_samples", "256", "--num_train_epochs", "1", "--disable_tqdm", "True")
# One thread per process: on a shared 2-core machine two threads per process run several times slower.
ENV = clean_env(OMP_NUM_THREADS=1)


def trainer_state(output_dir):
    return json.loads((output_dir / "trainer_state.json").read_text())


def trained(output):
    """(epochs, steps, world size, backend) of train.py's summary line."""
    line = summary(output)
    return line.epochs, line.steps, line.world_size, line.backend


def accuracy_of_saved_model(output_dir, mnist_dir, count):
    """Accuracy of the model.safetensors in output_dir on the first `count` eval images, recomputed here."""
    model = SimpleCNN()
    model.load_state_dict(load_file(output_dir / "model.safetensors"))
    splits, _ = load_splits(str(mnist_dir))
    batch = collate([splits["test"][i] for i in range(count)])
    with torch.no_grad():
        predicted = model(batch["image"])["logits"].argmax(-1)
    return (predicted == batch["labels"]).float().mean().item()


def test_idx_reader_on_the_real_test_set():
    images = read_idx(str(MNIST / "t10k-images-idx3-ubyte.gz"))
    labels = read_idx(str(MNIST / "t10k-labels-idx1-ubyte.gz"))
    assert images.shape == (10000, 28, 28) and images.dtype == torch.uint8
    assert (images.min(), images.max()) == (0, 255)
    assert torch.bincount(labels).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


def test_collate_normalises_real_digits_to_mean_0_and_std_1(mnist_dir):
    splits, note = load_splits(str(mnist_dir))
    assert note is None, "four files: the split they hold, nothing said"
    assert (len(splits["train"]), len(splits["test"])) == (8000, 2000)
    batch = collate([splits["test"][i] for i in range(2000)])
    images, labels = load_mnist(str(mnist_dir), "test")
    assert batch["image"].shape == (2000, 1, 28, 28) and batch["image"].dtype == torch.float32
    # The constants are the training set's; on 2,000 other real digits the pixels come out centred and scaled.
    assert abs(batch["image"].mean().item()) < 0.05 and abs(batch["image"].std().item() - 1) < 0.05
    # The same digits as the IDX file, in the same order: a pixel's rank order survives normalisation.
    assert torch.equal(batch["image"][:, 0].argsort(dim=-1), images.float().argsort(dim=-1))
    assert batch["labels"].dtype == torch.int64 and batch["labels"].tolist() == labels.tolist()


@pytest.mark.slow
def test_torchrun_two_ranks_reach_97_percent(mnist_dir, tmp_path):
    """The defaults, as a user runs them, on the shipped data/mnist: it holds the official test set alone, and
    train.py trains on 8,000 of its images and evaluates on the other 2,000 (the split of the tests and of the
    docs' figures), and says so once. DDP halves the steps of each rank."""
    start = time.perf_counter()
    result = run(torchrun_cmd("train.py", "--data_dir", MNIST, "--output_dir", tmp_path / "out"), cwd=tmp_path,
                 timeout=900)
    wall = time.perf_counter() - start
    said = f"{MNIST} holds only the MNIST test set: training on 8,000 of its images and evaluating on the other 2,000"
    assert result.stdout.count(said) == 1, result.stdout[-3000:]
    assert "Training SimpleCNN on 8000 images, evaluating on 2000" in result.stdout
    results = json.loads((tmp_path / "out" / "all_results.json").read_text())
    print(f"torchrun 2 ranks, 3 epochs: eval accuracy {results['eval_accuracy']:.4f}, {wall:.0f}s wall")
    assert results["eval_accuracy"] >= 0.97
    assert (results["train_samples"], results["eval_samples"]) == (8000, 2000)
    assert "weights identical on all 2 ranks" in result.stdout
    # One process would take 3 * ceil(8000 / 64) = 375 steps; two ranks of 64 images each take half.
    assert trained(result.stdout) == (3.0, 189, 2, "gloo")
    assert trainer_state(tmp_path / "out")["global_step"] == 3 * math.ceil(8000 / 128)
    evals = [entry["eval_accuracy"] for entry in trainer_state(tmp_path / "out")["log_history"]
             if "eval_accuracy" in entry]
    assert len(evals) == 3 and evals[0] < evals[2]  # once per epoch, improving
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == [
        "checkpoint-126", "checkpoint-189", "checkpoint-63"]

    # The saved model is the trained one: it scores the reported accuracy on its own.
    recomputed = accuracy_of_saved_model(tmp_path / "out", mnist_dir, 2000)
    assert recomputed == pytest.approx(results["eval_accuracy"], abs=1e-3)


@pytest.fixture(scope="module")
def one_epoch_run(mnist_dir, tmp_path_factory):
    """One epoch of 512 images in one process: 8 steps of 64, checkpoint-8."""
    output_dir = tmp_path_factory.mktemp("python_run") / "out"
    result = run(python_cmd("train.py", "--data_dir", mnist_dir, "--output_dir", output_dir, *TINY),
                 cwd=output_dir.parent, env=ENV, timeout=300)
    return output_dir, result


def test_python_run_writes_the_trainer_outputs_and_learns(one_epoch_run, mnist_dir):
    output_dir, result = one_epoch_run
    assert trained(result.stdout) == (1.0, 8, 1, "none")
    assert "weights identical" not in result.stdout  # one process: nothing to compare
    for name in ("model.safetensors", "train_results.json", "eval_results.json", "all_results.json",
                 "checkpoint-8/optimizer.pt", "checkpoint-8/complete"):
        assert (output_dir / name).is_file(), name
    results = json.loads((output_dir / "all_results.json").read_text())
    assert results["train_samples"] == 512 and results["eval_samples"] == 256
    # One epoch on 512 digits is far above chance (0.1), and the saved model scores what was reported.
    assert results["eval_accuracy"] > 0.5, results
    assert accuracy_of_saved_model(output_dir, mnist_dir, 256) == pytest.approx(results["eval_accuracy"], abs=1e-3)


EVAL_SIZE = 1001  # neither 2 nor 3 divides it


@pytest.fixture(scope="module")
def mpirun_run(mnist_dir, tmp_path_factory):
    """train.py under mpirun at 2 ranks on a save_to_disk DatasetDict shaped like the Hub's (PNG-encoded images,
    ClassLabel): 512 training images, 1001 evaluation images (2 does not divide them), 1 epoch, each rank's weights
    saved by the probe. (folder, CompletedProcess, {split: the digits as saved})."""
    folder = tmp_path_factory.mktemp("mpirun")
    features = Features({"image": Image(), "label": ClassLabel(names=[str(d) for d in range(10)])})
    splits, originals = DatasetDict(), {}
    for name, count in (("train", 512), ("test", EVAL_SIZE)):
        images, labels = load_mnist(str(mnist_dir), name)
        originals[name] = images[:count].numpy()
        splits[name] = Dataset.from_dict({"image": list(originals[name]), "label": labels[:count]}, features=features)
    splits.save_to_disk(str(folder / "saved"))
    weights = folder / "weights"
    weights.mkdir()
    result = run(mpirun_cmd("train.py", "--data_dir", folder / "saved", "--output_dir", folder / "out", *TINY,
                            "--max_eval_samples", str(EVAL_SIZE), "--ddp_timeout", "60"), cwd=folder,
                 env=mpi_env(DDP_EXAMPLES_PROBE_WEIGHTS=weights), timeout=200)
    return folder, result, originals


@pytest.mark.slow
def test_mpirun_two_ranks_on_a_saved_dataset(one_epoch_run, mpirun_run):
    """mpirun, with the data as a save_to_disk DatasetDict shaped like the Hub's (PNG-encoded images, ClassLabel)."""
    tmp_path, result, originals = mpirun_run
    # What train.py reads back from disk is every digit as it was, pixel for pixel.
    loaded, _ = load_splits(str(tmp_path / "saved"))
    for name, images in originals.items():
        assert np.array_equal(np.stack([row["image"] for row in loaded[name]]).reshape(images.shape), images), name

    # The same 512 images as the one-process run: each rank takes half of every batch, so half the steps.
    assert trained(result.stdout) == (1.0, 4, 2, "gloo")
    one_process_steps = trainer_state(one_epoch_run[0] / "checkpoint-8")["global_step"]
    assert trainer_state(tmp_path / "out")["global_step"] * 2 == one_process_steps
    # Each rank's weights as the probe saved them after train() (tests/support/sitecustomize.py), not the
    # script's own check: DDP kept the two ranks bit-identical, and rank 0 saved that model.
    weights = tmp_path / "weights"
    rank0, rank1 = (load_snapshot(weights / f"rank{r}.pt") for r in (0, 1))
    assert_bitwise_equal(rank0, rank1, "weights of rank 0 and rank 1")
    assert_bitwise_equal(load_file(tmp_path / "out" / "model.safetensors"), rank0, "saved model")


@pytest.mark.slow
def test_trainer_evaluation_counts_each_image_once(mpirun_run):
    """train.py at 2 ranks on 1001 evaluation images (2 does not divide it; the mpirun run): the Trainer's figures
    are those of one process scoring the saved model on all 1001 here, each image once: accuracy as a count, and the
    loss (train.py's own, in place of the Trainer's per-batch average)."""
    folder = mpirun_run[0]
    metrics = json.loads((folder / "out" / "eval_results.json").read_text())
    model = SimpleCNN()
    model.load_state_dict(load_file(folder / "out" / "model.safetensors"))
    splits, _ = load_splits(str(folder / "saved"))
    batch = collate([splits["test"][i] for i in range(EVAL_SIZE)])
    with torch.no_grad():
        logits = model(batch["image"])["logits"]
    correct = int((logits.argmax(-1) == batch["labels"]).sum())
    assert (metrics["eval_scored"], metrics["eval_correct"]) == (EVAL_SIZE, correct)
    assert metrics["eval_accuracy"] == correct / EVAL_SIZE
    assert metrics["eval_loss"] == pytest.approx(F.cross_entropy(logits.double(), batch["labels"]).item(), abs=1e-5)


MISSING = ["train-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]


@pytest.fixture(scope="module")
def refused(mnist_dir, tmp_path_factory):
    """train.py's command lines that stop before any work: no --data_dir with an empty cache in offline mode, and a
    folder that lacks one of the four files. Each in a child forked from one process that imported train.py's modules
    (transformers) once (forked_runs), that process in offline mode with an empty cache; in folders of their own.
    {case: (CompletedProcess, folder)}."""
    root = tmp_path_factory.mktemp("refused")
    cases, folders = {}, {}
    folders["offline"] = root / "offline"
    folders["offline"].mkdir()
    cases["offline"] = ["train.py", ["--output_dir", folders["offline"] / "out"], None, {"cwd": folders["offline"]}]
    for missing in MISSING:
        folders[missing] = root / missing
        data = folders[missing] / "data"
        data.mkdir(parents=True)
        for path in mnist_dir.glob("*.gz"):
            if not path.name.startswith(missing):
                (data / path.name).write_bytes(path.read_bytes())
        cases[missing] = ["train.py", ["--data_dir", data, "--output_dir", folders[missing] / "out"], None,
                          {"cwd": folders[missing]}]
    results = forked(list(cases.values()), cwd=root, env=clean_env(HF_HOME=root / "hf", HF_HUB_OFFLINE=1),
                     modules=["train"])
    return {key: (result, folders[key]) for key, result in zip(cases, results)}


# Unreachable, the Hub's client retries for some 25 s before the line: that variant runs in the whole suite only.
@pytest.mark.parametrize("offline", [pytest.param(True, id="HF_HUB_OFFLINE"),
                                     pytest.param(False, id="hub-unreachable", marks=pytest.mark.slow)])
def test_no_data_without_a_network_says_how_to_get_it(request, tmp_path, offline):
    """An empty cache, and either offline mode (`refused`) or a Hub address where nobody listens (no network here
    or not)."""
    start = time.perf_counter()
    if offline:
        result, _ = request.getfixturevalue("refused")["offline"]
    else:
        env = clean_env(HF_HOME=tmp_path / "hf")
        env.pop("HF_HUB_OFFLINE", None)
        env["HF_ENDPOINT"] = f"http://127.0.0.1:{free_port()}"
        result = run(python_cmd("train.py", "--output_dir", tmp_path / "out"), cwd=tmp_path, env=env, check=False)
    assert_one_line_error(result, "ylecun/mnist", "--data_dir", "save_to_disk", code=1)
    print(f"failed in {time.perf_counter() - start:.1f}s: {result.stderr.strip()}")


@pytest.mark.parametrize("missing", MISSING)
def test_a_missing_file_is_one_line_naming_it(refused, missing):
    """Three of the four files: the error names the one that is not there, and where it was looked for (with
    neither training file, the folder is a test set alone: test_the_shipped_test_set_trains_as_documented)."""
    result, folder = refused[missing]
    data = folder / "data"
    assert_one_line_error(result, f"MNIST file {missing}[.gz] not found in {data} or {data}/MNIST/raw", "--data_dir",
                          code=1)


def test_bad_magic_and_count_mismatch_name_the_file(mnist_dir, tmp_path):
    """Stopped in one line (SystemExit's message) naming the folder or file, before any process group."""
    for name in ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz"):
        (tmp_path / name).write_bytes((mnist_dir / name).read_bytes())
    write_idx(str(tmp_path / "t10k-labels-idx1-ubyte.gz"), read_idx(str(mnist_dir / "t10k-labels-idx1-ubyte.gz"))[:-1])
    folder = re.escape(str(tmp_path))
    with pytest.raises(SystemExit, match=rf"^error: cannot load {folder} \(the test files in {folder} hold "
                                         r"\(2000, 28, 28\) images and \(1999,\) labels: they do not belong "
                                         r"together\)"):
        load_splits(str(tmp_path))
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(b"\x00\x00\x07\x01" + bytes(100))
    with pytest.raises(SystemExit,
                       match=r"t10k-labels-idx1-ubyte is not an IDX file of bytes \(magic number 00000701\)"):
        load_splits(str(tmp_path))
    # A damaged .gz (gzip's own message names no file) and a cut one: the line names the file.
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    for damaged in (b"not gzip at all", gzip.compress(bytes(range(256)) * 40)[:100]):
        (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(damaged)
        with pytest.raises(SystemExit, match=rf"^error: cannot load {folder} \({folder}/t10k-labels-idx1-ubyte\.gz "
                                             r"is not a whole gzip file \("):
            load_splits(str(tmp_path))
