"""Synthetic datasets: identical on every rank, and learnable (MNIST: ddp_common.mnist).

Every rank builds the synthetic data from the same seed with its own generator, so the
DistributedSampler shards one dataset instead of each rank training on different random numbers
(which is what happens upstream, where each process draws its own dataset from the global RNG).
"""
import torch
from torch.utils.data import TensorDataset


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
