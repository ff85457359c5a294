"""group_store, the store of a torchrun group's own (benchmarks/restart_store.py: 10 of 10 jobs through their restarts
on one torchrun and on two, where torchrun's own store burned them): rank 0's server listens at the rendezvous
address alone, loopback for a one-machine run, not on every interface. Read from /proc/net/tcp{,6} while a job
trains, the listening sockets of each worker found through its file descriptors."""
import os
import re
from pathlib import Path

from conftest import (finish, kill_launched, start, torchrun_cmd, torchrun_worker, wait_for)


WILDCARD = {"00000000", "00000000000000000000000000000000"}


def listening_sockets(pid):
    """(address in hex, port) of every socket the process listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            match = re.fullmatch(r"socket:\[(\d+)\]", os.readlink(fd))
        except OSError:
            continue
        if match:
            inodes.add(match[1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].split(":")
                found.append((address, int(port, 16)))
    return found


def test_the_group_store_listens_at_the_rendezvous_address_alone(tmp_path):
    job = start(torchrun_cmd("multigpu_torchrun.py", "--total_epochs", "100000", "--save_every", "100000"),
                cwd=tmp_path)
    try:
        wait_for(lambda: torchrun_worker(job.pid, 0) is not None or job.poll() is not None, 60, "rank 0")
        rank0 = torchrun_worker(job.pid, 0)
        # The store is up once rank 0 listens on two sockets at least: the store's and gloo's.
        wait_for(lambda: len(listening_sockets(rank0)) >= 2 or job.poll() is not None, 60, "rank 0's store")
        sockets = listening_sockets(rank0)
    finally:
        kill_launched()  # the job and every worker it started
        finish(job, 60)
    assert len(sockets) >= 2, sockets
    assert not [s for s in sockets if s[0] in WILDCARD], f"rank 0 listens on every interface: {sockets}"
    assert {address for address, _ in sockets} == {"0100007F"}, sockets  # 127.0.0.1, in /proc's byte order
