"""A linear classifier trained with DDP under torchrun: loss and accuracy reduced over all ranks each epoch,
an exact evaluation on held-out data, gradient accumulation with no_sync, mixed precision, uneven shards with
Join, gradient compression, a sharded optimizer, and snapshots to resume from.

    torchrun --nproc_per_node=2 --nnodes=1 --node_rank=0 --master_addr=127.0.0.1 --master_port=29500 \
        torchrun_ddp.py --backend gloo --total_epochs 5 --batch_size 64 --input_size 100
    torchrun --standalone --nproc_per_node=gpu torchrun_ddp.py --total_epochs 5      # every GPU, nccl
    # the same weights as --batch_size 64 (up to float rounding), with a quarter of the activations in memory:
    torchrun --standalone --nproc_per_node=2 torchrun_ddp.py --batch_size 16 --accumulation_steps 4
    # bf16 autocast (fp16 with a GradScaler on GPUs without bf16); started again, it resumes from linear.pt:
    torchrun --standalone --nproc_per_node=2 torchrun_ddp.py --amp
    # the held-out figure of linear.pt's model alone; it is the same at any world size:
    torchrun --standalone --nproc_per_node=3 torchrun_ddp.py --evaluate
    # ranks with different numbers of batches (rank 1 twice rank 0's), trained with Join:
    torchrun --standalone --nproc_per_node=2 torchrun_ddp.py --uneven --snapshot_path uneven.pt
    # the same without Join: the ranks wait for each other until --timeout, then stop with one line
    torchrun --standalone --nproc_per_node=2 torchrun_ddp.py --uneven --no_join --timeout 10 --snapshot_path x.pt
    # send less: gradients as rank-1 factors after 10 plain steps, optimizer state sharded over the ranks:
    torchrun --standalone --nproc_per_node=2 torchrun_ddp.py --comm_hook powersgd --zero --snapshot_path p.pt

Every rank builds the same dataset from --seed and DistributedSampler hands each rank its own shard, so an
optimizer step sees batch_size * accumulation_steps * world_size samples in all. After every epoch each rank
scores its own part of a held-out set and one all-reduce adds up the counts, each sample counted once.
"""
import contextlib
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ddp_common import cli, comm_hooks, sharding, snapshot
from ddp_common.data import classification_splits
from ddp_common.distributed import (check_backend, group_store, optimizer_state_bytes, require_torchrun, summary_line,
                                    synchronize)
from ddp_common.errors import UsageError
from ddp_common.models import LinearClassifier
from ddp_common.sharding import ShardSampler

DATASET_SIZE = 4096
EVAL_SIZE = 1001  # 7 x 11 x 13: neither 2 nor 3 ranks divide it, so DistributedSampler would pad it at both


def amp_dtype(device):
    """bf16 where the hardware has it: same exponent range as fp32, so no loss scaling is needed."""
    if device.type == "cpu" or torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float16


