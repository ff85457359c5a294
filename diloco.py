"""Train across a slow link: replica groups that sync every --sync_every steps (torchft's LocalSGD and DiLoCo),
not every step as DDP does.

    RUST_LOG=warn torchft_lighthouse --bind 127.0.0.1:29510 --min_replicas 1 --join_timeout_ms 1000 \
        --heartbeat_timeout_ms 2000 &
    torchrun --standalone --nproc_per_node=1 diloco.py --replica_id 0 --sync_every 50 &
    torchrun --standalone --nproc_per_node=1 diloco.py --replica_id 1 --sync_every 50
    # DDP's behaviour, to compare: every step, plain averaging
    ... diloco.py --replica_id N --algorithm localsgd --sync_every 1
    # two sites behind a shaped 20 Mbit/s link (root): launch/two_sites.py

Each replica group is its own torchrun (here of one process) with a whole copy of the model, and trains it alone
with its inner optimizer (SGD with momentum) for --sync_every steps. Then the groups of the quorum sync:
- --algorithm localsgd averages the weights.
- --algorithm diloco (the default; arXiv 2311.08105) averages the pseudo-gradient, the weights at the last sync
  less this group's weights now, and applies it with an outer optimizer, SGD with Nesterov momentum, to the
  weights of the last sync. --fragments N (Streaming DiLoCo, arXiv 2501.18512) syncs one of N slices of the
  model's blocks every sync_every/N steps: the same bytes in all, in N smaller bursts. --quantize sends fp8
  (torchft's triton kernels: CUDA only).
A sync that fails (a group died in it) is not committed anywhere: DiLoCo puts the weights back as they were at the
last sync and trains the round again. A group started again heals from a live one at its first sync, as
fault_tolerant.py's do. docs/slow-links.md has the measured costs over a shaped link.
"""
import argparse
import copy
import ctypes
import importlib.util
import logging
import os
import signal
import sys
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust half logs every quorum at "info"
from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
from torchft.checkpointing.pg_transport import PGTransport
from torchft.local_sgd import DiLoCo, LocalSGD

from models_and_data import BlockMLP, regression_dataset

# torchft logs each error it recovers from (a lost peer) with a traceback; this script says what happened in a line.
logging.getLogger("torchft").setLevel(logging.CRITICAL)
warnings.filterwarnings("ignore", module="torchft")  # torchft 0.2.0 against torch 2.13's deprecations


class UsageError(Exception):
    """Bad input the user can fix: said in one line, exit code 2."""


class LighthouseLost(Exception):
    """The lighthouse stopped answering: nothing to train on with, exit code 1."""


