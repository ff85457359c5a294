"""Elastic training: multinode.py under torchrun --nnodes=1:2, with a node that joins and leaves a running job.

Two torchrun agents on 127.0.0.1 play the two nodes, one process each: world size 1 alone, 2 together. Every
wait is on a file or a process state. Where training could finish before the change a test waits for, the
test holds a node's worker still with SIGSTOP, as a slow machine would, and lets it go on (SIGCONT) once the
change is under way: when torchrun has sent it SIGTERM to re-form the group, or when the other node is dead.
"""
import os
import shutil
import signal
import sys

import pytest

from conftest import (BIN, REPO, assert_bitwise_equal, assert_one_line_error, clean_env, epoch_lines, finish,
                      free_port, load_snapshot, run, start, summary)
from test_reliability import kill_tree, torchrun_worker, wait_for

# What the README's elastic commands set: torchrun's shared store deadlocks a node that joins later.
ELASTIC = clean_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)
# torchrun's defaults would cost each test minutes: 30 s in which a lone node waits for more before it starts
# (last call), 15 s before a dead node is dropped (3 missed heartbeats, 5 s apart).
RDZV_CONF = "join_timeout=60,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"
EPOCHS = 12
STEPS = {1: 64, 2: 32}  # 2048 samples, batch 32 per rank: the steps of an epoch tell the world size


def agent_cmd(node, port, *args, max_restarts=3, launcher=(BIN / "torchrun",), nnodes="--nnodes=1:2"):
    return [*launcher, *([nnodes] if nnodes else []), "--nproc_per_node=1", f"--max_restarts={max_restarts}",
            "--rdzv_id=elastic", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
            f"--rdzv_conf={RDZV_CONF}", REPO / "multinode.py", "--total_epochs", str(EPOCHS), "--save_every", "1",
            "--timeout", "30", "--snapshot_path", f"node{node}.pt", *args]


# A node started now that runs its command only once the file `go` exists. Its process, which torchrun
# becomes (exec keeps the pid), exists before the other node's: torchrun orders the nodes of a rendezvous by
# address, then pid, so this node takes rank 0 when it joins.
HELD_BACK = ("import os, sys, time\n"
             "go, deadline = sys.argv[1], time.monotonic() + 300\n"
             "while not os.path.exists(go):\n"
             "    if time.monotonic() > deadline:\n"
             "        sys.exit('never told to start')\n"
             "    time.sleep(0.01)\n"
             "os.execv(sys.argv[2], sys.argv[2:])\n")


def epochs_in(path):
    return load_snapshot(path)["epochs_run"] if path.exists() else 0


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"


def signal_pending(pid, sig):
    """Whether `sig` waits to be delivered to the process: a stopped one gets it only once continued."""
    try:
        status = open(f"/proc/{pid}/status").read()
    except OSError:
        return False
    masks = [int(line.split()[1], 16) for line in status.splitlines() if line.startswith(("ShdPnd:", "SigPnd:"))]
    return any(mask & (1 << (sig - 1)) for mask in masks)


def release_when_stopped_by_torchrun(worker):
    """Let a held worker go once its agent has sent it SIGTERM to re-form the group: it ends at once."""
    wait_for(lambda: signal_pending(worker, signal.SIGTERM) or not alive(worker), 120,
             "torchrun to stop the held worker for the new node")
    os.kill(worker, signal.SIGCONT)
    wait_for(lambda: not alive(worker), 60, "the held worker to end")


def hold(agent):
    """SIGSTOP the node's worker: its training stands still, and the other node's waits on it."""
    wait_for(lambda: torchrun_worker(agent.pid, 0) or agent.poll() is not None, 120, "the node's worker")
    worker = torchrun_worker(agent.pid, 0)
    assert worker, "the node's worker should be training"
    os.kill(worker, signal.SIGSTOP)
    return worker


def phases(output):
    """The epoch lines of one node's output, split where rank 0 said the world size changed."""
    return [epoch_lines(part) for part in output.split("World size ")]


def assert_epochs(lines, first, last, world_size):
    assert [line.epoch for line in lines] == list(range(first, last + 1)), lines
    assert {line.steps for line in lines} == {STEPS[world_size]}, f"world size {world_size}: {lines}"


