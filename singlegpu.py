"""Step 1 of the DDP tutorial: one device (the GPU if there is one), with snapshots to resume from.

    python singlegpu.py 50 10          # TOTAL_EPOCHS SAVE_EVERY; writes singlegpu.pt, and resumes from it

Each step is the one before plus its lesson: `diff -u` it against the one before (docs/tutorial.md).
"""
import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from models_and_data import MLP, regression_dataset


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path, device):
        self.device = device
        self.model = model.to(device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.epochs_run = 0
        if os.path.exists(snapshot_path):
            self._load_snapshot(snapshot_path)

    def log(self, text):
        print(text)  # the only process: it speaks

    def _save_snapshot(self, epoch):
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "rng": torch.get_rng_state(),
            "epochs_run": epoch + 1,
        }
        # Written beside it, then renamed over it: a crash mid-save leaves the previous snapshot whole.
        tmp = self.snapshot_path + ".tmp"
        with open(tmp, "wb") as f:
            torch.save(state, f)
            os.fsync(f.fileno())
        os.replace(tmp, self.snapshot_path)
        self.log(f"Epoch {epoch} | Snapshot saved at {self.snapshot_path}")

    def _load_snapshot(self, path):
        try:  # a bad file named in one line, not a traceback; training on would overwrite it
            state = torch.load(path, map_location="cpu")
        except Exception as error:  # noqa: BLE001  whatever a damaged file raises
            sys.exit(f"error: cannot read the snapshot {path} ({type(error).__name__}: truncated, or not a "
                     "snapshot); move it away or pass another --snapshot_path")
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])  # the momentum, without which resuming is not exact
        except (KeyError, RuntimeError, ValueError) as error:
            why = " ".join(str(error).split())[:300]  # torch's message, on one line
            sys.exit(f"error: the snapshot {path} is of another model or optimizer ({why}); move it away or pass "
                     "another --snapshot_path")
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
        self.log(f"Summary: epochs {epochs} | steps {epochs * len(self.train_data)} | final loss {loss:.6f} | "
                 f"samples/s {samples / wall:.1f} | wall {wall:.2f}s | world size 1 | backend none")


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
    check_snapshot_path(args.snapshot_path)
    print(f"Training on 1 process | device {device.type}")
    dataset, model, optimizer = load_train_objs(args.seed)
    # Shuffling draws from the global RNG, whose state the snapshot keeps: a resumed run sees the same order.
    train_data = DataLoader(dataset, batch_size=args.batch_size, shuffle=True)
    trainer = Trainer(model, train_data, optimizer, args.save_every, args.snapshot_path, device)
    trainer.train(args.total_epochs)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("epochs_arg", nargs="?", type=int, default=50, metavar="total_epochs", help="= --total_epochs")
    parser.add_argument("every_arg", nargs="?", type=int, default=10, metavar="save_every", help="= --save_every")
    parser.add_argument("--total_epochs", "--epochs", type=int, help="epochs in all (default 50)")
    parser.add_argument("--save_every", type=int, help="epochs between snapshots; the last is saved too (default 10)")
    parser.add_argument("--batch_size", type=int, default=32, help="samples per step and process (default 32)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data, the model and the shuffle")
    parser.add_argument("--snapshot_path", default="singlegpu.pt", help="resume from and save to this file")
    args = parser.parse_args(argv)
    args.total_epochs = args.epochs_arg if args.total_epochs is None else args.total_epochs
    args.save_every = args.every_arg if args.save_every is None else args.save_every
    if min(args.total_epochs, args.save_every, args.batch_size) <= 0:
        parser.error("--total_epochs, --save_every and --batch_size must be positive")
    return args


def check_snapshot_path(path):
    """Stop now, not after the first epochs, where the snapshot cannot be written."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        open(path + ".tmp", "wb").close()
        os.remove(path + ".tmp")
    except OSError as error:
        sys.exit(f"error: cannot write the snapshot {path} ({error.filename}: {error.strerror})")


if __name__ == "__main__":
    main(parse_args())
