"""MNIST from its IDX files (the files torchvision keeps under MNIST/raw/), for the scripts that train on it.

- The IDX reader and writer, with every header checked against the file's size.
- The official test set split into 8,000 images to train on and 2,000 to evaluate on (seed 0): what a folder with
  only the two t10k files (this repository's data/mnist) gives, and what the tests use.
- For train.py's Hugging Face Trainer: a datasets.DatasetDict with "train" and "test" splits and "image"/"label"
  columns, from the Hub, from IDX files or from save_to_disk, and the collate function that makes model inputs.
"""
import gzip
import os
import struct

import numpy as np
import pyarrow as pa
import torch
from datasets import Dataset, DatasetDict, load_dataset, load_from_disk
from huggingface_hub import constants, get_session
from torch.utils.data import TensorDataset

from ddp_common.errors import UsageError, one_line

# MNIST as LeCun published it, and as torchvision stores it under MNIST/raw/.
MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
              0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}


def read_idx(path):
    """One IDX file (plain or .gz) as a numpy array, with its header checked against its size."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as error:
        raise UsageError(f"cannot read MNIST file {path} ({error}); download it again") from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in IDX_DTYPES:
        raise UsageError(f"{path} is not an IDX file (bad magic number {data[:4].hex() or 'none'}); "
                         "download the MNIST files again")
    dtype, ndim = np.dtype(IDX_DTYPES[data[2]]), data[3]
    shape = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
    expected = 4 + 4 * ndim + dtype.itemsize * int(np.prod(shape))
    if len(data) != expected:
        raise UsageError(f"{path} is truncated or padded: its header promises {expected} bytes, it has "
                         f"{len(data)}; download it again")
    return np.frombuffer(data, dtype=dtype, offset=4 + 4 * ndim).reshape(shape)


def find_mnist_file(data_dir, name):
    """`name` or `name.gz`, directly in data_dir or in data_dir/MNIST/raw; None if absent."""
    for folder in (data_dir, os.path.join(data_dir, "MNIST", "raw")):
        for candidate in (name, name + ".gz"):
            path = os.path.join(folder, candidate)
            if os.path.isfile(path):
                return path
    return None


def load_mnist(data_dir, split):
    """(images uint8 [N, 28, 28], labels int64 [N]) of the 'train' or 'test' split."""
    paths = []
    for name in MNIST_FILES[split]:
        path = find_mnist_file(data_dir, name)
        if path is None:
            raise UsageError(f"MNIST file {name}[.gz] not found in {data_dir} or {data_dir}/MNIST/raw; "
                             "put the IDX files there (from the MNIST site or a torchvision download); this "
                             "repository's data/mnist holds the test set")
        paths.append(path)
    images, labels = (read_idx(path) for path in paths)
    if images.ndim != 3 or images.shape[1:] != (28, 28):
        raise UsageError(f"{paths[0]} holds images of shape {images.shape[1:]}, not 28x28")
    if labels.ndim != 1 or len(labels) != len(images):
        raise UsageError(f"{paths[1]} has {len(labels)} labels for the {len(images)} images of {paths[0]}; "
                         "the files do not belong together")
    return images, labels.astype(np.int64)


MEAN, STD = 0.1307, 0.3081  # of the MNIST training pixels scaled to 0..1


def mnist_pixels(images):
    """uint8 images (N, 28, 28) in a numpy array -> normalised float32 (N, 1, 28, 28), as SimpleCNN takes them."""
    pixels = torch.from_numpy(np.require(images, requirements="W")).reshape(len(images), 1, 28, 28)
    return (pixels.float() / 255 - MEAN) / STD


def write_idx(path, array):
    """Write an IDX file (gzipped if path ends in .gz): how tests and users make small MNIST subsets."""
    codes = {np.dtype(v).newbyteorder(">") if np.dtype(v).itemsize > 1 else np.dtype(v): k
             for k, v in IDX_DTYPES.items()}
    dtype = array.dtype.newbyteorder(">") if array.dtype.itemsize > 1 else array.dtype
    header = bytes([0, 0, codes[dtype], array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(header + array.astype(dtype).tobytes())


TEST_SPLIT = (8000, 2000)  # the official test set, split to train and evaluate when the training files are absent


def split_test_set(images, labels):
    """The 10,000 test images and labels in a fixed random order (seed 0), cut into 8,000 to train on and 2,000
    to evaluate on: ((train images, train labels), (eval images, eval labels))."""
    order = np.random.default_rng(0).permutation(len(images))
    train, held_out = order[:TEST_SPLIT[0]], order[TEST_SPLIT[0]:]
    return (images[train], labels[train]), (images[held_out], labels[held_out])


def has_training_files(data_dir):
    """Whether data_dir holds the training split; with one of its two files there, the other is missing (an
    error when loaded), not a test-set-only folder."""
    return any(find_mnist_file(data_dir, name) for name in MNIST_FILES["train"])


def load_mnist_arrays(data_dir):
    """((train images, labels), (eval images, labels), note): the official split if data_dir holds all four files;
    with only the two t10k files, the test set split 8,000 / 2,000, and a note that says so (None otherwise)."""
    if has_training_files(data_dir):
        return load_mnist(data_dir, "train"), load_mnist(data_dir, "test"), None
    train, held_out = split_test_set(*load_mnist(data_dir, "test"))
    note = (f"{data_dir} holds only the MNIST test set: training on {len(train[0]):,} of its images and evaluating "
            f"on the other {len(held_out[0]):,} (a fixed split, seed 0)")
    return train, held_out, note


def mnist_tensors(data_dir):
    """(train, eval, note) as TensorDatasets of normalised images (N, 1, 28, 28) and int64 labels."""
    train, held_out, note = load_mnist_arrays(data_dir)
    return (*(TensorDataset(mnist_pixels(x), torch.from_numpy(y)) for x, y in (train, held_out)), note)


HUB_DATASET = "ylecun/mnist"
GET_THE_DATA = ("give --data_dir DIR with the MNIST IDX files (this repository's data/mnist holds the test set; the "
                "full set adds train-images-idx3-ubyte[.gz] and train-labels-idx1-ubyte[.gz]) or a DatasetDict "
                "written by save_to_disk")


def load_mnist_splits(data_dir=None, cache_dir=None):
    """(DatasetDict with "train" and "test", note) from --data_dir, or from the Hub (cached in cache_dir or
    datasets' own cache). The note says which split a test-set-only folder gave, None otherwise."""
    note = None
    if data_dir is None:
        splits = _from_hub(cache_dir)
    elif not os.path.isdir(data_dir):
        raise UsageError(f"--data_dir {data_dir} is not a directory; {GET_THE_DATA}")
    elif os.path.isfile(os.path.join(data_dir, "dataset_dict.json")):
        splits = _from_disk(data_dir)
    else:
        train, held_out, note = load_mnist_arrays(data_dir)
        splits = DatasetDict({"train": _arrow(*train), "test": _arrow(*held_out)})
    # Rows come out as numpy arrays whatever the source stores (PIL images from the Hub, flat pixels here).
    return splits.with_format("numpy"), note


def _from_hub(cache_dir):
    if not constants.HF_HUB_OFFLINE:
        # Without a network the Hub client retries for half a minute before giving up: ask once instead.
        try:
            get_session().head(constants.ENDPOINT, timeout=10)
        except Exception as error:  # whatever the HTTP client raises: no DNS, refused, timeout, proxy
            raise UsageError(f"cannot reach {constants.ENDPOINT} to download {HUB_DATASET} ({one_line(error)}); "
                             f"{GET_THE_DATA}, or set HF_HUB_OFFLINE=1 to use a copy downloaded earlier") from None
    try:
        splits = load_dataset(HUB_DATASET, cache_dir=cache_dir)
    except ConnectionError as error:  # also what offline mode raises when nothing is cached
        raise UsageError(f"cannot load {HUB_DATASET} ({one_line(error)}); {GET_THE_DATA}") from None
    return _checked(splits, HUB_DATASET)


def _from_disk(data_dir):
    try:
        splits = load_from_disk(data_dir)
    except (OSError, ValueError) as error:
        raise UsageError(f"cannot load the dataset saved in {data_dir} ({one_line(error)})") from None
    return _checked(splits, data_dir)


def _checked(splits, source):
    for split in ("train", "test"):
        if split not in splits:
            raise UsageError(f"{source} has no {split!r} split (it has {', '.join(splits) or 'none'}); "
                             "MNIST needs 'train' and 'test'")
        missing = {"image", "label"} - set(splits[split].column_names)
        if missing:
            raise UsageError(f"the {split!r} split of {source} lacks the column(s) {', '.join(sorted(missing))}")
    return splits


def _arrow(images, labels):
    # Straight into Arrow without copying: Dataset.from_dict would take half a minute for 60,000 images.
    pixels = pa.FixedSizeListArray.from_arrays(pa.array(images.reshape(-1)), 28 * 28)
    return Dataset(pa.table({"image": pixels, "label": pa.array(labels)}))


def collate(rows):
    """Rows of the DatasetDict -> {"image": float (B, 1, 28, 28), normalised, "labels": int64 (B)}."""
    labels = torch.tensor(np.array([row["label"] for row in rows]), dtype=torch.int64)
    return {"image": mnist_pixels(np.stack([row["image"] for row in rows])), "labels": labels}
