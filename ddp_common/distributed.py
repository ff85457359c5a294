"""Backend and device choice, ports, launcher variables and the closing summary line."""
import os
import socket
import sys

import torch
import torch.distributed as dist

from ddp_common.cli import UsageError

BACKENDS = ("nccl", "gloo", "mpi")


def add_backend_arg(parser):
    parser.add_argument("--backend", choices=BACKENDS, default=None,
                        help="process-group backend (default: nccl when CUDA GPUs are visible, else gloo)")


def check_backend(backend, ranks_per_node):
    """Return the backend to use (None: the default for this machine), or stop with what to do instead."""
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend not in BACKENDS:
        raise UsageError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
    if backend == "nccl":
        if not torch.cuda.is_available() or not dist.is_nccl_available():
            raise UsageError("backend nccl needs CUDA GPUs and a CUDA build of torch, and this machine has "
                             "neither visible; use --backend gloo to run on the CPU")
        gpus = torch.cuda.device_count()
        if ranks_per_node > gpus:
            raise UsageError(f"{ranks_per_node} ranks on this node but only {gpus} GPU(s) for nccl; start at "
                             f"most {gpus} per node (torchrun --nproc_per_node={gpus}) or use --backend gloo")
    elif backend == "mpi" and not dist.is_mpi_available():
        raise UsageError("this torch build has no MPI backend (torch.distributed.is_mpi_available() is False); "
                         "under mpirun use --backend gloo on CPUs or --backend nccl on GPUs")
    elif backend == "gloo" and not dist.is_gloo_available():
        raise UsageError("this torch build has no gloo backend; use --backend nccl on GPUs")
    return backend


def device_for(backend, local_rank, ranks_per_node):
    """The device of this rank. With CUDA, sets it as the current device: call before init_process_group,
    so NCCL binds each process to its own GPU instead of piling every rank onto GPU 0."""
    if torch.cuda.is_available() and (backend == "nccl" or ranks_per_node <= torch.cuda.device_count()):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if "OMP_NUM_THREADS" not in os.environ:
        # Each process would otherwise start one thread per core: N ranks on C cores then fight over
        # them and DDP runs several times slower. torchrun sets OMP_NUM_THREADS itself; mp.spawn doesn't.
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // ranks_per_node))
    return torch.device("cpu")


def pick_backend_and_device(backend, local_rank, ranks_per_node):
    backend = check_backend(backend, ranks_per_node)
    return backend, device_for(backend, local_rank, ranks_per_node)


def synchronize(device):
    """Wait for the device to finish: CUDA runs asynchronously, so a clock read without this stops early."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_port(host="127.0.0.1"):
    """A port nobody listens on right now (the OS picks it), so two jobs on one machine never collide."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def check_can_listen(host, port):
    """Fail fast, before any process starts, if rank 0 could not open its rendezvous port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As TCPStore does: the TIME_WAIT connections a finished run leaves on its port must not count as
        # "in use" (a live listener still does).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except socket.gaierror as error:
            raise UsageError(f"master address {host!r} does not resolve ({error.strerror}); "
                             "give an address of this machine, e.g. 127.0.0.1") from None
        except OSError as error:
            if error.errno == 98:  # EADDRINUSE
                raise UsageError(f"port {port} on {host} is already in use; pick another master port, "
                                 "or leave it out to get a free one") from None
            where = f"{host}:{port}" if port else host  # port 0: only the address was being checked
            raise UsageError(f"cannot listen on {where} ({error.strerror}); rank 0 must run on the "
                             "master address: give an address of this machine, e.g. 127.0.0.1") from None


def torchrun_ranks(script):
    """(rank, local_rank, world_size, local_world_size) as torchrun sets them, or how to launch instead."""
    try:
        ranks = tuple(int(os.environ[name]) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"))
    except KeyError:
        raise UsageError(f"{script} is started by torchrun, which sets RANK, LOCAL_RANK and WORLD_SIZE; run "
                         f"`torchrun --standalone --nproc_per_node=2 {script}`") from None
    if (ranks[0] == 0 and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) > 0
            and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"):
        # Measured here: with the store shared, a restarted group often reads the previous group's
        # addresses, fails to connect and burns a restart (pytorch/pytorch#135712).
        print("warning: torchrun shares its rendezvous store with the workers, so restarts may fail on stale "
              "addresses; start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 when using --max-restarts",
              file=sys.stderr, flush=True)
    return ranks


def summary_line(epochs, steps, final_loss, samples, wall_s, world_size, backend):
    """The line every training script ends with, so runs can be compared at a glance."""
    return (f"Summary: epochs {epochs} | steps {steps} | final loss {final_loss:.6f} | "
            f"samples/s {samples / max(wall_s, 1e-9):.1f} | wall {wall_s:.2f}s | "
            f"world size {world_size} | backend {backend}")
