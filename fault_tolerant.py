"""Per-step fault tolerance with torchft: replica groups that train on when one of them dies, and heal it when it
comes back, without a restart of the others and without a checkpoint on disk.

    RUST_LOG=warn torchft_lighthouse --bind 127.0.0.1:29510 --min_replicas 1 --join_timeout_ms 1000 \
        --heartbeat_timeout_ms 2000 &
    torchrun --standalone --nproc_per_node=1 fault_tolerant.py --replica_id 0 --steps 600 --step_delay 0.05 &
    torchrun --standalone --nproc_per_node=1 fault_tolerant.py --replica_id 1 --steps 600 --step_delay 0.05

Each replica group is its own torchrun (here of one process) with a whole copy of the model. The lighthouse keeps
the list of live groups; before each step every group asks it for a quorum, the groups of the quorum average
their gradients, and the step is committed only if that worked everywhere. Kill a group (SIGKILL its torchrun):
the others fail at most that one step, form a quorum without it once its heartbeats have stopped for
--heartbeat_timeout_ms, and step on. Start it again: at the next
quorum it fetches the weights, the optimizer state and the step number from a live group ("heals") and trains
on in step with the others. On several machines, give --lighthouse and --host addresses the others can reach.
docs/fault-tolerance.md compares this with restarting from a snapshot and with elastic membership.
"""
import argparse
import ctypes
import logging
import os
import signal
import sys
import time
import warnings
from datetime import timedelta

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset
os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust half logs every quorum at "info": several lines a step
from torchft import Manager, Optimizer, ProcessGroupGloo, ProcessGroupNCCL
from torchft.checkpointing.pg_transport import PGTransport

# torchft logs each error it recovers from (a lost peer) with a traceback; this script says what happened in a line.
logging.getLogger("torchft").setLevel(logging.CRITICAL)
warnings.filterwarnings("ignore", module="torchft")  # torchft 0.2.0 against torch 2.13's deprecations

DATASET_SIZE = 2048
INPUT_SIZE = 20


class UsageError(Exception):
    """Bad input the user can fix: said in one line, exit code 2."""


class LighthouseLost(Exception):
    """The lighthouse stopped answering: nothing to train on with, exit code 1."""


class MLP(nn.Module):
    """The DDP tutorial's model: a small regression network."""

    def __init__(self, input_size=INPUT_SIZE, hidden_size=64, output_size=1):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(input_size, hidden_size), nn.ReLU(),
            nn.Linear(hidden_size, hidden_size), nn.ReLU(),
            nn.Linear(hidden_size, output_size),
        )

    def forward(self, x):
        return self.net(x)


