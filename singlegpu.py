"""Step 1 of the DDP tutorial: one device (the GPU if there is one), with snapshots to resume from.

    python singlegpu.py 50 10          # TOTAL_EPOCHS SAVE_EVERY; writes singlegpu.pt, and resumes from it

Each step is the one before plus its lesson: `diff -u` it against the one before (docs/tutorial.md).
"""
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from ddp_common import cli, snapshot
from ddp_common.data import regression_dataset
from ddp_common.models import MLP
from ddp_common.progress import summary_line


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path, device):
        self.device = device
        self.model = model.to(device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.epochs_run = 0
        # The snapshot, if there is one (None: a fresh start). The process that saves checks now, not at the first
        # save, that it can write it and that no other run is writing it.
        state = snapshot.claim(snapshot_path, saves=True)
        if state is not None:
            self._load_snapshot(state)

    def log(self, text):
        print(text)  # the only process: it speaks

    def _save_snapshot(self, epoch):
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "rng": torch.get_rng_state(),
            "epochs_run": epoch + 1,
        }
        snapshot.save(state, self.snapshot_path)  # atomically: a crash mid-save leaves the previous snapshot whole
        self.log(f"Epoch {epoch} | Snapshot saved at {self.snapshot_path}")

    def _load_snapshot(self, state):
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])  # the momentum, without which resuming is not exact
        torch.set_rng_state(state["rng"])  # the shuffle order of the epochs to come
        self.epochs_run = state["epochs_run"]
        self.log(f"Resuming from {self.snapshot_path} at epoch {self.epochs_run}")

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
            if (epoch + 1) % self.save_every == 0 or epoch + 1 == max_epochs:
                self._save_snapshot(epoch)
        wall = time.perf_counter() - start  # loss.item() above waited for the device
        epochs = max_epochs - self.epochs_run
        samples = epochs * len(self.train_data.dataset)
        self.log(summary_line(epochs, epochs * len(self.train_data), loss, samples, wall))


def load_train_objs(seed):
    torch.manual_seed(seed)
    train_set = regression_dataset(2048, seed=seed)
    model = MLP(input_size=20)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return train_set, model, optimizer


def main(args):
    # check_available=True: without it, a CUDA build of torch (PyPI's default on Linux) says cuda without a GPU.
    accelerator = torch.accelerator.current_accelerator(check_available=True)  # None without a usable GPU
    device = torch.device(accelerator.type, 0) if accelerator else torch.device("cpu")
    print(f"Training on 1 process | device {device.type}")
    dataset, model, optimizer = load_train_objs(args.seed)
    # Shuffling draws from the global RNG, whose state the snapshot keeps: a resumed run sees the same order.
    train_data = DataLoader(dataset, batch_size=args.batch_size, shuffle=True)
    trainer = Trainer(model, train_data, optimizer, args.save_every, args.snapshot_path, device)
    trainer.train(args.total_epochs)


if __name__ == "__main__":
    parser = cli.training_parser(__doc__)
    cli.run(main, parser)
