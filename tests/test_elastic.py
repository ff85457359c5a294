"""Elastic training: multinode.py under torchrun --nnodes=1:2, with nodes that join and leave a running job.

torchrun agents on 127.0.0.1 play the nodes, one process each: world size 1 alone, 2 together. Every wait is
on a file or a process state. Where training could run on past the change a test waits for, the test holds a
node's worker still with SIGSTOP, as a slow machine would, and lets it go on (SIGCONT) once the change is
under way: when torchrun has sent it SIGTERM to re-form the group, or when the other node is dead.
"""
import os
import shutil
import signal
import sys
from types import SimpleNamespace

import pytest

from conftest import (BIN, ELASTIC, PROGRAMS, RDZV_CONF, REPO, alive, assert_bitwise_equal, children, clean_env,
                      epoch_lines, finish, free_port, launched_pids, load_snapshot, release_when_stopped_by_torchrun,
                      start, summary, torchrun_worker, wait_for)


def paced(env, directory, seconds):
    """env, each optimizer step slowed by `seconds` (the probe): between a snapshot the test sees and the hold
    that follows, a node alone runs free, and at full speed (about 0.1 s an epoch) it could finish the run there."""
    directory.mkdir(exist_ok=True)
    return {**env, "DDP_EXAMPLES_PROBE_SAMPLES": str(directory), "DDP_EXAMPLES_PROBE_STEP_DELAY": str(seconds)}
EPOCHS = 12
STEPS = {1: 64, 2: 32}  # 2048 samples, 32 per rank and step: the steps of an epoch tell its world size


def agent_cmd(node, port, *args, max_restarts=3, launcher=(BIN / "torchrun",), nnodes="--nnodes=1:2"):
    return [*launcher, *([nnodes] if nnodes else []), "--nproc_per_node=1", f"--max_restarts={max_restarts}",
            "--rdzv_id=elastic", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
            f"--rdzv_conf={RDZV_CONF}", REPO / "multinode.py", "--total_epochs", str(EPOCHS), "--save_every", "1",
            "--batch_size", "32", "--timeout", "30", "--snapshot_path", f"node{node}.pt", *args]


_seen = {}  # path -> ((mtime, inode), epochs): a snapshot is read again only once it was replaced


def epochs_in(path):
    try:
        stat = path.stat()
    except FileNotFoundError:
        return 0
    key = (stat.st_mtime_ns, stat.st_ino)
    if _seen.get(path, (None,))[0] != key:
        _seen[path] = (key, load_snapshot(path)["epochs_run"])
    return _seen[path][1]


def hold(agent, restart):
    """SIGSTOP the node's worker of this restart round: its training stands still, and the others wait on it.
    Its snapshot cannot change while it is held."""
    wait_for(lambda: torchrun_worker(agent.pid, 0, restart) or agent.poll() is not None, 120, "the node's worker")
    worker = torchrun_worker(agent.pid, 0, restart)
    assert worker, "the node's worker should be training"
    os.kill(worker, signal.SIGSTOP)
    return worker


def phases(output):
    """The epoch lines of one node's output, split where rank 0 said the world size changed."""
    return [epoch_lines(part) for part in output.split("World size ")]


def assert_epochs(lines, first, last, world_size):
    assert [line.epoch for line in lines] == list(range(first, last + 1)), (first, last, lines)
    assert {line.steps for line in lines} == {STEPS[world_size]}, f"world size {world_size}: {lines}"


