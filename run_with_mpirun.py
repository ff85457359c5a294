"""One job, three launchers (3 of 3): mpirun starts the processes, MPI numbers them, and the script turns
that into what torch.distributed needs.

    mpirun -np 4 python run_with_mpirun.py                        # collectives, checked
    mpirun -np 4 python run_with_mpirun.py --backend mpi          # torch's MPI backend (MPI builds only)
    mpirun -np 2 python run_with_mpirun.py --train 50 10          # DDP training, as multigpu_torchrun.py trains
    mpirun -H host1:4,host2:4 -x MASTER_ADDR=ADDRESS_OF_HOST1 python run_with_mpirun.py   # two hosts
    python run_with_mpirun.py                                     # no mpirun: a world of one
    .venv/bin/mpirun -np 2 .venv/bin/python run_with_mpirun.py    # a venv that is not activated (see below)

mpirun provides: the processes on every host, the rank and size (MPI.COMM_WORLD), the local rank
(OMPI_COMM_WORLD_LOCAL_RANK and the like) and a channel between the ranks. It does not provide a
rendezvous address for torch: rank 0 picks one and broadcasts it over MPI. As root, Open MPI also wants
OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1, and more ranks than cores need --oversubscribe.
mpirun starts the program it is given as found on PATH: from a venv that is not activated, `python` is the
system's (No module named 'torch'), so name the venv's python, as in the last command.
Compare run_with_torchrun.py and run_with_python.py.
"""
import argparse
import os
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.nn  # before any process group: docs/failures.md, clean exits
import torch.nn.functional as F
from mpi4py import MPI
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from models_and_data import MLP, regression_dataset

# Each MPI implementation names the rank within the node, and its launch, differently.
LOCAL_RANK_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK")
LAUNCH_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE")


def say(text):
    os.write(1, f"{text}\n".encode())  # one write: the ranks share one stdout, their lines never mix


def check_collectives(rank, world_size, device, store):
    """Every collective on integers made from the rank numbers, so that each rank knows the exact answer it must
    get (integer sums and means need no tolerance): [(collective, expected, got)] as this rank saw them."""
    def tensor(*values):
        return torch.tensor(values, dtype=torch.int64, device=device)

    total = world_size * (world_size + 1) // 2  # 1 + 2 + ... + world_size
    checks = []
    summed = tensor(rank + 1, 10 * (rank + 1))
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)
    checks.append(("all_reduce sum", [total, 10 * total], summed.tolist()))
    averaged = tensor(world_size * (rank + 1))  # the mean is total: an integer, exact
    if dist.get_backend() == "nccl":
        dist.all_reduce(averaged, op=dist.ReduceOp.AVG)
    else:  # gloo and MPI have no AVG: sum, then divide
        dist.all_reduce(averaged, op=dist.ReduceOp.SUM)
        averaged //= world_size
    checks.append(("all_reduce avg", [total], averaged.tolist()))
    gathered = [tensor(0, 0) for _ in range(world_size)]
    dist.all_gather(gathered, tensor(rank, rank * rank))
    checks.append(("all_gather", [[r, r * r] for r in range(world_size)], [t.tolist() for t in gathered]))
    source = world_size - 1  # not rank 0: a broadcast that did nothing would pass on rank 0 anyway
    broadcast = tensor(100 + rank)
    dist.broadcast(broadcast, src=source)
    checks.append((f"broadcast from {source}", [100 + source], broadcast.tolist()))
    for destination in range(world_size):  # only the destination gets the result: each rank in turn
        reduced = tensor((rank + 1) * (destination + 1))
        dist.reduce(reduced, dst=destination, op=dist.ReduceOp.SUM)
        if destination == rank:
            checks.append(("reduce to each rank in turn", [total * (rank + 1)], reduced.tolist()))
    # A barrier returns nothing; it promises that nobody leaves before everyone arrived: each rank counts
    # itself in on the way in, and on the way out finds them all.
    store.add("arrived", 1)
    dist.barrier()
    checks.append(("barrier", f"{world_size} arrived", f"{store.add('arrived', 0)} arrived"))
    return checks


