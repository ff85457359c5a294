"""Killed workers, killed saves, dead peers and lost links: real SIGKILLs sent to real processes.

Every wait here is on a file or a process state, never a fixed sleep.
"""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import (BIN, HANG_GUARD_S, PROGRAMS, REPO, assert_same_training_state, children, clean_env, environ,
                      finish, free_port, load_snapshot, mpi_env, mpirun_cmd, python_cmd, rank_0_env, run, start,
                      stopped_worker, torchrun_cmd, torchrun_worker, wait_for)

FLAGS = ("--save_every", "2", "--batch_size", "16")
EPOCHS = "8"  # long enough that a kill after the first snapshot (epoch 2) and one after epoch 6 land before the end


def running(pid, script):
    try:
        return script.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def descendants(pid):
    found = children(pid)
    return found + [grandchild for child in found for grandchild in descendants(child)]


def kill_tree(process):
    for pid in [process.pid, *descendants(process.pid)]:  # torchrun's workers live in their own sessions
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# torchrun's two ways of giving workers a rendezvous store: its own, shared with the workers (the default
# since torch 2.5), which outlives restarts with the previous group's keys in it; or one per group, which
# TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 selects. The scripts must survive restarts under both: the single-node
# restarts (two of them, the harder case for a store that keeps old keys) run under the default, the multinode
# restart under one store per group. Each restart launch costs a whole run: each store is proven once.
STORES = {"torchrun-default": clean_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1":
          clean_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The snapshot of a 2-rank torchrun run that nobody disturbed."""
    directory = tmp_path_factory.mktemp("uninterrupted")
    run(torchrun_cmd("multigpu_torchrun.py", "--total_epochs", EPOCHS, *FLAGS), cwd=directory)
    return directory / "multigpu_torchrun.pt"


@pytest.mark.slow
@pytest.mark.parametrize("store", ["torchrun-default"])
def test_torchrun_restarts_killed_workers_and_ends_bitwise_equal(tmp_path, uninterrupted, store):
    """Two SIGKILLs at different points (rank 1 after the first snapshot, then rank 0 of the restarted group
    after its next one) with --max_restarts=2: a restart burned on the old group's addresses would fail the job."""
    # 64 steps an epoch, a snapshot every 2: rank 1 stopped (by the probe) and killed 10 steps after the epoch-2
    # snapshot, rank 0 of the restarted group 10 steps after its epoch-6 one (256 steps after its resume).
    env = {**STORES[store], "DDP_EXAMPLES_PROBE_SAMPLES": str(tmp_path / "probe"),
           "DDP_EXAMPLES_PROBE_STOP_AT": "1:0:138,0:1:266"}
    (tmp_path / "probe").mkdir()
    job = start(torchrun_cmd("multigpu_torchrun.py", "--total_epochs", EPOCHS, *FLAGS, extra=("--max_restarts=2",)),
                cwd=tmp_path, env=env)
    os.kill(stopped_worker(job, 1), signal.SIGKILL)
    os.kill(stopped_worker(job, 0, restart=1), signal.SIGKILL)
    out = finish(job, HANG_GUARD_S)
    assert job.returncode == 0, out
    resumed = re.findall(r"^Resuming from multigpu_torchrun.pt at epoch (\d+)", out, re.M)
    assert resumed == ["2", "6"], out
    snapshot = tmp_path / "multigpu_torchrun.pt"
    assert "connectFullMesh failed" not in out, "no restart may fail on a previous group's addresses"
    assert_same_training_state(uninterrupted, snapshot)


def test_a_worker_killed_while_saving_leaves_the_previous_snapshot(tmp_path, uninterrupted):
    """From a copy of the uninterrupted run's snapshot (epoch 8), one epoch more, at 1 rank: rank 0 alone saves the
    snapshot (the other ranks' part in a save is none), in the environment torchrun gives it (rank_0_env), without
    torchrun: a process less a launch, and the launcher has no part in a save."""
    path = tmp_path / "multigpu_torchrun.pt"
    path.write_bytes(uninterrupted.read_bytes())
    before = path.read_bytes()
    more = str(int(EPOCHS) + 1)
    # A real SIGKILL in the middle of the script's own save: torch.save writes part of the file, then rank 0 dies.
    killed = run([sys.executable, PROGRAMS / "dying_save.py", REPO / "multigpu_torchrun.py", "--total_epochs", more,
                  *FLAGS], cwd=tmp_path, check=False, env=rank_0_env(1, MASTER_PORT=free_port()))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert f"Resuming from multigpu_torchrun.pt at epoch {EPOCHS}" in killed.stdout
    assert path.read_bytes() == before, "the old snapshot must be untouched"
    assert (tmp_path / "multigpu_torchrun.pt.tmp").read_bytes() == b"the first half of a snapshot"

    out = run(python_cmd("multigpu_torchrun.py", "--total_epochs", more, *FLAGS), cwd=tmp_path,
              env=rank_0_env(1, MASTER_PORT=free_port())).stdout
    assert f"Resuming from multigpu_torchrun.pt at epoch {EPOCHS}" in out
    assert load_snapshot(path)["epochs_run"] == int(more)
    assert not (tmp_path / "multigpu_torchrun.pt.tmp").exists(), "the next save replaces what a dead writer left"


@pytest.mark.parametrize("first", ["mp.spawn", "the survivor"])
def test_mp_spawn_stops_every_rank_when_one_is_killed(tmp_path, first):
    """Whichever notices first, mp.spawn (it stops the other rank) or the other rank (its all-reduce fails and it
    exits), the line names the killed rank. Holding mp.spawn's process (SIGSTOP) until the survivor has exited
    makes the second order certain: it comes on its own when a loaded machine is slow to wake mp.spawn."""
    job = start(python_cmd("multigpu.py", "--world_size", "2", "--total_epochs", "100000", "--save_every", "1",
                           "--timeout", "20"), cwd=tmp_path)
    wait_for(lambda: (tmp_path / "multigpu.pt").exists() or job.poll() is not None, 120, "the first snapshot")
    ranks = [pid for pid in children(job.pid) if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()]
    assert len(ranks) == 2, ranks
    if first == "the survivor":
        os.kill(job.pid, signal.SIGSTOP)
    os.kill(max(ranks), signal.SIGKILL)
    if first == "the survivor":
        # A child that exited stays a zombie ("Z") until its stopped parent reaps it.
        wait_for(lambda: Path(f"/proc/{min(ranks)}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z", 60,
                 "rank 0 to exit")
        os.kill(job.pid, signal.SIGCONT)
    out = finish(job, 60)
    assert job.returncode == 1, out
    assert re.search(r"^process 1 terminated with signal SIGKILL; mp.spawn stopped the others\. Start again", out,
                     re.M), out
    # Rank 0's all-reduce can fail before mp.spawn stops it: that error (gloo's) is the only traceback allowed.
    tracebacks = out.split("Traceback (most recent call last):")[1:]
    assert all(re.search(r"Connection (closed|reset) by peer", traceback) for traceback in tracebacks), out
    assert tracebacks or first == "mp.spawn", out
    assert not any(running(pid, "spawn_main") for pid in ranks), "every rank must be gone when the job ends"
    assert load_snapshot(tmp_path / "multigpu.pt")["epochs_run"] >= 1


def multinode_agent_cmd(node, port, *args, extra=()):
    """torchrun for node `node` of two on 127.0.0.1, one process each. Node 0's agent hosts the rendezvous
    store (both could: they share the address), so that node 1 can die without taking the store along; an
    agent that loses the store stops its own workers before they can tell what happened."""
    return [BIN / "torchrun", "--nnodes=2", f"--node_rank={node}", "--nproc_per_node=1", "--rdzv_id=test",
            "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_conf=is_host={int(node == 0)}",
            *extra, REPO / "multinode.py", "--snapshot_path", f"node{node}.pt", *args]


def multinode_agent(cwd, node, port, *args, extra=(), env=None):
    return start(multinode_agent_cmd(node, port, *args, extra=extra), cwd, env)


@pytest.mark.slow
@pytest.mark.parametrize("store", ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"])
def test_multinode_restart_ends_bitwise_equal(tmp_path, uninterrupted, store):
    """Two nodes of one process each train exactly what multigpu_torchrun.py trains with two processes."""
    port = free_port()
    # Node 1's worker (rank 1) stopped by the probe 10 steps after the epoch-2 snapshot, and killed.
    env = {**STORES[store], "DDP_EXAMPLES_PROBE_SAMPLES": str(tmp_path / "probe"),
           "DDP_EXAMPLES_PROBE_STOP_AT": "1:0:138"}
    (tmp_path / "probe").mkdir()
    agents = [multinode_agent(tmp_path, node, port, "--total_epochs", EPOCHS, *FLAGS, extra=("--max_restarts=3",),
                              env=env) for node in (0, 1)]
    os.kill(stopped_worker(agents[1], 0), signal.SIGKILL)
    outputs = [finish(agent, HANG_GUARD_S) for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], outputs
    assert "Resuming from node0.pt at epoch 2\n" in outputs[0], outputs[0]
    for node in (0, 1):
        assert_same_training_state(uninterrupted, tmp_path / f"node{node}.pt")


def test_multinode_survivor_exits_within_the_timeout_when_a_node_dies(tmp_path):
    """Each node under python -m torchdiagnose (docs/hangs.md): the survivor names the dead rank in one line."""
    port = free_port()
    agents = [start([sys.executable, "-m", "torchdiagnose", "--timeout", "20",
                     *multinode_agent_cmd(node, port, "--total_epochs", "100000", "--save_every", "1",
                                          "--timeout", "20")], tmp_path, clean_env(PYTHONPATH=REPO))
              for node in (0, 1)]
    wait_for(lambda: any(torchrun_worker(pid, local_rank=0) for pid in children(agents[0].pid))
             or agents[0].poll() is not None, 120, "node 0's worker")
    wait_for(lambda: (tmp_path / "node1.pt").exists() or agents[1].poll() is not None, 120, "node 1's snapshot")
    survivor = next(filter(None, (torchrun_worker(pid, local_rank=0) for pid in children(agents[0].pid))), None)
    assert survivor, "node 0's worker should be training"
    kill_tree(agents[1])  # the whole node: agent and worker
    # The survivor's worker (the script, not torchrun's own teardown) gives up within its --timeout of 20 s.
    began = time.monotonic()
    wait_for(lambda: not running(survivor, "multinode.py"), 20 + 15, "the survivor's worker to give up")
    print(f"the survivor's worker gave up {time.monotonic() - began:.1f}s after its peer node died")
    out = finish(agents[0], 60)
    agents[1].communicate()
    assert agents[0].returncode != 0
    # The dead rank is named, or, where the dead node held rank 0 and with it the group's store, the store's host.
    assert re.search(r"^diagnose: collective .* is gone", out, re.M), out[-3000:]
    assert load_snapshot(tmp_path / "node0.pt")["epochs_run"] >= 1


def test_a_node_that_never_arrives_ends_the_rendezvous_within_join_timeout(tmp_path):
    lonely = multinode_agent(tmp_path, 0, free_port(), "--total_epochs", "2",
                             extra=("--rdzv_conf=is_host=1,join_timeout=5",))
    began = time.monotonic()
    out = finish(lonely, 90)
    assert lonely.returncode != 0
    assert time.monotonic() - began < 60
    assert "RendezvousTimeoutError" in out, out
    assert not (tmp_path / "node0.pt").exists()


class NetworkNamespaces:
    """Two network namespaces joined by a veth pair: two "machines" with their own addresses."""

    def __init__(self):
        tag = f"{os.getpid() % 100000}"
        self.names = [f"ddp{tag}n0", f"ddp{tag}n1"]
        self.links = [f"ddp{tag}v0", f"ddp{tag}v1"]
        subnet = 100 + os.getpid() % 150
        self.addresses = [f"10.213.{subnet}.1", f"10.213.{subnet}.2"]

    def __enter__(self):
        try:
            for name in self.names:
                self.ip("netns", "add", name)
            self.ip("link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1])
            for name, link, address in zip(self.names, self.links, self.addresses):
                self.ip("link", "set", link, "netns", name)
                self.ip("-n", name, "addr", "add", f"{address}/24", "dev", link)
                self.ip("-n", name, "link", "set", link, "up")
                self.ip("-n", name, "link", "set", "lo", "up")
        except (OSError, subprocess.CalledProcessError) as error:
            self.__exit__()
            pytest.skip(f"cannot build network namespaces here (needs root and iproute2): {error}")
        return self

    def __exit__(self, *exc):
        for name in self.names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)  # takes the veth pair along

    @staticmethod
    def ip(*args):
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    def set_link(self, node, state):
        self.ip("-n", self.names[node], "link", "set", self.links[node], state)

    def agent(self, cwd, node, port, *args):
        """torchrun for node `node` inside its namespace; gloo and the agent use the veth address."""
        env = clean_env(GLOO_SOCKET_IFNAME=self.links[node])
        cmd = ["ip", "netns", "exec", self.names[node], BIN / "torchrun", "--nnodes=2", "--nproc_per_node=1",
               "--rdzv_id=netns", "--rdzv_backend=c10d", f"--rdzv_endpoint={self.addresses[0]}:{port}",
               f"--local_addr={self.addresses[node]}",
               # The agent that owns the endpoint's address hosts the store; it cannot tell by hostname here.
               f"--rdzv_conf=join_timeout=60,read_timeout=15,is_host={int(node == 0)}", REPO / "multinode.py",
               "--snapshot_path", f"node{node}.pt", "--timeout", "10", *args]
        return start(cmd, cwd, env)


@pytest.mark.slow
def test_multinode_across_a_real_link_stops_when_it_goes_down_and_resumes(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    with NetworkNamespaces() as net:
        port = free_port()
        agents = [net.agent(tmp_path, node, port, "--total_epochs", "100000", "--save_every", "1") for node in (0, 1)]
        wait_for(lambda: all((tmp_path / f"node{n}.pt").exists() for n in (0, 1))
                 or any(a.poll() is not None for a in agents), 120, "both nodes' snapshots")
        workers = [pid for agent in agents for pid in children(agent.pid)]
        assert len(workers) == 2, workers
        net.set_link(0, "down")
        began = time.monotonic()
        wait_for(lambda: not any(running(pid, "multinode.py") for pid in workers), 10 + 45,
                 "the workers to give up after the link went down (the timeout is 10s)")
        print(f"both workers gave up {time.monotonic() - began:.1f}s after the link went down")
        # torchrun's agent on the cut-off node keeps waiting on its rendezvous store; with the link back it
        # learns of the failure and exits.
        net.set_link(0, "up")
        outputs = [finish(agent, HANG_GUARD_S) for agent in agents]
        assert all(agent.returncode != 0 for agent in agents), outputs

        epochs = [load_snapshot(tmp_path / f"node{n}.pt")["epochs_run"] for n in (0, 1)]
        assert epochs[0] == epochs[1], epochs
        port = free_port()
        agents = [net.agent(tmp_path, node, port, "--total_epochs", str(epochs[0] + 2), "--save_every", "1")
                  for node in (0, 1)]
        outputs = [finish(agent, 120) for agent in agents]
        assert [agent.returncode for agent in agents] == [0, 0], outputs
        assert f"Resuming from node0.pt at epoch {epochs[0]}" in outputs[0], outputs[0]
        assert load_snapshot(tmp_path / "node1.pt")["epochs_run"] == epochs[0] + 2


def test_mpirun_stops_every_rank_when_one_is_killed(tmp_path):
    job = start(mpirun_cmd("run_with_mpirun.py", "--train", "--total_epochs", "100000", "--save_every", "1",
                           "--timeout", "20"), cwd=tmp_path, env=mpi_env())
    wait_for(lambda: (tmp_path / "run_with_mpirun.pt").exists() or job.poll() is not None, 120, "the first snapshot")
    ranks = [pid for pid in descendants(job.pid) if running(pid, "run_with_mpirun.py")]
    victim = [pid for pid in ranks if environ(pid).get("OMPI_COMM_WORLD_RANK") == "1"]
    assert len(ranks) == 2 and len(victim) == 1, ranks
    os.kill(victim[0], signal.SIGKILL)
    began = time.monotonic()
    out = finish(job, 60)
    assert job.returncode != 0, out
    assert time.monotonic() - began < 30, "mpirun must stop the other ranks promptly"
    assert not any(running(pid, "run_with_mpirun.py") for pid in ranks)
    assert load_snapshot(tmp_path / "run_with_mpirun.pt")["epochs_run"] >= 1
