"""Where the processes meet: free ports, addresses checked before any process starts, and a store of each
process group's own under torchrun, so that a restarted group never reads its dead predecessor's addresses."""
import os
import socket
import sys
import time
import uuid
from datetime import timedelta

import torch.distributed as dist

from ddp_common.errors import PeerLostError, UsageError
from ddp_common.launchers import check_elastic_launch


def free_port(host="127.0.0.1"):
    """A port nobody listens on right now (the OS picks it), so two jobs on one machine never collide."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def check_can_listen(host, port):
    """Fail fast, before any process starts, if rank 0 could not open its rendezvous port on `host` (an IPv4 or
    IPv6 address, or a name of this machine)."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as error:
        raise UsageError(f"master address {host!r} does not resolve ({error.strerror}); "
                         "give an address of this machine, e.g. 127.0.0.1") from None
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # As TCPStore does: the TIME_WAIT connections a finished run leaves on its port must not count as
        # "in use" (a live listener still does).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
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

    The one case torchrun's shared store cannot serve: an elastic job (torchrun --nnodes=MIN:MAX), where it hangs a
    node that joins later before any worker runs. So the first workers stop at once, with the fix, here
    (launchers.check_elastic_launch); rank 0 also warns on stderr of an elastic job without --max_restarts.
    """
    warning = check_elastic_launch(rank)
    if warning:
        print(warning, file=sys.stderr, flush=True)
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
            # A plain connection first: at a dead rank 0's address it is refused at once, where TCPStore would
            # retry until its timeout and log each try, with a C++ backtrace, on stderr.
            socket.create_connection((host, int(group_port)), timeout=STALE_CHECK_S).close()
            store = dist.TCPStore(host, int(group_port), is_master=False, timeout=timedelta(seconds=STALE_CHECK_S))
            if store.get("token").decode() == token:
                store.set_timeout(timedelta(seconds=timeout))
                return store
        except (OSError, dist.DistError):  # nobody there, or a store without our token: the previous group's post
            pass
        if time.monotonic() > deadline:
            raise PeerLostError(f"rank 0 posted no store for this group within --timeout {timeout:g}s; "
                                "check that rank 0 started and is reachable")
        time.sleep(0.1)