def report(checks, rank, world_size, device):
    """Rank 0 prints the table with the ranks where each check failed; a rank that got a wrong value stops."""
    wrong = torch.zeros(world_size, len(checks), dtype=torch.int64, device=device)
    wrong[rank] = torch.tensor([expected != got for _, expected, got in checks], dtype=torch.int64, device=device)
    dist.all_reduce(wrong)  # row r: the checks that failed on rank r
    if rank == 0:
        rows = [("collective", "expected", "got", "ok")]
        for column, (name, expected, got) in enumerate(checks):
            bad = wrong[:, column].nonzero().flatten().tolist()
            rows.append((name, str(expected), str(got), "NO on rank " + ", ".join(map(str, bad)) if bad else "yes"))
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = [" | ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "-+-".join("-" * width for width in widths))
        say(f"Collectives on {world_size} rank(s), as rank 0 saw them:\n" + "\n".join(lines))
    failed = [f"{name} gave {got}, expected {expected}" for name, expected, got in checks if expected != got]
    if failed:
        sys.exit(f"error: rank {rank} got wrong results: " + "; ".join(failed))


def main(args):
    comm = MPI.COMM_WORLD
    rank, world_size = comm.Get_rank(), comm.Get_size()
    # The ranks on this node: a split of the world by shared memory; the local rank from the MPI
    # implementation's variable where it sets one.
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank, local_world_size, local_source = node.Get_rank(), node.Get_size(), "an MPI shared-memory split"
    node.Free()
    for name in LOCAL_RANK_VARIABLES:
        if name in os.environ:
            local_rank, local_source = int(os.environ[name]), name
            break
    # No rendezvous address from mpirun: rank 0 picks one and sends it to every rank over MPI itself. On one
    # host 127.0.0.1; on several, MASTER_ADDR (an address of rank 0's host) or the one its name resolves to.
    if rank == 0:
        address = os.environ.get("MASTER_ADDR") or (
            "127.0.0.1" if local_world_size == world_size else socket.gethostbyname(socket.gethostname()))
        with socket.socket() as sock:  # a free port, unless MASTER_PORT names one
            sock.bind(("127.0.0.1" if local_world_size == world_size else "", 0))
            port = int(os.environ.get("MASTER_PORT") or sock.getsockname()[1])
    address, port = comm.bcast((address, port) if rank == 0 else None, root=0)
    launcher = "mpirun" if any(name in os.environ for name in LAUNCH_VARIABLES) else \
        "no launcher: MPI runs this process as a world of one"
    chosen = "from the environment" if "MASTER_ADDR" in os.environ else "chosen by rank 0, sent by MPI bcast"
    say(f"Process {rank}: rank from MPI.COMM_WORLD.Get_rank(), local rank {local_rank} from {local_source}, "
        f"world size {world_size} from MPI.COMM_WORLD.Get_size(), master {address}:{port} {chosen} ({launcher})")
    if "OMP_NUM_THREADS" not in os.environ:  # mpirun, unlike torchrun, leaves each process every core
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))
    accelerator = torch.accelerator.current_accelerator(check_available=True)  # None without a usable GPU
    if accelerator and local_world_size > torch.accelerator.device_count():
        accelerator = None  # more processes than devices (a Mac has one mps device): every process on the CPU
    device = torch.device(accelerator.type, local_rank) if accelerator else torch.device("cpu")
    backend = args.backend or dist.get_default_backend_for_device(device)
    if backend == "nccl" and device.type != "cuda":
        sys.exit("error: --backend nccl needs a CUDA GPU for each process; leave --backend out for gloo on the CPU")
    if backend == "mpi" and not dist.is_mpi_available():
        sys.exit("error: this torch build has no MPI backend (torch.distributed.is_mpi_available() is False); "
                 "use --backend gloo on CPUs or --backend nccl on GPUs")
    if accelerator:  # before the process group, so NCCL binds this process to its own GPU
        torch.accelerator.set_device_index(device.index)
    timeout = timedelta(seconds=args.timeout)
    # Rank 0 hosts the rendezvous store at address:port, the others connect: init_method="tcp://..." in the open.
    store = dist.TCPStore(address, port, world_size, is_master=rank == 0, timeout=timeout)
    if backend == "mpi":  # ranks and transport from MPI itself; the store serves the barrier check
        dist.init_process_group("mpi", timeout=timeout)
    else:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                                device_id=device if accelerator else None)
    if args.train:
        try:
            train(args, rank, device)
        except RuntimeError as error:
            if "Connection" not in str(error):
                raise
            # A peer died mid-collective (mpirun is stopping this rank too). Leave now: Python's own exit would
            # destroy gloo's threads still bound to the dead peer, and abort ("terminate called").
            print(f"error: rank {rank} lost a peer: {str(error).splitlines()[0][-120:]}", file=sys.stderr, flush=True)
            os._exit(1)
    else:
        host = socket.gethostname()
        say(f"{host}$Process {rank}: {rank} # {world_size}")
        say(f"{host}$Process {rank}: Default device is set to {device.index if accelerator else 'cpu'}")
        checks = check_collectives(rank, world_size, device, store)
        summed = torch.tensor([rank + 1], device=device)  # the same sum through torch and through MPI itself
        dist.all_reduce(summed)
        checks.append(("all_reduce vs MPI allreduce", [comm.allreduce(rank + 1)], summed.tolist()))
        report(checks, rank, world_size, device)
    dist.destroy_process_group()


