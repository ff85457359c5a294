"""A sampler whose shards hold every sample on exactly one rank, evenly dealt or deliberately uneven, and what
training uneven shards without Join comes to.

DistributedSampler gives every rank a shard of the same length: it pads the last shards with samples from
the start of the dataset (or, with drop_last=True, leaves the tail out). Equal shards keep the ranks' collectives
in step, which training needs; but a metric summed over padded shards counts some samples twice, and one over
shortened shards skips some, so either changes with the world size (docs/features.md, exact evaluation).
"""
import contextlib

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from ddp_common.cli import is_transport_error
from ddp_common.errors import PeerLostError, UsageError


def shard_sizes(size, world_size, uneven=False):
    """How many of `size` samples each rank gets. Even: dealt round-robin, so shards differ by at most one.
    Uneven: shares proportional to rank + 1 (rank 1 twice rank 0's, ...), the last rank taking the remainder."""
    if not uneven:
        return [len(range(rank, size, world_size)) for rank in range(world_size)]
    weights = range(1, world_size + 1)
    sizes = [size * weight // sum(weights) for weight in weights]
    sizes[-1] += size - sum(sizes)
    return sizes


class ShardSampler(Sampler):
    """This rank's indices of `dataset`: every index on exactly one rank, with no padding and no dropped tail.

    Dealt round-robin as DistributedSampler deals them (rank r takes r, r + world_size, ...), or with
    uneven=True in contiguous pieces of shard_sizes(..., uneven=True). shuffle: a new order every epoch
    (set_epoch), from seed and epoch, the same on every rank; without it the dataset's own order."""

    def __init__(self, dataset, rank, world_size, shuffle=False, seed=0, uneven=False):
        self.size, self.rank, self.world_size = len(dataset), rank, world_size
        self.shuffle, self.seed, self.uneven = shuffle, seed, uneven
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        if self.shuffle:
            order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        else:
            order = torch.arange(self.size)
        if not self.uneven:
            return iter(order[self.rank::self.world_size].tolist())
        sizes = shard_sizes(self.size, self.world_size, uneven=True)
        start = sum(sizes[:self.rank])
        return iter(order[start:start + sizes[self.rank]].tolist())

    def __len__(self):
        return shard_sizes(self.size, self.world_size, self.uneven)[self.rank]

    def batches_per_rank(self, batch_size):
        """Every rank's number of batches of `batch_size` (the last one may be short), in rank order."""
        return [-(-size // batch_size) for size in shard_sizes(self.size, self.world_size, self.uneven)]


@contextlib.contextmanager
def without_join(batches_per_rank, timeout):
    """Train uneven shards without Join, to see what that comes to, and stop with one line that says so.

    A rank that runs out of batches goes on to the epoch's next collective while the others are still in
    their gradient all-reduces. gloo pairs collectives by their order, so that all-reduce would meet a gradient
    bucket of another size and abort the process (SIGABRT, "Received data size doesn't match expected size");
    NCCL does not check sizes. Here the early rank waits at a barrier instead (gloo keeps barriers apart from
    all-reduces): the others wait for an all-reduce it never joins, and every rank stops after --timeout."""
    try:
        yield
        dist.barrier()
    except (dist.DistError, RuntimeError) as error:
        if not isinstance(error, dist.DistError) and not is_transport_error(error):
            raise
        seconds = timeout.total_seconds()
        raise PeerLostError(
            f"the ranks have different numbers of batches ({', '.join(map(str, batches_per_rank))}, ranks 0 to "
            f"{len(batches_per_rank) - 1}) and train without Join: the ranks with more batches waited --timeout "
            f"{seconds:g}s for an all-reduce that the others never joined; train with Join "
            "(leave out --no_join), or give every rank the same number of batches (DistributedSampler)") from None


def split_evenly(count, parts):
    """`count` items in `parts` contiguous pieces whose sizes differ by at most one, the larger first."""
    return [count // parts + (part < count % parts) for part in range(parts)]


class GlobalOrderSampler:
    """This rank's batches, cut from one order of the whole dataset per epoch, with a position in that order that
    means the same at any world size: what a mid-epoch checkpoint must hold to resume exactly, or at another world
    size with every sample once.

    Each epoch has one order of all `size` samples (a permutation from seed and epoch, the same on every rank and
    at any world size). A step takes the next `global_batch` samples of it and gives each rank a contiguous piece
    (sizes differ by at most one, so any global batch suits any world size). `position` counts the samples of the
    epoch that steps have used: restored from a checkpoint with set_epoch(epoch, position), iteration goes on
    with the next sample of the order. Use it as DataLoader(dataset, sampler=it, batch_size=None) with a dataset
    that takes a list of indices (TensorDataset does): a rank whose piece of a short last step is empty gets
    empty tensors, and still takes part in the step's collectives."""

    def __init__(self, size, rank, world_size, global_batch, seed=0):
        self.size, self.rank, self.world_size = size, rank, world_size
        self.global_batch, self.seed = global_batch, seed
        self.epoch, self.position = 0, 0

    def set_epoch(self, epoch, position=0):
        self.epoch, self.position = epoch, position

    def check_snapshot(self, state, path):
        """A UsageError when the snapshot `state` (read from `path`) was made with another dataset size or seed: its
        position counts into another epoch's order, and would mean nothing here."""
        for key, here in (("dataset_size", self.size), ("seed", self.seed)):
            if state.get(key, here) != here:  # a snapshot without the key predates it: nothing to compare
                raise UsageError(f"{path} was made with another {key.replace('_', ' ')} ({state[key]}, here {here}): "
                                 "its position means nothing here; move it away to start afresh")

    def order(self):
        return torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch))

    def step_sizes(self):
        """The global sizes of the steps left in this epoch, from `position` on."""
        return [min(self.global_batch, self.size - start) for start in range(self.position, self.size, self.global_batch)]

    def __len__(self):
        return len(self.step_sizes())

    def __iter__(self):
        order = self.order()
        for start in range(self.position, self.size, self.global_batch):
            step = order[start:start + self.global_batch]
            pieces = split_evenly(len(step), self.world_size)
            first = sum(pieces[:self.rank])
            yield step[first:first + pieces[self.rank]].tolist()
