"""The same linear classifier trained three ways, timed side by side: normal training in one process, DDP in
--world_size processes (mp.spawn), and nn.DataParallel when there are at least 2 GPUs.

    cp .env.example .env        # MASTER_ADDR and MASTER_PORT of the DDP rendezvous
    python ddp.py --backend gloo --total_epochs 10 --batch_size 128 --input_size 200 --world_size 2
    python ddp.py --total_epochs 10 --batch_size 128 --input_size 200    # every GPU with nccl, or 2 CPU processes
    MASTER_PORT=29511 python ddp.py --env_file other.env --backend gloo  # the environment wins over the file

The processes meet where MASTER_ADDR and MASTER_PORT say (init_method="env://"): the environment first, then
the .env file (python-dotenv), else 127.0.0.1 and a free port; it prints which, and where each came from.

How normal training is matched to DDP, so their weights agree to float rounding: DDP rank r trains on
DistributedSampler(rank=r) shards of --batch_size samples, and DDP averages the ranks' gradients, which is
the gradient of the mean loss over the union of the ranks' batches. Normal training therefore takes
batches of batch_size * world_size samples, and its batch i is exactly the union of every rank's batch i:
ShardUnionSampler asks the same DistributedSamplers (same seed, same epoch) for their shards and
concatenates them. DataParallel runs on those same global batches. Only the order of float additions
differs, so the largest weight difference printed at the end is at rounding level (around 1e-7).
"""
import argparse
import os
import socket
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.nn  # before any process group: docs/failures.md, clean exits
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from dotenv import dotenv_values

from models_and_data import LinearClassifier, classification_dataset

DATASET_SIZE = 4096
DEFAULT_ADDRESS = "127.0.0.1"


def rendezvous_from(env_file, must_exist):
    """(address, port, {variable: where it came from}) for MASTER_ADDR and MASTER_PORT, put into os.environ, where
    init_process_group's env:// and the spawned processes read them. The environment wins over the file (as
    python-dotenv's override=False); a missing or empty value falls back to 127.0.0.1 and a free port."""
    path = os.path.abspath(env_file)  # python-dotenv would search beside the script, not in the current directory
    if not os.path.isfile(path) and must_exist:
        sys.exit(f"error: env file {path} not found; copy .env.example there or leave out --env_file")
    try:
        in_file = dotenv_values(path) if os.path.isfile(path) else {}
    except (OSError, UnicodeDecodeError) as error:
        sys.exit(f"error: cannot read env file {path} ({error})")
    missing = f"not set in {path}" if os.path.isfile(path) else f"no env file at {path}"
    values, sources = {}, {}
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if os.environ.get(name):
            values[name], sources[name] = os.environ[name], "from the environment"
        elif in_file.get(name):
            values[name], sources[name] = in_file[name], f"from {path}"
    address = values.get("MASTER_ADDR", DEFAULT_ADDRESS)
    sources.setdefault("MASTER_ADDR", f"default, {missing}")
    port = values.get("MASTER_PORT", "0").strip()  # 0: a free one, below
    if "MASTER_PORT" in values and not (port.isdigit() and 0 < int(port) < 65536):
        sys.exit(f"error: MASTER_PORT={values['MASTER_PORT']!r} {sources['MASTER_PORT']}: expected a port number, "
                 "1 to 65535")
    # Listen where rank 0 will, before any process starts: a taken port or an address of another machine is a
    # line now, not a rank 0 crash and the others waiting for it. Port 0: the system picks a free one.
    try:
        family = socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)[0][0]
        with socket.create_server((address, int(port)), family=family) as listener:
            port = listener.getsockname()[1]
    except socket.gaierror:
        sys.exit(f"error: MASTER_ADDR={address!r} ({sources['MASTER_ADDR']}) does not resolve")
    except OSError as error:
        if error.errno == 98:  # EADDRINUSE: a live listener (SO_REUSEADDR, set by create_server, ignores TIME_WAIT)
            sys.exit(f"error: port {port} on {address} is already in use; pick another MASTER_PORT, or leave it out "
                     "to get a free one")
        sys.exit(f"error: cannot listen on {address} ({os.strerror(error.errno)}): MASTER_ADDR "
                 f"({sources['MASTER_ADDR']}) must be an address of this machine")
    sources.setdefault("MASTER_PORT", f"a free port, {missing}")
    os.environ.update(MASTER_ADDR=address, MASTER_PORT=str(port))
    return address, port, sources