def train(args, rank, device):
    """The tutorial's training (multigpu_torchrun.py), step for step, so the weights come out bitwise the same."""
    path, speaks = args.snapshot_path, rank == 0  # all ranks hold the same model: rank 0 logs and saves for all
    torch.manual_seed(args.seed)
    dataset = regression_dataset(2048, seed=args.seed)
    model = MLP(input_size=20).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    epochs_run = 0
    if os.path.exists(path):
        try:  # a bad file named in one line, not a traceback; training on would overwrite it
            state = torch.load(path, map_location="cpu")
        except Exception as error:  # noqa: BLE001  whatever a damaged file raises
            sys.exit(f"error: cannot read the snapshot {path} ({type(error).__name__}: truncated, or not a "
                     "snapshot); move it away or pass another --snapshot_path")
        try:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])  # the momentum, without which resuming is not exact
        except (KeyError, RuntimeError, ValueError) as error:
            sys.exit(f"error: the snapshot {path} is of another model or optimizer ({str(error).splitlines()[0]}); "
                     "move it away or pass another --snapshot_path")
        torch.set_rng_state(state["rng"])  # the shuffle order of the epochs to come
        epochs_run = state["epochs_run"]
        if speaks:
            print(f"Resuming from {path} at epoch {epochs_run}", flush=True)
    model = DDP(model, device_ids=[device.index] if device.type != "cpu" else None)
    data = DataLoader(dataset, batch_size=args.batch_size, sampler=DistributedSampler(dataset, seed=args.seed))
    if epochs_run >= args.total_epochs:
        if speaks:
            print(f"Nothing to do: {path} already holds {epochs_run} epochs (--total_epochs {args.total_epochs}); "
                  "raise --total_epochs to train on", flush=True)
        return
    start = time.perf_counter()
    for epoch in range(epochs_run, args.total_epochs):
        data.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        loss_sum = torch.zeros((), device=device)
        for source, targets in data:
            optimizer.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(source.to(device)), targets.to(device))
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach()
        dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)  # the loss of all ranks, not rank 0's alone
        loss = loss_sum.item() / len(data)
        if speaks:
            print(f"Epoch {epoch} | Batchsize {args.batch_size} | Steps {len(data)} | Loss {loss:.6f}", flush=True)
        if speaks and ((epoch + 1) % args.save_every == 0 or epoch + 1 == args.total_epochs):
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "rng": torch.get_rng_state(), "epochs_run": epoch + 1}
            # Written beside it, then renamed over it: a crash mid-save leaves the previous snapshot whole.
            with open(path + ".tmp", "wb") as f:
                torch.save(state, f)
                os.fsync(f.fileno())
            os.replace(path + ".tmp", path)
            print(f"Epoch {epoch} | Snapshot saved at {path}", flush=True)
    wall, epochs = time.perf_counter() - start, args.total_epochs - epochs_run
    if speaks:
        print(f"Summary: epochs {epochs} | steps {epochs * len(data)} | final loss {loss:.6f} | samples/s "
              f"{epochs * len(dataset) / wall:.1f} | wall {wall:.2f}s | world size {dist.get_world_size()} | "
              f"backend {dist.get_backend()}", flush=True)
    del model  # DDP holds the process group: free it first, so destroy_process_group frees the group


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train", action="store_true",
                        help="train the tutorial model as multigpu_torchrun.py does, instead of the collectives")
    parser.add_argument("epochs_arg", nargs="?", type=int, default=50, metavar="total_epochs", help="= --total_epochs")
    parser.add_argument("every_arg", nargs="?", type=int, default=10, metavar="save_every", help="= --save_every")
    parser.add_argument("--total_epochs", "--epochs", type=int, help="epochs in all (default 50)")
    parser.add_argument("--save_every", type=int, help="epochs between snapshots; the last is saved too (default 10)")
    parser.add_argument("--batch_size", type=int, default=32, help="samples per step and process (default 32)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data, the model and the shuffle")
    parser.add_argument("--snapshot_path", default="run_with_mpirun.pt", help="resume from and save to this file")
    parser.add_argument("--backend", choices=["nccl", "gloo", "mpi"], help="default: nccl on CUDA, gloo on the CPU")
    parser.add_argument("--timeout", type=float, default=300, help="seconds to wait for the other ranks (default 300)")
    args = parser.parse_args()
    args.total_epochs = args.epochs_arg if args.total_epochs is None else args.total_epochs
    args.save_every = args.every_arg if args.save_every is None else args.save_every
    if min(args.total_epochs, args.save_every, args.batch_size, args.timeout) <= 0:
        parser.error("--total_epochs, --save_every, --batch_size and --timeout must be positive")
    if "TORCHELASTIC_RUN_ID" in os.environ:
        parser.error("it takes its ranks from mpirun, not torchrun: run `mpirun -np 2 python run_with_mpirun.py`")
    if args.train and MPI.COMM_WORLD.Get_rank() == 0:  # the snapshot's folder checked now, not after an epoch
        check_snapshot_path(args.snapshot_path)
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