def regression_dataset(size=DATASET_SIZE, input_size=INPUT_SIZE, seed=0, noise=0.05):
    """Inputs and targets from a fixed random teacher network plus noise, the same in every group (same seed):
    the MSE falls from about 1 towards noise**2."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(size, input_size, generator=generator)
    hidden = torch.randn(input_size, 16, generator=generator) / input_size ** 0.5
    out = torch.randn(16, 1, generator=generator)
    y = torch.tanh(2 * x @ hidden) @ out / 2 + noise * torch.randn(size, 1, generator=generator)
    return TensorDataset(x, y)


class StepSampler:
    """The samples a group trains on at a given step. Every epoch has one order of the dataset (from the seed and
    the epoch); a step takes the next num_replicas * batch_size samples of it and each group its own slice. The
    batch depends on the step number alone, so a group that healed to step N trains on step N's data, and a step
    that was not committed is tried again with the same samples. While a group is down, its slices go untrained."""

    def __init__(self, size, replica_id, num_replicas, batch_size, seed):
        self.size, self.replica_id, self.batch_size, self.seed = size, replica_id, batch_size, seed
        self.global_batch = num_replicas * batch_size
        self.steps_per_epoch = size // self.global_batch  # the last, partial global batch is left out

    def indices(self, step):
        epoch, position = divmod(step, self.steps_per_epoch)
        order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + epoch))
        start = position * self.global_batch + self.replica_id * self.batch_size
        return order[start:start + self.batch_size]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replica_id", type=int, required=True, help="this group's number, 0 to --num_replicas - 1")
    parser.add_argument("--num_replicas", type=int, default=2,
                        help="how many groups the data is split into (default 2); fewer may run at a time")
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps to commit (default 1000)")
    parser.add_argument("--batch_size", type=int, default=32, help="samples per step and group (default 32)")
    parser.add_argument("--hidden", type=int, default=64, help="the MLP's hidden width; the same in every group")
    parser.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (default 0.01)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data and of the first weights")
    parser.add_argument("--lighthouse", default=os.environ.get("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:29510"),
                        help="the lighthouse's address (default $TORCHFT_LIGHTHOUSE or http://127.0.0.1:29510)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="the address the other groups reach this one at (default 127.0.0.1: one machine)")
    parser.add_argument("--backend", choices=["nccl", "gloo"],
                        help="nccl on GPUs, gloo on the CPU (default: by the device)")
    parser.add_argument("--timeout", type=float, default=5.0,
                        help="seconds to wait for a peer, the lighthouse or a quorum before giving up on them "
                             "(default 5; torchft's own default is 60)")
    parser.add_argument("--step_delay", type=float, default=0.0,
                        help="seconds to sleep after each step (default 0): a pace at which to kill and restart a "
                             "group by hand, and watch")
    parser.add_argument("--log_every", type=int, default=1, help="print a committed step every N steps (default 1)")
    parser.add_argument("--save_weights", help="at the end, save the model's and optimizer's state to this file")
    args = parser.parse_args()
    for name in ("num_replicas", "steps", "batch_size", "hidden", "log_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if not 0 <= args.replica_id < args.num_replicas:
        parser.error(f"--replica_id must be between 0 and --num_replicas - 1 ({args.num_replicas - 1})")
    if args.timeout <= 0 or args.lr <= 0 or args.step_delay < 0:
        parser.error("--timeout and --lr must be positive, --step_delay at least 0")
    if DATASET_SIZE < args.num_replicas * args.batch_size:
        parser.error(f"--num_replicas x --batch_size must be at most the dataset's {DATASET_SIZE} samples")
    return args


def die_with_torchrun():
    """Have Linux SIGKILL this process when its torchrun dies. torchrun stops its workers when it ends normally;
    killed outright, it cannot, and an orphaned worker would go on training in the quorum as a group of its own."""
    parent = os.getppid()
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux
        return
    if os.getppid() != parent:  # torchrun died before the call
        os.kill(os.getpid(), signal.SIGKILL)


def main(args):
    if int(os.environ.get("WORLD_SIZE", 1)) != 1 or "MASTER_PORT" not in os.environ:
        raise UsageError("start each replica group as `torchrun --standalone --nproc_per_node=1 fault_tolerant.py "
                         "--replica_id N`: one process a group")
    die_with_torchrun()
    accelerator = torch.accelerator.current_accelerator(check_available=True)  # None without a usable GPU
    device = torch.device(accelerator.type, int(os.environ["LOCAL_RANK"])) if accelerator else torch.device("cpu")
    backend = args.backend or ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise UsageError("--backend nccl needs a CUDA GPU; use --backend gloo on the CPU")
    if accelerator:
        torch.accelerator.set_device_index(device.index)
    timeout = timedelta(seconds=args.timeout)

    torch.manual_seed(args.seed)
    model = MLP(hidden_size=args.hidden).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    dataset = regression_dataset(seed=args.seed)
    sampler = StepSampler(len(dataset), args.replica_id, args.num_replicas, args.batch_size, args.seed)

    def state_dict():  # what a healing group fetches from a live one
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    def load_state_dict(state):
        # A group started with another model cannot heal from this one: say so, rather than fail in a collective.
        mine = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        theirs = {name: tuple(t.shape) for name, t in state["model"].items()}
        if mine != theirs:
            raise UsageError(f"this group's model does not fit the running groups' (--hidden {args.hidden}: "
                             f"{describe(mine)}; theirs: {describe(theirs)}); start every group with the same "
                             "model flags")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    # The process group that spans the groups of each quorum; torchft rebuilds it whenever the quorum changes.
    pg = ProcessGroupNCCL(timeout=timeout) if backend == "nccl" else ProcessGroupGloo(timeout=timeout)
    try:
        manager = Manager(
            pg=pg, load_state_dict=load_state_dict, state_dict=state_dict,
            min_replica_size=1,  # step on with a single live group
            # Quorum before the forward pass (not overlapped with it): a group that heals takes part in that very
            # step, and a model that does not fit is refused before its gradients meet the others'.
            use_async_quorum=False,
            # Weights travel over the process group of the quorum itself: no extra server, no host name.
            checkpoint_transport=PGTransport(pg, timeout=timeout, device=device),
            timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
            lighthouse_addr=args.lighthouse, replica_id=f"fault_tolerant_{args.replica_id}",
            hostname=args.host, store_addr=args.host, store_port=int(os.environ["MASTER_PORT"]),
        )
    except RuntimeError as error:  # raised in torchft's Rust half: its message is all there is to go on
        if "failed to connect" in str(error):
            raise UsageError(f"no lighthouse answers at {args.lighthouse} within {args.timeout:g}s: start "
                             "torchft_lighthouse first, or give its address with --lighthouse") from None
        raise
    optimizer = Optimizer(manager, optimizer)  # zero_grad() starts a quorum, step() steps only if it committed
    print(f"Replica group {args.replica_id} of {args.num_replicas} | device {device} | backend {backend} | "
          f"lighthouse {args.lighthouse}")

    start, loss, groups_seen, tries = time.perf_counter(), float("nan"), set(), 0
    while manager.current_step() < args.steps:
        before = manager.current_step()
        try:
            optimizer.zero_grad()  # asks the lighthouse for a quorum; a group behind the others heals here
        except (RuntimeError, TimeoutError):  # raised in torchft's Rust half, which says no more than that
            raise LighthouseLost(f"no quorum from the lighthouse at {args.lighthouse} within {args.timeout:g}s "
                                 f"(before step {before + 1}): is it still running?") from None
        step = manager.current_step()
        if step != before:
            print(f"Healed from a live group: at step {step} now (was {before})")
            if step >= args.steps:
                break
        indices = sampler.indices(step)
        x, y = (t.to(device) for t in dataset[indices])
        loss = F.mse_loss(model(x), y)
        loss.backward()
        # The mean gradient of the quorum's groups. A peer that died mid-way does not raise here: the manager
        # notes the error and the step below is not committed by anyone.
        for work in [manager.allreduce(p.grad) for p in model.parameters()]:
            work.wait()
        groups = manager.num_participants()
        optimizer.step()  # the quorum's vote: every group steps, or none
        tries += 1
        if manager.current_step() == step + 1:
            groups_seen.add(groups)
            if manager.current_step() % args.log_every == 0 or manager.current_step() == args.steps:
                print(f"Step {manager.current_step()} | groups {groups} | loss {loss.item():.6f}")
        else:
            print(f"Step {step + 1} | not committed (a group was lost); tried again with the next quorum")
        time.sleep(args.step_delay)

    if args.save_weights:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": manager.current_step()},
                   args.save_weights)
    print(f"Summary: steps committed {manager.current_step()} | by this group {tries} tried | groups per step "
          f"{min(groups_seen, default=0)}-{max(groups_seen, default=0)} | final loss {loss:.6f} | "
          f"wall {time.perf_counter() - start:.2f}s | replica group {args.replica_id} | backend {backend}")
    manager.shutdown(wait=False)


def describe(shapes):
    return ", ".join(f"{name} {'x'.join(map(str, shape))}" for name, shape in shapes.items() if name.endswith("weight"))


if __name__ == "__main__":
    try:
        main(parse_args())
    except (UsageError, LighthouseLost) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        # At once, without Python's shutdown: torchft's threads may still wait on a peer or the lighthouse.
        os._exit(2 if isinstance(error, UsageError) else 1)
