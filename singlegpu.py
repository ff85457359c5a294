"""Step 1 of the DDP tutorial: one device (the GPU if there is one), with snapshots to resume from.

    python singlegpu.py 50 10          # TOTAL_EPOCHS SAVE_EVERY, or --total_epochs 50 --save_every 10

Each step is the one before plus its lesson, so read the steps as diffs (README: the DDP tutorial series):
`diff -u singlegpu.py multigpu.py`, then multigpu.py -> multigpu_torchrun.py -> multinode.py.
"""
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from ddp_common import cli, snapshot
from ddp_common.data import regression_dataset
from ddp_common.distributed import summary_line, synchronize
from ddp_common.models import MLP


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path, device):
        self.device = device
        self.model = model.to(device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.logs = self.saves = True  # the only process: it prints and writes the snapshots
        self.epochs_run = snapshot.load(snapshot_path, self.model, self.optimizer)
        if self.epochs_run:
            self.log(f"Resuming from {snapshot_path} at epoch {self.epochs_run}")

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(self.model(source), targets)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def _run_epoch(self, epoch):
        # Summed on the device and read once per epoch: a .item() per step would stall every step.
        loss_sum = torch.zeros((), device=self.device)
        for source, targets in self.train_data:
            source, targets = source.to(self.device), targets.to(self.device)
            loss_sum += self._run_batch(source, targets)
        mean_loss = loss_sum.item() / len(self.train_data)
        self.log(f"Epoch {epoch} | Batchsize {self.train_data.batch_size} | Steps {len(self.train_data)} | "
                 f"Loss {mean_loss:.6f}")
        return mean_loss

    def train(self, max_epochs):
        if self.epochs_run >= max_epochs:
            self.log(f"Nothing to do: {self.snapshot_path} already holds {self.epochs_run} epochs "
                     f"(--total_epochs {max_epochs}); raise --total_epochs to train on")
            return
        start = time.perf_counter()
        for epoch in range(self.epochs_run, max_epochs):
            loss = self._run_epoch(epoch)
            epochs_done = epoch + 1
            if self.saves and (epochs_done % self.save_every == 0 or epochs_done == max_epochs):
                snapshot.save(self.snapshot_path, self.model, self.optimizer, epochs_done)
                self.log(f"Epoch {epoch} | Snapshot saved at {self.snapshot_path}")
        synchronize(self.device)  # the GPU runs asynchronously: the clock must wait for it
        wall = time.perf_counter() - start
        epochs = max_epochs - self.epochs_run
        samples = epochs * len(self.train_data.dataset)
        self.log(summary_line(epochs, epochs * len(self.train_data), loss, samples, wall))

    def log(self, text):
        if self.logs:
            print(text)


def load_train_objs(seed):
    torch.manual_seed(seed)
    train_set = regression_dataset(2048, seed=seed)
    model = MLP(input_size=20)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return train_set, model, optimizer


def main(args):
    accelerator = torch.accelerator.current_accelerator()  # the GPU's kind (cuda, ...); None without one
    device = torch.device(accelerator.type, 0) if accelerator else torch.device("cpu")
    dataset, model, optimizer = load_train_objs(args.seed)
    # Shuffling draws from the global RNG, whose state the snapshot keeps: a resumed run sees the same order.
    train_data = DataLoader(dataset, batch_size=args.batch_size, shuffle=True)
    trainer = Trainer(model, train_data, optimizer, args.save_every, args.snapshot_path, device)
    trainer.train(args.total_epochs)


if __name__ == "__main__":
    parser = cli.ArgumentParser(description="Step 1: training on one device.")
    cli.add_training_args(parser)
    cli.run(main, cli.training_args(parser))