class Trainer:
    def __init__(self, model, train_data, eval_data, optimizer, args, device, rank):
        self.rank = rank
        self.device = device
        self.model = model.to(device)
        self.train_data = train_data
        self.eval_data = eval_data
        self.optimizer = optimizer
        self.accumulation_steps = args.accumulation_steps
        self.snapshot_path = args.snapshot_path
        self.save_every = args.save_every
        self.replica_dir = args.replica_dir
        self.uneven, self.join, self.timeout = args.uneven, not args.no_join, args.timeout
        shards = sharding.shard_sizes(len(train_data.dataset), dist.get_world_size(), args.uneven)
        self.batches_per_rank = [math.ceil(size / train_data.batch_size) for size in shards]
        self.autocast_dtype = amp_dtype(device) if args.amp else None
        # fp16 gradients underflow without loss scaling; with bf16 or fp32 the scaler is a no-op passthrough.
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.autocast_dtype == torch.float16)
        saved = snapshot.read(self.snapshot_path)  # None: a fresh start
        self.epochs_run = snapshot.restore(saved, self.snapshot_path, self.model, self.optimizer,
                                           scaler=self.scaler) if saved else 0
        if self.epochs_run and rank == 0:
            print(f"Resuming from {self.snapshot_path} at epoch {self.epochs_run}")
        self.model = DDP(self.model, device_ids=[device.index] if device.type != "cpu" else None)
        # --comm_hook: what DDP sends per step instead of the fp32 gradients (README: sending less).
        self.comm_hook = comm_hooks.CommHook(args.comm_hook, args.powersgd_rank, args.powersgd_warmup)
        hook = self.comm_hook.prepare(self.model)  # (state, hook); None for none, DDP's own all-reduce
        if hook is not None:
            self.model.register_comm_hook(*hook)
        # PowerSGD's error feedback differs between ranks: the snapshot holds every rank's.
        note = saved and self.comm_hook.restore(saved.get("comm_hook"))
        if note and rank == 0:
            print(f"Note: {note}")

    def _forward(self, source):
        if self.autocast_dtype is None:
            return self.model(source)
        with torch.autocast(self.device.type, dtype=self.autocast_dtype):
            return self.model(source)

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        # [loss sum, correct, samples] stay on the device: reading them every step (.item()) would stall
        # the GPU once per step; one all_reduce at the end of the epoch is all the printout needs.
        stats = torch.zeros(3, device=self.device)
        micro_batches = len(self.train_data)
        samples_per_rank = len(self.train_data.sampler)
        step_samples = self.train_data.batch_size * self.accumulation_steps
        with self._uneven_shards():
            self._train_on_batches(stats, micro_batches, samples_per_rank, step_samples)
        if self.uneven and self.join:
            sharding.broadcast_training_state(sharding.last_to_finish(self.batches_per_rank), self.optimizer,
                                              self.scaler)
        dist.all_reduce(stats)  # sums of loss, correct and samples over all ranks
        loss_sum, correct, samples = stats.tolist()
        return loss_sum / samples, correct / samples, int(samples)

    def _uneven_shards(self):
        """What lets ranks with different numbers of batches train together (README: uneven data)."""
        if not self.uneven:
            return contextlib.nullcontext()  # DistributedSampler gave every rank the same number of batches
        if self.join:
            # A rank that has run out of batches shadows the others' collectives (it all-reduces zeros) until
            # every rank has run out; then all take the weights of the rank that finished last.
            return Join([self.model])
        return sharding.without_join(self.batches_per_rank, self.timeout)

    def _train_on_batches(self, stats, micro_batches, samples_per_rank, step_samples):
        for i, (source, targets) in enumerate(self.train_data):
            source, targets = source.to(self.device), targets.to(self.device)
            first_of_step = i % self.accumulation_steps == 0
            last_of_step = (i + 1) % self.accumulation_steps == 0 or i + 1 == micro_batches
            if first_of_step:
                self.optimizer.zero_grad(set_to_none=True)
            # The loss is averaged over the whole step, not the micro-batch: dividing each micro-batch's
            # sum by the step's sample count is the usual loss / K for a full step, and also weights a
            # short last step exactly as one batch of the same samples would be.
            in_step = min(step_samples, samples_per_rank - (i // self.accumulation_steps) * step_samples)
            # no_sync: backward only adds into .grad; the last micro-batch's backward all-reduces the sum.
            with contextlib.nullcontext() if last_of_step else self.model.no_sync():
                logits = self._forward(source).float()
                loss = F.cross_entropy(logits, targets, reduction="sum")
                self.scaler.scale(loss / in_step).backward()
            if last_of_step:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            stats[0] += loss.detach()
            stats[1] += (logits.argmax(dim=1) == targets).sum()
            stats[2] += len(targets)

    def evaluate(self):
        """Loss and accuracy on the held-out set, every sample counted once: each rank scores its own shard
        (ShardSampler: no padding, no dropped tail) and one all-reduce adds up the sums. The plain model, not
        the DDP wrapper: evaluation needs no collective per batch, so shards of different lengths cannot
        leave one rank waiting for another."""
        model = self.model.module
        model.eval()
        stats = torch.zeros(3, device=self.device)  # loss sum, correct, samples
        with torch.no_grad():
            for source, targets in self.eval_data:
                source, targets = source.to(self.device), targets.to(self.device)
                logits = model(source).float()
                stats[0] += F.cross_entropy(logits, targets, reduction="sum")
                stats[1] += (logits.argmax(dim=1) == targets).sum()
                stats[2] += len(targets)
        model.train()
        dist.all_reduce(stats)
        loss_sum, correct, samples = stats.tolist()
        return loss_sum / samples, int(correct), int(samples)

    def print_evaluation(self, epochs):
        loss, correct, samples = self.evaluate()
        if self.rank == 0:
            print(f"Eval | epochs {epochs} | loss {loss:.6f} | accuracy {correct / samples:.4f} | "
                  f"{correct} of {samples} correct")

    def train(self, max_epochs):
        if self.epochs_run >= max_epochs:
            if self.rank == 0:
                print(f"Nothing to do: {self.snapshot_path} already holds {self.epochs_run} epochs "
                      f"(--total_epochs {max_epochs}); raise --total_epochs to train on")
            return
        steps_per_epoch = -(-len(self.train_data) // self.accumulation_steps)
        if self.rank == 0:
            print(f"{dist.get_world_size()} ranks | {steps_per_epoch} steps per epoch of {self.accumulation_steps} "
                  f"x {self.train_data.batch_size} samples per rank | "
                  f"amp {self.autocast_dtype or 'off'} | device {self.device}")
            if self.uneven:
                print(f"Uneven shards: {', '.join(map(str, self.batches_per_rank))} batches on ranks 0 to "
                      f"{len(self.batches_per_rank) - 1} | {'Join' if self.join else 'no Join'}")
        loss, samples = float("nan"), 0
        synchronize(self.device)
        start = time.perf_counter()
        for epoch in range(self.epochs_run, max_epochs):
            epoch_start = time.perf_counter()
            loss, accuracy, epoch_samples = self._run_epoch(epoch)  # .tolist() has waited for the device
            samples += epoch_samples
            if self.rank == 0:
                print(f"Epoch {epoch} | loss {loss:.6f} | accuracy {accuracy:.4f} | samples {epoch_samples} | "
                      f"{time.perf_counter() - epoch_start:.2f}s")
            epochs_done = epoch + 1
            self.print_evaluation(epochs_done)
            if epochs_done % self.save_every == 0 or epochs_done == max_epochs:
                self.save(epoch)
        synchronize(self.device)
        wall = time.perf_counter() - start
        epochs = max_epochs - self.epochs_run
        if self.rank == 0:
            print(summary_line(epochs, epochs * steps_per_epoch, loss, samples, wall))
        self.print_communication()
        if self.replica_dir:  # what every rank holds at the end, to check that the replicas agree
            os.makedirs(self.replica_dir, exist_ok=True)
            optimizer = getattr(self.optimizer, "optim", self.optimizer)  # under --zero, this rank's shard
            torch.save({"model": self.model.module.state_dict(), "optimizer": optimizer.state_dict()},
                       os.path.join(self.replica_dir, f"rank{self.rank}.pt"))

    def save(self, epoch):
        """Every rank takes part: ZeRO gathers the shards of the optimizer state on rank 0, and PowerSGD the
        error feedback of every rank. Every rank holds the same weights: one copy on disk is enough."""
        if isinstance(self.optimizer, ZeroRedundancyOptimizer):
            self.optimizer.consolidate_state_dict(to=0)
        hook_states = self.comm_hook.gather_state()
        if self.rank == 0:
            snapshot.save(self.snapshot_path, self.model, self.optimizer, epoch + 1, scaler=self.scaler,
                          comm_hook=hook_states)
            print(f"Epoch {epoch} | Snapshot saved at {self.snapshot_path}")

    def print_communication(self):
        """What each rank sent per step, and the optimizer state each holds (a share of it under --zero)."""
        held = torch.tensor([optimizer_state_bytes(self.optimizer)], device=self.device)
        every = [torch.zeros_like(held) for _ in range(dist.get_world_size())]
        dist.all_gather(every, held)
        if self.rank == 0:
            print(f"Communication | hook {self.comm_hook.name} | {self.comm_hook.bytes_per_step()} bytes all-reduced "
                  f"per step and rank ({self.comm_hook.full_bytes} without a hook)")
            print(f"Optimizer state | {', '.join(str(int(b)) for b in every)} bytes on ranks 0 to {len(every) - 1} "
                  f"({int(sum(every))} in all) | {type(self.optimizer).__name__}")


def main(args):
    if args.no_join and not args.uneven:
        raise UsageError("--no_join only matters with --uneven: evenly sharded ranks never wait for each other")
    if args.evaluate and not os.path.exists(args.snapshot_path):
        raise UsageError(f"--evaluate: no snapshot at {args.snapshot_path} to evaluate; train first, or pass the "
                         "--snapshot_path of a trained model")
    comm_hooks.check(args.comm_hook, args.powersgd_warmup)
    require_torchrun(__file__)
    # torchrun numbers the processes: RANK across all nodes, LOCAL_RANK on this node (it picks the GPU).
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size, local_world_size = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    accelerator = torch.accelerator.current_accelerator()  # the GPU's kind (cuda, ...); None without one
    device = torch.device(accelerator.type, local_rank) if accelerator else torch.device("cpu")
    backend = check_backend(args.backend or dist.get_default_backend_for_device(device), device, local_world_size)
    if accelerator:  # before the process group, so NCCL binds this process to its own GPU
        torch.accelerator.set_device_index(device.index)
    # A store of this group's own: torchrun's outlives a restart with the old group's keys (README: restarts).
    dist.init_process_group(backend, store=group_store(rank, world_size, args.timeout), rank=rank,
                            world_size=world_size, timeout=args.timeout, device_id=device if accelerator else None)
    # The same on every rank: a training set and a held-out set of the same problem.
    train_set, eval_set = classification_splits(DATASET_SIZE, EVAL_SIZE, args.input_size, seed=args.seed)
    torch.manual_seed(args.seed)
    model = LinearClassifier(args.input_size)
    if args.zero:  # each rank keeps the momentum of its share of the weights, steps them and broadcasts them
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=args.lr,
                                            momentum=0.9)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # --uneven: rank r gets a share of the training set proportional to r + 1, so the ranks run different numbers
    # of batches. DistributedSampler instead pads the last shards with repeated samples to equal lengths.
    sampler = (ShardSampler(train_set, rank, world_size, shuffle=True, seed=args.seed, uneven=True) if args.uneven
               else DistributedSampler(train_set, seed=args.seed))
    train_data = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    eval_data = DataLoader(eval_set, batch_size=args.batch_size, sampler=ShardSampler(eval_set, rank, world_size))
    trainer = Trainer(model, train_data, eval_data, optimizer, args, device, rank)
    if args.evaluate:
        trainer.print_evaluation(trainer.epochs_run)
    else:
        trainer.train(args.total_epochs)
    # DDP, ZeroRedundancyOptimizer (and Join, through them) hold the process group: free them first, so that
    # destroy_process_group frees the group.
    del trainer, optimizer
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = cli.ArgumentParser(description="A linear classifier with DDP under torchrun.")
    cli.add_training_args(parser, total_epochs=5, save_every=1, batch_size=64, positional=False,
                          snapshot_path="linear.pt")
    cli.add_linear_args(parser)
    parser.add_argument("--accumulation_steps", type=cli.positive_int, default=1,
                        help="micro-batches whose gradients add up before one all-reduce and optimizer step")
    parser.add_argument("--amp", action="store_true",
                        help="autocast to bf16 (fp16 with loss scaling on GPUs without bf16)")
    parser.add_argument("--evaluate", action="store_true",
                        help="only evaluate the snapshot's model on the held-out set, then exit")
    parser.add_argument("--uneven", action="store_true",
                        help="give rank r a share of the data proportional to r + 1 and train with Join")
    parser.add_argument("--no_join", action="store_true",
                        help="with --uneven, train without Join: the ranks wait for each other until --timeout")
    parser.add_argument("--replica_dir",
                        help="at the end every rank writes its model and optimizer state to DIR/rank<R>.pt")
    cli.add_comm_hook_args(parser)  # --comm_hook, --powersgd_rank, --powersgd_warmup
    parser.add_argument("--zero", action="store_true",
                        help="shard the optimizer state over the ranks (ZeroRedundancyOptimizer)")
    cli.add_distributed_args(parser)
    cli.run(main, cli.training_args(parser))
