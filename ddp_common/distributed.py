"""Backend checks, ports, torchrun's store and launcher variables, and the closing summary line."""
import os
import socket
import time
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist

from ddp_common.elastic import check_launch
from ddp_common.errors import PeerLostError, UsageError

BACKENDS = ("nccl", "gloo", "mpi")


def add_backend_arg(parser):
    parser.add_argument("--backend", choices=BACKENDS, default=None,
                        help="process-group backend (default: the device's, nccl on CUDA GPUs and gloo on the CPU)")


def check_backend(backend, device, local_world_size):
    """`backend` if this machine can run it, one process per device, with `local_world_size` processes on
    this node; otherwise a UsageError saying what to do instead."""
    if backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise UsageError("backend nccl needs CUDA GPUs and a CUDA build of torch, and this machine has neither "
                         "visible; use --backend gloo to run on the CPU")
    if backend == "mpi" and not dist.is_mpi_available():
        raise UsageError("this torch build has no MPI backend (torch.distributed.is_mpi_available() is False); "
                         "under mpirun use --backend gloo on CPUs or --backend nccl on GPUs")
    if backend == "gloo" and not dist.is_gloo_available():
        raise UsageError("this torch build has no gloo backend; use --backend nccl on GPUs")
    devices = torch.accelerator.device_count()
    if device.type != "cpu" and local_world_size > devices:
        raise UsageError(f"{local_world_size} ranks on this node but only {devices} {device.type} device(s), one "
                         f"per rank; start at most {devices} per node (torchrun --nproc_per_node={devices}), or "
                         "hide the GPUs (CUDA_VISIBLE_DEVICES=) to run every rank on the CPU")
    return backend


def share_cpu_cores(processes):
    """Before starting `processes` CPU processes on this machine: one thread per core each, as torchrun sets
    it. Otherwise every process starts a thread per core, N processes fight over the cores and DDP runs
    several times slower. A value the user set wins."""
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // processes)))


def require_torchrun(script):
    """Stop with the command to run when torchrun did not start this process (`script`: its __file__)."""
    script = os.path.basename(script)
    if not all(name in os.environ for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")):
        raise UsageError(f"{script} is started by torchrun, which sets RANK, LOCAL_RANK and WORLD_SIZE; run "
                         f"`torchrun --standalone --nproc_per_node=2 {script}`")


def synchronize(device):
    """Wait for the device to finish: GPUs run asynchronously, so a clock read without this stops early."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


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


GROUP_STORE_KEY = "ddp_examples/group_store"
STALE_CHECK_S = 3.0  # how long one try to reach a posted store may take before it counts as stale


def group_store(rank, world_size, timeout):
    """A key-value store of this process group's own, for init_process_group(store=...), under torchrun;
    None elsewhere (init_process_group then reads MASTER_ADDR and MASTER_PORT itself).

    torchrun (since torch 2.5) points its workers at its own rendezvous store, which outlives a restart
    and still holds the previous group's keys: a restarted rank can read a dead peer's address, fail to
    connect and burn the restart (pytorch/pytorch#135712). Keys cannot be prefixed with the restart count,
    since each node counts its own restarts. So rank 0 hosts a fresh store for every group and posts its
    address with a random token in torchrun's store. A stale post is told apart by itself: the previous
    group's rank 0 is dead, so nothing answers at its address, or another store does, with another token.

    In an elastic job (torchrun --nnodes=MIN:MAX) the shared store hangs a node that joins later, before any
    worker runs: every worker checks its launch first and stops with the fix (ddp_common.elastic).
    """
    check_launch(rank)
    timeout = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    # Not under torchrun, or under it with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: a fresh store each time.
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    deadline = time.monotonic() + timeout
    agent_store = dist.TCPStore(address, port, is_master=False, timeout=timedelta(seconds=timeout))
    if rank == 0:
        store = dist.TCPStore(address, 0, world_size, is_master=True, timeout=timedelta(seconds=timeout),
                              wait_for_workers=False)
        token = uuid.uuid4().hex
        store.set("token", token)
        agent_store.set(GROUP_STORE_KEY, f"{address} {store.port} {token}")
        return store
    while True:
        host, group_port, token = agent_store.get(GROUP_STORE_KEY).decode().split()
        try:
            store = dist.TCPStore(host, int(group_port), is_master=False, timeout=timedelta(seconds=STALE_CHECK_S))
            if store.get("token").decode() == token:
                store.set_timeout(timedelta(seconds=timeout))
                return store
        except dist.DistError:  # nobody there, or a store without our token: the previous group's post
            pass
        if time.monotonic() > deadline:
            raise PeerLostError(f"rank 0 posted no store for this group within --timeout {timeout:g}s; "
                                "check that rank 0 started and is reachable")
        time.sleep(0.1)


def tensor_bytes(tensors):
    """The bytes of `tensors`, each counted whole (unsharded)."""
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def optimizer_state_bytes(optimizer):
    """Bytes of the tensors in the optimizer state this rank holds: its shard under ZeroRedundancyOptimizer."""
    optimizer = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local optimizer
    return tensor_bytes(value for state in optimizer.state.values()
                        for value in state.values() if torch.is_tensor(value))


def summary_line(epochs, steps, final_loss, samples, wall_s, world_size=None, backend=None):
    """The line every training script ends with, so runs can be compared at a glance. The world size and
    backend default to the process group's (1 and none without one)."""
    if world_size is None:
        world_size, backend = (dist.get_world_size(), dist.get_backend()) if dist.is_initialized() else (1, "none")
    return (f"Summary: epochs {epochs} | steps {steps} | final loss {final_loss:.6f} | "
            f"samples/s {samples / max(wall_s, 1e-9):.1f} | wall {wall_s:.2f}s | "
            f"world size {world_size} | backend {backend}")