@pytest.mark.slow
def test_nodes_join_with_an_older_snapshot_and_none_and_leave_and_training_goes_on(tmp_path):
    """One job, three nodes, world size 1 -> 2 -> 1 -> 2:
    node 1 joins with an older snapshot of the run (it resumes from node 0's, the newest, sent by rank 0);
    node 1 dies (SIGKILL of its agent and its worker) and node 0 goes on alone after a restart;
    node 2 joins with no snapshot and takes rank 0 (it resumes from node 0's, sent by rank 1), without
    --max_restarts (a join costs none), and the two finish together. Nodes 0 and 1 run docs/elastic.md's two
    commands as written (another port, 12 epochs), node 2 node 1's with node2.pt and --max_restarts=0. Without
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which the page sets, the agents wait 60 s on torchrun's shared store when
    a node joins and fail (DistStoreError: wait timeout)."""
    port, go = free_port(), tmp_path / "go"
    commands = documented_nodes(port)
    node0, node1, node2 = (tmp_path / f"node{n}.pt" for n in range(3))
    env = paced(ELASTIC, tmp_path / "probe", 0.02)  # 1.3 s an epoch alone: node 0 cannot run to the end unseen
    # A node started now (tests/support/programs/held_back.py) that runs its command only once the file `go`
    # exists. Its process, which torchrun becomes (exec keeps the pid), exists before the other nodes': torchrun
    # orders the nodes of a rendezvous by address, then pid, so this node takes rank 0 when it joins.
    late = start([sys.executable, PROGRAMS / "held_back.py", go, *commands[2]], tmp_path, env)
    first = start(commands[0], tmp_path, env)
    assert late.pid < first.pid, "node 2's pid must be the lower one (pid numbers wrapped around?)"

    # Node 1 joins with an older snapshot: a copy of node 0's first (rename makes every save whole).
    wait_for(lambda: epochs_in(node0) >= 1 or first.poll() is not None, 120, "node 0's first snapshot")
    shutil.copyfile(node0, node1)
    older = epochs_in(node1)
    wait_for(lambda: epochs_in(node0) > older or first.poll() is not None, 120, "a newer snapshot on node 0")
    held = hold(first, restart=0)
    join1 = epochs_in(node0)
    second = start(commands[1], tmp_path, env)
    release_when_stopped_by_torchrun(held)

    # Node 1 leaves once it saved at world size 2: the whole node dies, its torchrun agent and its worker. (A
    # worker whose agent alone dies ends with it under python -m torchdiagnose: tests/test_diagnose.py.)
    wait_for(lambda: epochs_in(node1) > join1 or second.poll() is not None, 120, "node 1's snapshot at size 2")
    held = hold(first, restart=0)
    worker = torchrun_worker(second.pid, 0, 0)
    assert worker, "node 1's worker should be training"
    os.kill(worker, signal.SIGKILL)
    os.kill(second.pid, signal.SIGKILL)
    wait_for(lambda: not alive(worker), 10, "node 1's worker to end")
    os.kill(held, signal.SIGCONT)
    wait_for(lambda: not alive(held), 60, "node 0's worker to notice that node 1 is gone")
    leave = epochs_in(node0)  # it may have saved the epoch it was in when held, no more

    # Node 2 joins with no snapshot, once node 0 trained on alone.
    wait_for(lambda: epochs_in(node0) > leave or first.poll() is not None, 120, "node 0's snapshot at size 1")
    held = hold(first, restart=1)  # torchrun counts the leave as a restart, the join not
    join2 = epochs_in(node0)
    assert join2 <= EPOCHS - 2, f"node 0 trained on too far before it was held: {join2} of {EPOCHS} epochs"
    go.touch()
    release_when_stopped_by_torchrun(held)

    out0, out2, out1 = finish(first, 180), finish(late, 60), finish(second, 30)
    assert [first.returncode, second.returncode, late.returncode] == [0, -signal.SIGKILL, 0], (out0, out1, out2)
    wait_for(lambda: not launched_pids(), 30, "every process of the job to end")

    # Rank 0 speaks: node 0 until node 2 joins and takes rank 0. One line per change, printed once.
    assert (f"Newest snapshot: node0.pt of rank 0, sent to every rank (the ranks held {older} to {join1} epochs)\n"
            f"World size 1 -> 2 at epoch {join1}\nResuming from node0.pt at epoch {join1}\n") in out0
    assert f"\nWorld size 2 -> 1 at epoch {leave}\nResuming from node0.pt at epoch {leave}\n" in out0
    assert (f"Newest snapshot: node0.pt of rank 1, sent to every rank (the ranks held 0 to {join2} epochs)\n"
            f"World size 1 -> 2 at epoch {join2}\nResuming from node2.pt at epoch {join2}\n") in out2
    assert [out.count("World size ") for out in (out0, out1, out2)] == [2, 0, 1], (out0, out1, out2)
    assert not epoch_lines(out1), "node 1 never held rank 0"

    # The epochs at each world size: node 0 may have logged the epoch it was in when held, once more.
    alone, together, alone_again = phases(out0)
    assert_epochs(alone[:join1], 0, join1 - 1, 1)
    assert len(alone) <= join1 + 1
    assert_epochs(together[:leave - join1], join1, leave - 1, 2)
    assert len(together) <= leave - join1 + 1
    assert_epochs(alone_again[:join2 - leave], leave, join2 - 1, 1)
    assert len(alone_again) <= join2 - leave + 1
    before, last = phases(out2)
    assert not before
    assert_epochs(last, join2, EPOCHS - 1, 2)
    assert summary(out2).world_size == 2

    # Resumed each time, not started over: the loss of the first epoch after a change is below the one
    # before it (a fresh model's would be back near epoch 0's); and it falls to the end.
    for before, after, epoch in ((alone, together, join1), (together, alone_again, leave), (alone_again, last, join2)):
        loss = {line.epoch: line.loss for line in before}
        assert after[0].loss < loss[epoch - 1], f"epoch {epoch}: {before} -> {after}"
    assert last[-1].loss < together[0].loss < alone[0].loss, "the loss falls across the changes"

    # Both nodes end with the same snapshot, of one run since node 0's start; node 1's last was at size 2.
    a, b, gone = load_snapshot(node0), load_snapshot(node2), load_snapshot(node1)
    assert (a["epochs_run"], a["world_size"]) == (b["epochs_run"], b["world_size"]) == (EPOCHS, 2)
    assert_bitwise_equal(a["model"], b["model"], "node snapshots")
    assert join1 < gone["epochs_run"] <= leave and gone["world_size"] == 2
    assert a["run"] == b["run"] == gone["run"]