def test_a_late_node_without_a_snapshot_joins_and_the_rank_0_node_leaves_again(tmp_path):
    """1 -> 2 -> 1: node 1 joins with no snapshot and takes rank 0; later it dies (agent and worker), and
    node 0 finishes alone. Both changes resume from the snapshot, at the new world size."""
    port, go = free_port(), tmp_path / "go"
    late = start([sys.executable, "-c", HELD_BACK, go, *agent_cmd(1, port)], tmp_path, ELASTIC)
    first = start(agent_cmd(0, port), tmp_path, ELASTIC)
    assert late.pid < first.pid, "the late node's pid must be the lower one (pid numbers wrapped around?)"
    node0, node1 = tmp_path / "node0.pt", tmp_path / "node1.pt"

    wait_for(lambda: epochs_in(node0) >= 2 or first.poll() is not None, 120, "node 0's second snapshot")
    held = hold(first)
    joined_at = epochs_in(node0)
    assert joined_at < EPOCHS - 4, "node 0 trained on too far before it was held"
    go.touch()
    release_when_stopped_by_torchrun(held)
    wait_for(lambda: epochs_in(node1) >= joined_at + 2 or first.poll() is not None, 120,
             "node 1's snapshots after it joined")
    held = hold(first)
    kill_tree(late)  # the whole node: its agent, and its worker, which holds rank 0
    os.kill(held, signal.SIGCONT)
    wait_for(lambda: not alive(held), 60, "node 0's worker to notice that node 1 is gone")
    left_at = epochs_in(node0)
    assert joined_at < left_at < EPOCHS

    out0 = finish(first, 180)
    out1 = finish(late, 30)
    assert first.returncode == 0, out0
    assert late.returncode == -signal.SIGKILL
    # Rank 0 speaks: node 0 alone, node 1 once it joined, node 0 again once node 1 left. One line per change.
    assert out1.count("World size") == 1 and out0.count("World size") == 1, (out0, out1)
    assert (f"Resuming from node0.pt of rank 1 at epoch {joined_at}, the newest snapshot, sent to every rank "
            f"(the ranks held from none to {joined_at} epochs)\nWorld size 1 -> 2 at epoch {joined_at}\n") in out1
    assert f"Resuming from node0.pt at epoch {left_at}\nWorld size 2 -> 1 at epoch {left_at}\n" in out0
    alone, together = phases(out0), phases(out1)
    assert_epochs(alone[0][:joined_at], 0, joined_at - 1, 1)
    assert len(alone[0]) <= joined_at + 1, "node 0 may have logged one epoch past its snapshot, no more"
    # Node 1 logged until it was killed; node 0, held then, may have saved the epoch node 1 had yet to log.
    assert_epochs(together[1], joined_at, together[1][-1].epoch, 2)
    assert left_at - 2 <= together[1][-1].epoch <= left_at - 1, (together[1], left_at)
    assert_epochs(alone[1], left_at, EPOCHS - 1, 1)
    # Resumed, not restarted from scratch (whose loss would be near epoch 0's), and falling to the end.
    start_loss = alone[0][0].loss
    assert together[1][0].loss < 0.5 * start_loss and alone[1][0].loss < 0.5 * start_loss, (alone, together)
    assert alone[1][-1].loss < together[1][0].loss, "the loss falls across both changes"
    assert summary(out0).world_size == 1

    final, last_together = load_snapshot(node0), load_snapshot(node1)
    assert (final["epochs_run"], final["world_size"]) == (EPOCHS, 1)
    assert left_at - 1 <= last_together["epochs_run"] <= left_at and last_together["world_size"] == 2
    assert final["run"] == last_together["run"], "one training run across both changes"


def test_a_late_node_with_an_older_snapshot_resumes_from_the_newest_and_needs_no_restarts(tmp_path):
    """Node 1 joins with a snapshot of the same run from an earlier epoch: every rank resumes from node 0's,
    which is newer, and both nodes end with the same snapshot. A join costs no restart: --max_restarts=0."""
    port = free_port()
    node0, node1 = tmp_path / "node0.pt", tmp_path / "node1.pt"
    first = start(agent_cmd(0, port, max_restarts=0), tmp_path, ELASTIC)
    wait_for(lambda: epochs_in(node0) >= 1 or first.poll() is not None, 120, "node 0's first snapshot")
    shutil.copyfile(node0, node1)  # rename makes every save whole: the copy is a complete older snapshot
    older = epochs_in(node1)
    wait_for(lambda: epochs_in(node0) >= older + 2 or first.poll() is not None, 120, "newer snapshots on node 0")
    held = hold(first)
    joined_at = epochs_in(node0)
    assert joined_at < EPOCHS - 2, "node 0 trained on too far before it was held"
    late = start(agent_cmd(1, port, max_restarts=0), tmp_path, ELASTIC)
    release_when_stopped_by_torchrun(held)

    out0, out1 = finish(first, 180), finish(late, 60)
    assert [first.returncode, late.returncode] == [0, 0], (out0, out1)
    assert (f"Resuming from node0.pt of rank 0 at epoch {joined_at}, the newest snapshot, sent to every rank "
            f"(the ranks held from {older} to {joined_at} epochs)\nWorld size 1 -> 2 at epoch {joined_at}\n") in out0
    assert out0.count("World size") == 1 and "World size" not in out1
    assert "warning: an elastic job (torchrun --nnodes=1:2) without --max_restarts" in out0
    before, after = phases(out0)
    assert_epochs(after, joined_at, EPOCHS - 1, 2)
    assert after[0].loss < 0.5 * before[0].loss, "resumed from the snapshot, not from scratch"
    assert after[-1].loss < after[0].loss
    assert summary(out0).world_size == 2
    a, b = load_snapshot(node0), load_snapshot(node1)
    assert a["epochs_run"] == b["epochs_run"] == EPOCHS and a["world_size"] == b["world_size"] == 2
    assert_bitwise_equal(a["model"], b["model"], "node snapshots")


SHARED_STORE_LAUNCHES = {  # both ways torchrun learns the range of nodes
    "torchrun --nnodes=1:2": ((BIN / "torchrun",), "--nnodes=1:2", clean_env()),
    "PET_NNODES=1:2 python -m torch.distributed.run": ((sys.executable, "-m", "torch.distributed.run"), None,
                                                       clean_env(PET_NNODES="1:2")),  # as the Kubeflow operator does
}


@pytest.mark.parametrize("launch", SHARED_STORE_LAUNCHES)
def test_an_elastic_job_on_torchruns_shared_store_stops_at_once_with_the_fix(tmp_path, launch):
    """Without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, a node that joins later would deadlock the agents for 60 s
    with no worker running to say why: the first workers stop with the fix instead, before any training."""
    launcher, nnodes, env = SHARED_STORE_LAUNCHES[launch]
    result = run(agent_cmd(0, free_port(), max_restarts=0, launcher=launcher, nnodes=nnodes), tmp_path, timeout=90,
                 env=env, check=False)
    assert_one_line_error(result, "an elastic job (torchrun --nnodes=1:2) needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
                          "`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=1:2 ...`", code=1)
    assert not epoch_lines(result.stdout) and not (tmp_path / "node0.pt").exists()