class ShardUnionSampler:
    """Batches of one process equal to the union of the DDP ranks' batches, step by step and epoch by epoch."""

    def __init__(self, dataset, world_size, batch_size, seed):
        self.shards = [DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=seed)
                       for rank in range(world_size)]
        self.batch_size = batch_size

    def set_epoch(self, epoch):
        for shard in self.shards:
            shard.set_epoch(epoch)

    def __len__(self):
        return -(-len(self.shards[0]) // self.batch_size)

    def __iter__(self):
        shards = [list(shard) for shard in self.shards]
        for start in range(0, len(shards[0]), self.batch_size):
            yield [index for shard in shards for index in shard[start:start + self.batch_size]]


def build(args, device):
    """Dataset, model and optimizer: the same in every mode and every process (same seeds)."""
    dataset = classification_dataset(DATASET_SIZE, args.input_size, seed=args.seed)
    torch.manual_seed(args.seed)
    model = LinearClassifier(args.input_size).to(device)
    return dataset, model, torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)


def train(model, loader, sampler, optimizer, args, device, label, reduce=None, verbose=True):
    """The loop every mode shares. `reduce` sums the epoch's statistics over the ranks.
    Returns (wall seconds, samples trained on by all processes together)."""
    start, samples = time.perf_counter(), 0
    for epoch in range(args.total_epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same in every process
        # loss sum, correct, samples: kept on the device and read once per epoch, not once per step
        stats = torch.zeros(3, device=device)
        for source, targets in loader:
            source, targets = source.to(device), targets.to(device)
            optimizer.zero_grad(set_to_none=True)
            logits = model(source)
            loss = F.cross_entropy(logits, targets)
            loss.backward()  # DDP all-reduces the gradients here; DataParallel gathers them on GPU 0
            optimizer.step()
            stats[0] += loss.detach() * len(targets)
            stats[1] += (logits.argmax(dim=1) == targets).sum()
            stats[2] += len(targets)
        if reduce:
            reduce(stats)
        loss_sum, correct, count = stats.tolist()
        samples += int(count)
        if verbose:
            print(f"[{label}] Epoch {epoch} | loss {loss_sum / count:.6f} | accuracy {correct / count:.4f}")
    return time.perf_counter() - start, samples


@torch.no_grad()
def evaluate(model, dataset, device):
    """(mean loss, accuracy) of the final weights on the whole dataset: the same yardstick for every mode."""
    source, targets = (tensor.to(device) for tensor in dataset.tensors)
    logits = model(source)
    return F.cross_entropy(logits, targets).item(), (logits.argmax(dim=1) == targets).float().mean().item()


def normal_training(args, world_size, device):
    dataset, model, optimizer = build(args, device)
    sampler = ShardUnionSampler(dataset, world_size, args.batch_size, args.seed)
    wall, samples = train(model, DataLoader(dataset, batch_sampler=sampler), sampler, optimizer, args, device,
                          "normal")
    return model, dataset, wall, samples


def ddp_worker(rank, world_size, backend, args, result_path):
    # The rank is the mp.spawn index; one machine, so it is also the local rank, which picks the GPU.
    accelerator = torch.accelerator.current_accelerator(check_available=True)  # None without a usable GPU
    if accelerator and world_size > torch.accelerator.device_count():
        accelerator = None  # more processes than devices (a Mac has one mps device): every process on the CPU
    device = torch.device(accelerator.type, rank) if accelerator else torch.device("cpu")
    if accelerator:  # before the process group, so NCCL binds this process to its own GPU
        torch.accelerator.set_device_index(device.index)
    # env://: MASTER_ADDR and MASTER_PORT as the parent put them into the environment, which we inherit
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=args.timeout),
                            device_id=device if accelerator else None)
    dataset, model, optimizer = build(args, device)
    sampler = DistributedSampler(dataset, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    model = DDP(model, device_ids=[device.index] if device.type != "cpu" else None)
    wall, samples = train(model, loader, sampler, optimizer, args, device, "DDP", reduce=dist.all_reduce,
                          verbose=rank == 0)
    if rank == 0:  # every rank holds the same weights
        weights = {name: value.cpu() for name, value in model.module.state_dict().items()}
        torch.save({"weights": weights, "wall": wall, "samples": samples,
                    "steps": args.total_epochs * len(loader)}, result_path)
    del model, optimizer  # DDP holds the process group: free it first, so destroy_process_group frees the group
    dist.destroy_process_group()


def ddp_process(rank, *args):  # what mp.spawn runs in each process
    try:
        ddp_worker(rank, *args)
    except (Exception, SystemExit) as error:
        if not dist.is_initialized():  # no process group: Python's own exit is safe
            raise
        # The group lives on: Python's exit can stall or abort in gloo's threads. Say why as Python would; leave now.
        if isinstance(error, SystemExit):  # sys.exit("error: ...")
            print(error.code, file=sys.stderr)
        else:  # the traceback, through any hook a tool installed
            sys.excepthook(*sys.exc_info())
        sys.stdout.flush()
        os._exit(1)


def ddp_training(args, world_size, backend):
    with tempfile.TemporaryDirectory() as directory:
        result_path = os.path.join(directory, "ddp_result.pt")
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does: else each process takes every core
        try:
            mp.spawn(ddp_process, args=(world_size, backend, args, result_path), nprocs=world_size)
        except mp.ProcessExitedException as error:  # one ended early (it said why, or a signal killed it)
            sys.exit(error.exit_code if error.exit_code > 0 else f"{error}; mp.spawn stopped the others")
        result = torch.load(result_path, weights_only=True)
    model = LinearClassifier(args.input_size)
    model.load_state_dict(result["weights"])
    return model, result


def data_parallel_training(args, world_size):
    device = torch.device("cuda", 0)
    dataset, model, optimizer = build(args, device)
    # DataParallel splits each batch over the GPUs inside one process; the batches are normal training's.
    sampler = ShardUnionSampler(dataset, world_size, args.batch_size, args.seed)
    wall, samples = train(nn.DataParallel(model), DataLoader(dataset, batch_sampler=sampler), sampler,
                          optimizer, args, device, "DataParallel")
    return model, dataset, wall, samples


def main(args):
    world_size = args.world_size or torch.accelerator.device_count() or 2
    accelerator = torch.accelerator.current_accelerator(check_available=True)  # None without a usable GPU
    if accelerator and world_size > torch.accelerator.device_count():
        accelerator = None  # more processes than devices (a Mac has one mps device): every process on the CPU
    device = torch.device(accelerator.type, 0) if accelerator else torch.device("cpu")
    backend = args.backend or dist.get_default_backend_for_device(device)
    if args.weights_dir:  # written at the end: checked now that it can be, not after the training
        try:
            os.makedirs(args.weights_dir, exist_ok=True)
            open(os.path.join(args.weights_dir, ".tmp"), "wb").close()
            os.remove(os.path.join(args.weights_dir, ".tmp"))
        except OSError as error:
            sys.exit(f"error: cannot write the weights to {args.weights_dir}: {error.strerror}")
    address, port, sources = rendezvous_from(args.env_file or ".env", must_exist=args.env_file is not None)
    print(f"MASTER_ADDR={address} ({sources['MASTER_ADDR']})\nMASTER_PORT={port} ({sources['MASTER_PORT']})")
    print(f"Global batch {args.batch_size * world_size}: normal training takes it whole, "
          f"DDP {args.batch_size} on each of {world_size} ranks")

    rows = []
    normal_model, dataset, wall, samples = normal_training(args, world_size, device)
    rows.append(("normal", wall, samples, *evaluate(normal_model, dataset, device)))

    ddp_model, result = ddp_training(args, world_size, backend)
    ddp_loss, ddp_accuracy = evaluate(ddp_model, dataset, torch.device("cpu"))
    rows.append((f"DDP ({world_size} ranks)", result["wall"], result["samples"], ddp_loss, ddp_accuracy))

    gpus, dp_model = torch.accelerator.device_count() if accelerator else 0, None
    if gpus >= 2:
        dp_model, dataset, wall, samples = data_parallel_training(args, world_size)
        rows.append((f"DataParallel ({gpus} GPUs)", wall, samples, *evaluate(dp_model, dataset, device)))
    else:
        print(f"[DataParallel] skipped: it splits each batch over 2 or more CUDA GPUs, this machine has {gpus}")

    print(f"\n{'mode':<22} | {'wall time':>9} | {'samples/s':>10} | {'final loss':>10} | {'accuracy':>8}")
    for mode, wall, samples, loss, accuracy in rows:
        print(f"{mode:<22} | {wall:>8.2f}s | {samples / wall:>10.1f} | {loss:>10.6f} | {accuracy:>8.4f}")
    print("(wall time: the training loops only, without process start and rendezvous; "
          "loss and accuracy: final weights on the whole dataset)")
    if args.weights_dir:
        os.makedirs(args.weights_dir, exist_ok=True)
        for name, model in (("normal", normal_model), ("ddp", ddp_model), ("dataparallel", dp_model)):
            if model is not None:
                weights = {key: value.cpu() for key, value in model.state_dict().items()}
                torch.save(weights, os.path.join(args.weights_dir, f"{name}.pt"))
        print(f"Final weights of each mode written to {args.weights_dir}")
    difference = max((normal_model.state_dict()[name].cpu() - value).abs().max().item()
                     for name, value in ddp_model.state_dict().items())
    print(f"Largest |normal - DDP| weight difference: {difference:.3e}")
    print(f"Summary: epochs {args.total_epochs} | steps {result['steps']} | final loss {ddp_loss:.6f} | samples/s "
          f"{result['samples'] / result['wall']:.1f} | wall {result['wall']:.2f}s | world size {world_size} | "
          f"backend {backend}")


def positive_int(text):
    if not text.lstrip("-").isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return int(text)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--total_epochs", "--epochs", type=positive_int, default=10, help="epochs (default 10)")
    parser.add_argument("--batch_size", type=positive_int, default=128, help="samples per step and rank (default 128)")
    parser.add_argument("--input_size", type=positive_int, default=200, help="features per sample (default 200)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate, momentum 0.9 (default 0.05)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data, the model and the shuffle")
    parser.add_argument("--world_size", type=positive_int, help="DDP processes (default: one per GPU, or 2)")
    parser.add_argument("--weights_dir", help="write each mode's final weights to DIR (normal.pt, ddp.pt, "
                                              "dataparallel.pt), to inspect or compare them")
    parser.add_argument("--env_file",
                        help="file with MASTER_ADDR and MASTER_PORT (default: .env in the current directory, "
                             "if there is one); variables set in the environment win")
    parser.add_argument("--backend", choices=["nccl", "gloo"], help="default: nccl on CUDA, gloo on the CPU")
    parser.add_argument("--timeout", type=float, default=300, help="seconds to wait for the other ranks (default 300)")
    args = parser.parse_args()
    if args.lr <= 0 or args.timeout <= 0:
        parser.error("--lr and --timeout must be positive")
    gpus = torch.accelerator.device_count() if torch.cuda.is_available() else 0
    if args.backend == "nccl" and (args.world_size or gpus or 2) > gpus:  # main() would put the ranks on the CPU
        parser.error(f"--backend nccl needs CUDA GPUs, one per rank: {args.world_size or gpus or 2} ranks on this "
                     f"node but only {gpus} cuda device(s); leave out --backend or use --backend gloo, on the CPU")
    return args


if __name__ == "__main__":
    main(parse_args())