def documented_commands():
    """The two torchrun commands of docs/elastic.md (node 0's, node 1's): (environment, arguments)."""
    from test_docs import blocks, commands
    found = [tokens for _, text in blocks(REPO / "docs" / "elastic.md", "bash") for tokens in commands(text)
             if "torchrun" in tokens]
    assert len(found) == 2, found
    return [({t.split("=")[0]: t.split("=", 1)[1] for t in tokens[:tokens.index("torchrun")]},
             tokens[tokens.index("torchrun") + 1:]) for tokens in found]


def documented_nodes(port):
    """docs/elastic.md's two commands (node 0's, node 1's) as written but for the port and EPOCHS, and a third node's:
    node 1's with node2.pt and --max_restarts=0. The page sets the variable alone, as ELASTIC does."""
    nodes = []
    for variables, args in documented_commands():
        assert variables == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, variables
        args = [f"--rdzv_endpoint=127.0.0.1:{port}" if a.startswith("--rdzv_endpoint=") else
                REPO / a if a == "multinode.py" else a for a in args]
        args[args.index("--total_epochs") + 1] = str(EPOCHS)
        nodes.append([BIN / "torchrun", *args])
    third = ["--max_restarts=0" if a == "--max_restarts=3" else "node2.pt" if a == "node1.pt" else a for a in nodes[1]]
    assert third.count("--max_restarts=0") == third.count("node2.pt") == 1, third
    return [*nodes, third]


@pytest.mark.slow
def test_under_the_diagnosis_tool_a_node_joins_whichever_launcher_started_it(tmp_path):
    """Without the variable, each node started through `python -m torchdiagnose` (torchdiagnose): node 0 by `python -m
    torch.distributed.launch --use-env`, node 1 by `python -m torch.distributed.run`. The tool sees the elastic
    --nnodes, says so in one line and sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: node 1 joins, both finish."""
    port = free_port()
    (tmp_path / "probe").mkdir()
    launchers = [(sys.executable, "-m", "torch.distributed.launch", "--use-env"),
                 (sys.executable, "-m", "torch.distributed.run")]
    # The tool as installed (requirements-dev.txt), from the test's folder; each step paced at 10 ms (the probe), so
    # node 0 alone cannot finish its epochs in the second or two the tool's SIGTERM grace lets its stopped worker
    # run on under load.
    env = clean_env(DDP_EXAMPLES_PROBE_SAMPLES=tmp_path / "probe", DDP_EXAMPLES_PROBE_STEP_DELAY="0.01")

    def node(number):
        command = agent_cmd(number, port, "--total_epochs", "8", launcher=launchers[number])
        return start([sys.executable, "-m", "torchdiagnose", *map(str, command)], tmp_path, env)

    tools = [node(0)]
    wait_for(lambda: epochs_in(tmp_path / "node0.pt") >= 1 or tools[0].poll() is not None, 120, "node 0's snapshot")
    agent = SimpleNamespace(pid=children(tools[0].pid)[0], poll=tools[0].poll)  # the tool's child is the agent
    held = hold(agent, restart=0)
    tools.append(node(1))
    release_when_stopped_by_torchrun(held)
    out0, out1 = finish(tools[0], 300), finish(tools[1], 60)
    assert [tool.returncode for tool in tools] == [0, 0], (out0[-3000:], out1[-3000:])
    for out in (out0, out1):
        notes = [line for line in out.splitlines() if line.startswith("diagnose: ")]
        assert len(notes) == 1 and "an elastic job (--nnodes=1:2): TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 set" in notes[0]
    both = out0 + out1
    assert "World size 1 -> 2 at epoch" in both and summary(both).world_size == 2, both[-3000:]
    assert load_snapshot(tmp_path / "node0.pt")["epochs_run"] == load_snapshot(tmp_path / "node1.pt")["epochs_run"] == 8
