"""The models and data the examples share: small enough to train on a laptop CPU in seconds.

Every rank builds the synthetic datasets from one seed with a generator of its own: the DistributedSampler shards one
dataset. Copy this file beside an example you copy: it imports nothing but torch and the standard library.
"""
import gzip
import os
import struct
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset


class MLP(nn.Module):
    """The DDP tutorial's model: a small regression network (upstream uses nn.Linear(20, 1))."""

    def __init__(self, input_size=20, hidden_size=64, output_size=1):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(input_size, hidden_size), nn.ReLU(),
                                 nn.Linear(hidden_size, hidden_size), nn.ReLU(),
                                 nn.Linear(hidden_size, output_size))

    def forward(self, x):
        return self.net(x)


class Block(nn.Module):
    """One residual MLP block, as in a transformer: x + fc2(relu(fc1(norm(x))))."""

    def __init__(self, width, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.fc2(F.relu(self.fc1(self.norm(x))))


class BlockMLP(nn.Module):
    """The regression network made of repeated blocks (fsdp.py shards it block by block)."""

    def __init__(self, input_size=20, width=64, hidden=256, depth=4, output_size=1):
        super().__init__()
        self.inp = nn.Linear(input_size, width)
        self.blocks = nn.ModuleList(Block(width, hidden) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, output_size)

    def forward(self, x):  # a pipeline stage sets the parts it does not own to None: names stay the full model's
        x = x if self.inp is None else self.inp(x)
        for block in filter(None, self.blocks):
            x = block(x)
        return x if self.out is None else self.out(self.norm(x))


class LinearClassifier(nn.Module):
    """Logistic regression: one linear layer from the features to the class logits."""

    def __init__(self, input_size, num_classes=2):
        super().__init__()
        self.linear = nn.Linear(input_size, num_classes)

    def forward(self, x):
        return self.linear(x)


def regression_dataset(size=2048, input_size=20, seed=0, noise=0.05):
    """x ~ N(0, 1) and targets from a fixed random teacher network plus noise: an MLP can learn it, so its MSE
    falls from about 1 towards noise**2."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(size, input_size, generator=generator)
    hidden = torch.randn(input_size, 16, generator=generator) / input_size ** 0.5
    out = torch.randn(16, 1, generator=generator)
    y = torch.tanh(2 * x @ hidden) @ out / 2 + noise * torch.randn(size, 1, generator=generator)
    return TensorDataset(x, y)


def classification_splits(size, held_out=0, input_size=100, seed=0, label_noise=0.05):
    """(training set, held-out set): two classes split by a fixed hidden hyperplane, a fraction `label_noise` of
    the labels flipped (a linear classifier reaches about 1 - label_noise, chance is 0.5). The held-out samples
    are drawn after the training set from the same generator: the training set is the same whatever `held_out`."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(size, input_size, generator=generator)
    direction = torch.randn(input_size, generator=generator)

    def labelled(x):
        labels = (x @ direction > 0).long()
        flip = torch.rand(len(x), generator=generator) < label_noise
        return TensorDataset(x, torch.where(flip, 1 - labels, labels))

    train = labelled(x)
    return train, labelled(torch.randn(held_out, input_size, generator=generator))


def classification_dataset(size=4096, input_size=100, seed=0, label_noise=0.05):
    return classification_splits(size, 0, input_size, seed, label_noise)[0]


# MNIST as LeCun published it and torchvision keeps it (MNIST/raw/), read without torchvision.
MNIST_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
               "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


def read_idx(path):
    """An IDX file of bytes (plain or .gz) as a uint8 tensor, its header checked against its size; ValueError names
    a file that is not one."""
    try:
        with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
            data = f.read()
    except (gzip.BadGzipFile, EOFError, zlib.error) as error:  # gzip's own message does not name the file
        raise ValueError(f"{path} is not a whole gzip file ({error})") from None
    if len(data) < 4 or data[:3] != b"\x00\x00\x08":  # 0x08: unsigned bytes, what MNIST holds
        raise ValueError(f"{path} is not an IDX file of bytes (magic number {data[:4].hex() or 'none'})")
    start = 4 + 4 * data[3]
    shape = struct.unpack(f">{data[3]}I", data[4:start])
    if len(data) != start + torch.Size(shape).numel():
        raise ValueError(f"{path} is truncated or padded: its header promises {start + torch.Size(shape).numel()} "
                         f"bytes, it has {len(data)}")
    return torch.frombuffer(bytearray(data[start:]), dtype=torch.uint8).reshape(shape)


def mnist_file(data_dir, name):
    """data_dir/name[.gz] or data_dir/MNIST/raw/name[.gz]; FileNotFoundError naming what is missing."""
    for path in (os.path.join(folder, name + gz) for folder in (data_dir, os.path.join(data_dir, "MNIST", "raw"))
                 for gz in ("", ".gz")):
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"MNIST file {name}[.gz] not found in {data_dir} or {data_dir}/MNIST/raw")


def load_mnist(data_dir, split):
    """(images uint8 [N, 28, 28], labels int64 [N]) of the "train" or "test" split."""
    images, labels = (read_idx(mnist_file(data_dir, name)) for name in MNIST_FILES[split])
    if images.shape[1:] != (28, 28) or labels.shape != images.shape[:1]:
        raise ValueError(f"the {split} files in {data_dir} hold {tuple(images.shape)} images and "
                         f"{tuple(labels.shape)} labels: they do not belong together")
    return images, labels.long()


def mnist_splits(data_dir):
    """(train, held out, note) as (images, labels) pairs: the official split when data_dir holds all four files;
    with the two t10k files alone (this repository's data/mnist), the test set in a fixed order (seed 0) cut into
    8,000 images to train on and 2,000 to evaluate on, and a note that says so (None otherwise)."""
    for name in MNIST_FILES["train"]:  # either training file there: both must be (load_mnist names a missing one)
        try:
            mnist_file(data_dir, name)
            return load_mnist(data_dir, "train"), load_mnist(data_dir, "test"), None
        except FileNotFoundError as error:
            if name not in str(error):
                raise
    images, labels = load_mnist(data_dir, "test")
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(0))
    train, held_out = order[:8000], order[8000:]
    note = (f"{data_dir} holds only the MNIST test set: training on 8,000 of its images and evaluating on the "
            "other 2,000 (a fixed split, seed 0)")
    return (images[train], labels[train]), (images[held_out], labels[held_out]), note
