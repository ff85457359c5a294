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
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  imported before any process group: docs/failures.md, clean exits
import torch.nn.functional as F
from mpi4py import MPI
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ddp_common import cli, collectives, launchers, mpi, snapshot
from ddp_common.data import regression_dataset
from ddp_common.devices import check_backend
from ddp_common.errors import UsageError
from ddp_common.models import MLP
from ddp_common.progress import summary_line


def main(args):
    if launchers.launched_by_torchrun():
        raise UsageError("run_with_mpirun.py takes its ranks from mpirun, not torchrun; "
                         "run `mpirun -np 2 python run_with_mpirun.py`")
    comm = MPI.COMM_WORLD
    rank, world_size = comm.Get_rank(), comm.Get_size()
    local_rank, local_world_size, local_source = mpi.local_rank_and_size(comm)
    # No rendezvous address from mpirun: rank 0 picks one and sends it to every rank over MPI itself.
    address, port = comm.bcast(mpi.rendezvous_address(local_world_size == world_size) if rank == 0 else None, root=0)
    launcher = "mpirun" if launchers.launched_by_mpirun() else "no launcher: MPI runs this process as a world of one"
    chosen = "from the environment" if "MASTER_ADDR" in os.environ else "chosen by rank 0, sent by MPI bcast"
    collectives.say(f"Process {rank}: rank from MPI.COMM_WORLD.Get_rank(), local rank {local_rank} from "
                    f"{local_source}, world size {world_size} from MPI.COMM_WORLD.Get_size(), master "
                    f"{address}:{port} {chosen} ({launcher})")
    mpi.share_cores(local_world_size)  # mpirun, unlike torchrun, leaves each process all the cores
    accelerator = torch.accelerator.current_accelerator(check_available=True)  # None without a usable GPU
    device = torch.device(accelerator.type, local_rank) if accelerator else torch.device("cpu")
    backend = check_backend(args.backend or dist.get_default_backend_for_device(device), device, local_world_size)
    if accelerator:  # before the process group, so NCCL binds this process to its own GPU
        torch.accelerator.set_device_index(device.index)
    store = None
    if backend == "mpi":  # ranks and transport from MPI itself
        dist.init_process_group("mpi", timeout=args.timeout)
        # The MPI backend keeps no key-value store; the barrier check counts arrivals in one.
        store = dist.TCPStore(address, port, world_size, is_master=rank == 0, timeout=args.timeout)
    else:
        dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=rank, world_size=world_size,
                                timeout=args.timeout, device_id=device if accelerator else None)
    if args.train:
        train(args, device)
    else:
        collectives.announce(rank, world_size, device)
        checks = collectives.run_all(device, store)
        # The same sum through torch and through MPI's own allreduce must agree.
        summed = torch.tensor([rank + 1], device=device)
        dist.all_reduce(summed)
        checks.append(collectives.Check("all_reduce vs MPI allreduce", [comm.allreduce(rank + 1)], summed.tolist()))
        collectives.report(checks, device)
    dist.destroy_process_group()


def train(args, device):
    """The tutorial's training (multigpu_torchrun.py), step for step, so the weights come out bitwise the same."""
    torch.manual_seed(args.seed)
    dataset = regression_dataset(2048, seed=args.seed)
    model = MLP(input_size=20).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    speaks = dist.get_rank() == 0  # all ranks hold the same model: rank 0 logs and saves for all
    epochs_run, state = 0, snapshot.claim(args.snapshot_path, saves=speaks)
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        epochs_run = state["epochs_run"]
        if speaks:
            print(f"Resuming from {args.snapshot_path} at epoch {epochs_run}", flush=True)
    model = DDP(model, device_ids=[device.index] if device.type != "cpu" else None)
    data = DataLoader(dataset, batch_size=args.batch_size, sampler=DistributedSampler(dataset, seed=args.seed))
    if epochs_run >= args.total_epochs:
        if speaks:
            print(f"Nothing to do: {args.snapshot_path} already holds {epochs_run} epochs (--total_epochs "
                  f"{args.total_epochs}); raise --total_epochs to train on", flush=True)
        return
    start = time.perf_counter()
    for epoch in range(epochs_run, args.total_epochs):
        data.sampler.set_epoch(epoch)
        loss_sum = torch.zeros((), device=device)
        for source, targets in data:
            optimizer.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(source.to(device)), targets.to(device))
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach()
        dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
        loss = loss_sum.item() / len(data)
        if speaks:
            print(f"Epoch {epoch} | Batchsize {args.batch_size} | Steps {len(data)} | Loss {loss:.6f}", flush=True)
        if speaks and ((epoch + 1) % args.save_every == 0 or epoch + 1 == args.total_epochs):
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "rng": torch.get_rng_state(), "epochs_run": epoch + 1}
            snapshot.save(state, args.snapshot_path)
            print(f"Epoch {epoch} | Snapshot saved at {args.snapshot_path}", flush=True)
    epochs = args.total_epochs - epochs_run
    if speaks:
        print(summary_line(epochs, epochs * len(data), loss, epochs * len(dataset), time.perf_counter() - start))


if __name__ == "__main__":
    parser = cli.training_parser(__doc__, distributed=True)
    parser.add_argument("--train", action="store_true",
                        help="train the tutorial model as multigpu_torchrun.py does, instead of the collectives")
    cli.run(main, parser)