class StepSampler:
    """The samples a group trains on at a given step (fault_tolerant.py's): every epoch has one order of the
    dataset; a step takes the next num_replicas * batch_size samples of it and each group its own slice. The batch
    depends on the step number alone, so a round that is trained again sees the same samples."""

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
    parser.add_argument("--num_replicas", type=int, default=2, help="how many groups the data is split into (2)")
    parser.add_argument("--algorithm", choices=["diloco", "localsgd"], default="diloco",
                        help="diloco (outer Nesterov step on the averaged pseudo-gradient) or localsgd (average "
                             "the weights); default diloco")
    parser.add_argument("--sync_every", type=int, default=50, help="inner steps between syncs, H (default 50)")
    parser.add_argument("--fragments", type=int, default=1,
                        help="Streaming DiLoCo: sync one of N slices of the blocks every sync_every/N steps (1)")
    parser.add_argument("--quantize", action="store_true", help="DiLoCo: send fp8 (CUDA and triton only)")
    parser.add_argument("--steps", type=int, default=1000, help="inner steps in all, a multiple of --sync_every")
    parser.add_argument("--batch_size", type=int, default=32, help="samples per step and group (default 32)")
    parser.add_argument("--width", type=int, default=64, help="BlockMLP's width (default 64)")
    parser.add_argument("--hidden", type=int, default=256, help="BlockMLP's hidden width per block (default 256)")
    parser.add_argument("--depth", type=int, default=4, help="BlockMLP's blocks (default 4)")
    parser.add_argument("--lr", type=float, default=0.02, help="inner SGD learning rate, momentum 0.9 (0.02)")
    parser.add_argument("--outer_lr", type=float, default=0.7, help="DiLoCo's outer learning rate (0.7)")
    parser.add_argument("--outer_momentum", type=float, default=0.9, help="its Nesterov momentum (0.9)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data and of the first weights")
    parser.add_argument("--lighthouse", default=os.environ.get("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:29510"),
                        help="the lighthouse's address (default $TORCHFT_LIGHTHOUSE or http://127.0.0.1:29510)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="the address the other groups reach this one at (default 127.0.0.1: one machine)")
    parser.add_argument("--backend", choices=["nccl", "gloo"],
                        help="nccl on GPUs, gloo on the CPU (default: by the device)")
    parser.add_argument("--timeout", type=float, default=10.0,
                        help="seconds to wait for a peer, the lighthouse or a quorum (default 10); a quorum waits "
                             "for the slowest group's round, so keep it above a round's time")
    parser.add_argument("--step_delay", type=float, default=0.0, help="seconds to sleep after each inner step (0)")
    parser.add_argument("--log_every", type=int, default=1, help="print every Nth committed sync (default 1)")
    parser.add_argument("--snapshot_path", help="resume from and save to this file (default diloco_group<N>.pt)")
    parser.add_argument("--save_every", type=int, default=10, help="syncs between snapshots; the last too (10)")
    args = parser.parse_args()
    for name in ("num_replicas", "sync_every", "fragments", "steps", "batch_size", "width", "hidden", "depth",
                 "log_every", "save_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if not 0 <= args.replica_id < args.num_replicas:
        parser.error(f"--replica_id must be between 0 and --num_replicas - 1 ({args.num_replicas - 1})")
    if min(args.timeout, args.lr, args.outer_lr) <= 0 or args.step_delay < 0 or not 0 <= args.outer_momentum < 1:
        parser.error("--timeout, --lr and --outer_lr must be positive, --step_delay at least 0, --outer_momentum "
                     "in [0, 1)")
    if args.algorithm == "localsgd" and (args.fragments > 1 or args.quantize):
        parser.error("--fragments and --quantize are DiLoCo's: use them with --algorithm diloco")
    if args.depth % args.fragments:
        parser.error(f"--fragments {args.fragments} does not divide the model's {args.depth} blocks (--depth): "
                     "each fragment is an equal slice of them")
    if args.sync_every % args.fragments:
        parser.error(f"--sync_every {args.sync_every} is not a multiple of --fragments {args.fragments}: a "
                     "fragment syncs every sync_every/fragments steps")
    if args.steps % args.sync_every:
        parser.error(f"--steps {args.steps} is not a multiple of --sync_every {args.sync_every}: end on a sync")
    if args.quantize and not (torch.cuda.is_available() and importlib.util.find_spec("triton")):
        # Without triton, torchft 0.2.0 ignores should_quantize and sends fp32 without a word.
        parser.error("--quantize needs a CUDA GPU and triton (torchft quantizes with triton kernels); leave it out "
                     "on the CPU")
    if 2048 < args.num_replicas * args.batch_size:
        parser.error("--num_replicas x --batch_size must be at most the dataset's 2048 samples")
    args.snapshot_path = args.snapshot_path or f"diloco_group{args.replica_id}.pt"
    return args


def die_with_torchrun():
    """Have Linux SIGKILL this process when its torchrun dies (fault_tolerant.py's): an orphaned worker would go
    on training in the quorum as a group of its own."""
    parent = os.getppid()
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux
        return
    if os.getppid() != parent:  # torchrun died before the call
        os.kill(os.getpid(), signal.SIGKILL)


def check_snapshot_path(path):
    """Stop now, not after the first epochs, where the snapshot cannot be written."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        open(path + ".tmp", "wb").close()
        os.remove(path + ".tmp")
    except OSError as error:
        sys.exit(f"error: cannot write the snapshot {path} ({error.filename}: {error.strerror})")


def fragments_of(model, count):
    """The model cut into `count` slices of consecutive blocks; the input layer goes with the first, the final
    norm and output layer with the last. One slice is the whole model."""
    if count == 1:
        return [model]
    per = len(model.blocks) // count
    slices = [nn.ModuleList(model.blocks[i * per:(i + 1) * per]) for i in range(count)]
    slices[0].insert(0, model.inp)
    slices[-1].extend([model.norm, model.out])
    return slices


def settings(args):
    """What every group must share: a group with other settings would meet the others in mismatched collectives."""
    return (f"--algorithm {args.algorithm} --sync_every {args.sync_every} --fragments {args.fragments}"
            f"{' --quantize' if args.quantize else ''} --width {args.width} --hidden {args.hidden} "
            f"--depth {args.depth}")


def main(args):
    if int(os.environ.get("WORLD_SIZE", 1)) != 1 or "MASTER_PORT" not in os.environ:
        raise UsageError("start each replica group as `torchrun --standalone --nproc_per_node=1 diloco.py "
                         "--replica_id N`: one process a group")
    die_with_torchrun()
    local_rank, local_world_size = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    accelerator = torch.accelerator.current_accelerator(check_available=True)  # None without a usable GPU
    if accelerator and local_world_size > torch.accelerator.device_count():
        accelerator = None  # more processes than devices (a Mac has one mps device): every process on the CPU
    device = torch.device(accelerator.type, local_rank) if accelerator else torch.device("cpu")
    backend = args.backend or dist.get_default_backend_for_device(device)
    if backend == "nccl" and device.type != "cuda":
        sys.exit("error: --backend nccl needs a CUDA GPU for each process; leave --backend out for gloo on the CPU")
    check_snapshot_path(args.snapshot_path)
    snapshot = None
    if os.path.exists(args.snapshot_path):
        try:  # a bad file named in one line, not a traceback; training on would overwrite it
            snapshot = torch.load(args.snapshot_path, map_location="cpu", weights_only=True)
            step = snapshot["torchft"]["step"]
        except Exception as error:  # noqa: BLE001  whatever torch.load raises, the file is no snapshot of ours
            raise UsageError(f"cannot read the snapshot {args.snapshot_path} ({type(error).__name__}: truncated, "
                             "or not a snapshot); move it away or pass another --snapshot_path") from None
        if snapshot["user"]["default"]["settings"] != settings(args):
            raise UsageError(f"the snapshot {args.snapshot_path} was written with other settings "
                             f"({snapshot['user']['default']['settings']}; now {settings(args)}); move it away or "
                             "pass another --snapshot_path")
    if accelerator:
        torch.accelerator.set_device_index(device.index)
    if args.host in ("127.0.0.1", "localhost") and sys.platform == "linux":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # else gloo binds the address of the host's name
    timeout = timedelta(seconds=args.timeout)
    period = args.sync_every // args.fragments  # inner steps between two syncs (of one fragment each)
    if snapshot is not None and snapshot["torchft"]["step"] * period >= args.steps:
        print(f"Nothing to do: {args.snapshot_path} already holds {step * period} steps (--steps {args.steps}); "
              "raise --steps to train on")
        return

    torch.manual_seed(args.seed)
    model = BlockMLP(width=args.width, hidden=args.hidden, depth=args.depth).to(device)
    inner = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    dataset = regression_dataset(seed=args.seed)
    sampler = StepSampler(len(dataset), args.replica_id, args.num_replicas, args.batch_size, args.seed)
    healed_to = []  # the step a heal brought this group to, set while it heals

    def state_dict():  # what a healing group fetches from a live one (DiLoCo adds its fragments' state)
        return {"model": model.state_dict(), "optimizer": inner.state_dict(), "settings": settings(args)}

    def load_state_dict(state):
        # A group started with other settings cannot heal from this one: say so, rather than fail in a collective.
        if state["settings"] != settings(args):
            raise UsageError(f"this group's settings do not fit the running groups' ({settings(args)}; theirs: "
                             f"{state['settings']}); start every group with the same flags")
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optimizer"])
        healed_to.append(manager.current_step())

    # The process group that spans the groups of each quorum; torchft rebuilds it whenever the quorum changes.
    pg = ProcessGroupNCCL(timeout=timeout) if backend == "nccl" else ProcessGroupGloo(timeout=timeout)
    try:
        manager = Manager(
            pg=pg, load_state_dict=load_state_dict, state_dict=state_dict,
            min_replica_size=1,  # sync on with a single live group
            use_async_quorum=False,  # DiLoCo needs it; a group that heals does so before it sends anything
            checkpoint_transport=PGTransport(pg, timeout=timeout, device=device),
            timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
            lighthouse_addr=args.lighthouse, replica_id=f"diloco_{args.replica_id}",
            hostname=args.host, store_addr=args.host, store_port=int(os.environ["MASTER_PORT"]),
        )
    except RuntimeError as error:  # raised in torchft's Rust half: its message is all there is to go on
        if "failed to connect" in str(error):
            raise UsageError(f"no lighthouse answers at {args.lighthouse} within {args.timeout:g}s: start "
                             "torchft_lighthouse first, or give its address with --lighthouse") from None
        raise
    fragments = fragments_of(model, args.fragments)
    if args.algorithm == "diloco":
        outer = [torch.optim.SGD(f.parameters(), lr=args.outer_lr, momentum=args.outer_momentum, nesterov=True)
                 for f in fragments]
        syncer = DiLoCo(manager, fragments, inner, outer, sync_every=args.sync_every, should_quantize=args.quantize)
    else:
        syncer = LocalSGD(manager, model, inner, sync_every=args.sync_every)
    if snapshot is not None:  # the state a healing group would fetch, with the step count
        for key, load in manager._load_state_dict_fns.items():  # torchft 0.2.0 has no public call for this
            load(snapshot["user"][key])
        manager.load_state_dict(snapshot["torchft"])
        healed_to.clear()
        print(f"Resuming from {args.snapshot_path} at sync {manager.current_step()} "
              f"(step {manager.current_step() * period})")
    payload = [sum(p.numel() * (1 if args.quantize else p.element_size()) for p in f.parameters())
               for f in fragments]
    print(f"Replica group {args.replica_id} of {args.num_replicas} | {args.algorithm} every {args.sync_every} steps"
          f"{f' in {args.fragments} fragments' if args.fragments > 1 else ''} | "
          f"{sum(p.numel() for p in model.parameters()):,} parameters | device {device} | backend {backend} | "
          f"lighthouse {args.lighthouse}")

    start, tried, sent, groups_seen = time.perf_counter(), 0, 0, set()
    loss_sum, losses = torch.zeros((), device=device), 0
    with syncer:
        while manager.current_step() * period < args.steps:
            before = manager.current_step()
            first = before * period  # a round trains the steps after the last committed sync
            for step in range(first, first + period):
                x, y = (t.to(device) for t in dataset[sampler.indices(step)])
                inner.zero_grad()
                loss = F.mse_loss(model(x), y)
                loss.backward()
                loss_sum += loss.detach()
                losses += 1
                if step < first + period - 1:
                    inner.step()
                else:
                    try:
                        inner.step()  # torchft's hook syncs after the round's last step
                    except (RuntimeError, TimeoutError):  # raised in torchft's Rust half: no more said than that
                        raise LighthouseLost(f"no quorum from the lighthouse at {args.lighthouse} within "
                                             f"{args.timeout:g}s (at sync {before + 1}): is it still running?"
                                             ) from None
                time.sleep(args.step_delay)
            tried += 1
            healed = healed_to.pop() if healed_to else None  # at the first sync, all but one take its weights
            base = before if healed is None else healed
            if healed is not None:
                print(f"Healed from a live group: at sync {base} now (was {before})")
            after, groups = manager.current_step(), manager.num_participants()
            if after != base + 1:
                what = ("weights put back as at the last sync" if args.algorithm == "diloco"
                        else "weights not averaged")
                print(f"Sync {base + 1} | not committed (a group was lost): {what}, steps {base * period + 1}-"
                      f"{(base + 1) * period} trained again")
                continue
            sent += payload[base % len(payload)]
            groups_seen.add(groups)
            done = after * period >= args.steps
            if after % args.log_every == 0 or done:
                print(f"Sync {after} | step {after * period} | groups {groups} | sent {payload[base % len(payload)]} B "
                      f"| loss {loss_sum.item() / losses:.6f}")
                loss_sum.zero_()
                losses = 0
            if after % args.save_every == 0 or done:
                save_snapshot(manager, args.snapshot_path)

    # The model every group ends with: each fragment's weights as of its last sync (Streaming DiLoCo leaves the
    # other fragments' local weights in the model) and, for localsgd, the average of the last sync.
    final = copy.deepcopy(model)
    if args.algorithm == "diloco":
        user = manager._manager_state_dict()["user"]
        for i, fragment in enumerate(fragments_of(final, args.fragments)):
            originals = user[f"StreamingDiLoCoFragment_{i}"]["original_parameters"]
            with torch.no_grad():
                for name, p in fragment.named_parameters():
                    p.copy_(originals[name])
    with torch.no_grad():
        x, y = (t.to(device) for t in dataset.tensors)
        final_loss = F.mse_loss(final(x), y).item()  # the whole dataset: the same figure in every group
    print(f"Summary: steps {manager.current_step() * period} | syncs {manager.current_step()} | by this group "
          f"{tried} tried | groups per sync {min(groups_seen, default=0)}-{max(groups_seen, default=0)} | sent "
          f"{sent / 1e6:.2f} MB | final loss {final_loss:.6f} | wall {time.perf_counter() - start:.2f}s | "
          f"replica group {args.replica_id} | backend {backend}")
    manager.shutdown(wait=False)


def save_snapshot(manager, path):
    """What a healing group would fetch (the model, both optimizers, DiLoCo's weights of the last sync) and the
    sync count, written beside the snapshot and renamed over it: a crash mid-save leaves the previous one whole."""
    state = manager._manager_state_dict()  # torchft 0.2.0 has no public call for it
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        os.fsync(f.fileno())
    os.replace(tmp, path)


if __name__ == "__main__":
    try:
        main(parse_args())
    except (UsageError, LighthouseLost) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        # At once, without Python's shutdown: torchft's threads may still wait on a peer or the lighthouse.
        os._exit(2 if isinstance(error, UsageError) else 1)
