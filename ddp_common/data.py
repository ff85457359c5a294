"""Datasets: synthetic ones that are identical on every rank and learnable, and MNIST from its IDX files.

Every rank builds the synthetic data from the same seed with its own generator, so the
DistributedSampler shards one dataset instead of each rank training on different random numbers
(which is what happens upstream, where each process draws its own dataset from the global RNG).
"""
import gzip
import os
import struct

import numpy as np
import torch
from torch.utils.data import TensorDataset

from ddp_common.errors import UsageError


def regression_dataset(size=2048, input_size=20, seed=0, noise=0.05):
    """Inputs x ~ N(0, 1) and targets from a fixed random teacher network plus noise: an MLP can learn
    it, so its MSE falls from about 1 towards noise**2."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(size, input_size, generator=generator)
    hidden = torch.randn(input_size, 16, generator=generator) / input_size ** 0.5
    out = torch.randn(16, 1, generator=generator)
    y = torch.tanh(2 * x @ hidden) @ out / 2 + noise * torch.randn(size, 1, generator=generator)
    return TensorDataset(x, y)


def classification_dataset(size=4096, input_size=100, seed=0, label_noise=0.05):
    """Two classes split by a fixed hidden hyperplane, with a fraction `label_noise` of labels flipped:
    a linear classifier can reach about 1 - label_noise accuracy, chance is 0.5."""
    return classification_splits(size, 0, input_size, seed, label_noise)[0]


def classification_splits(size, held_out, input_size=100, seed=0, label_noise=0.05):
    """(training set, held-out set) of the same problem. The training set is classification_dataset(size, ...)
    to the bit; the `held_out` samples are drawn after it from the same generator, so none of them is in it."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(size, input_size, generator=generator)
    direction = torch.randn(input_size, generator=generator)

    def labelled(x):
        labels = (x @ direction > 0).long()
        flip = torch.rand(len(x), generator=generator) < label_noise
        return TensorDataset(x, torch.where(flip, 1 - labels, labels))

    train = labelled(x)
    return train, labelled(torch.randn(held_out, input_size, generator=generator))


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
                             "put the four IDX files there (from the MNIST site or a torchvision download)")
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


def mnist_test_split(data_dir, train_size=8000):
    """The official MNIST test set (its two t10k files in data_dir) split at random, seed 0, into `train_size`
    images to train on and the rest to evaluate on, as (train, held-out) TensorDatasets of normalised images:
    the 8,000 / 2,000 split of the tests (tests/conftest.py, mnist_dir)."""
    images, labels = load_mnist(data_dir, "test")
    order = np.random.default_rng(0).permutation(len(images))
    x, y = mnist_pixels(images), torch.from_numpy(labels)
    train, held_out = torch.from_numpy(order[:train_size]), torch.from_numpy(order[train_size:])
    return TensorDataset(x[train], y[train]), TensorDataset(x[held_out], y[held_out])


def write_idx(path, array):
    """Write an IDX file (gzipped if path ends in .gz): how tests and users make small MNIST subsets."""
    codes = {np.dtype(v).newbyteorder(">") if np.dtype(v).itemsize > 1 else np.dtype(v): k
             for k, v in IDX_DTYPES.items()}
    dtype = array.dtype.newbyteorder(">") if array.dtype.itemsize > 1 else array.dtype
    header = bytes([0, 0, codes[dtype], array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(header + array.astype(dtype).tobytes())
