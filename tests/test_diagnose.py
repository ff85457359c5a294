"""torchdiagnose (as `python -m torchdiagnose`, the package requirements-dev.txt installs) on a DDP script of the user's
own: written here, torch only, no timeout given to init_process_group (gloo's default is 30 minutes), importing
nothing of this repository, run with nothing of the repository on PYTHONPATH. A rank stalls, is killed, skips a
collective or calls another shape; the tool's one line names the rank, the collective and the script's line, and
the job ends within --timeout plus about 30 seconds with nothing left running (conftest fails a test whose
processes outlive it). The wheel installed in a venv of its own, under each launcher, with the other shapes of
user scripts: test_diagnose_installed.py. srun's case is in test_slurm.py, beside its cluster. A skipped collective
and another shape without TORCH_DISTRIBUTED_DEBUG (the same line from the same tool under torchrun, torchfrtrace on
the dumps), a rank stalled in its own code (under a venv that finds torch outside its Python's own packages) and a
healthy job that pays nothing are in test_hangs.py, on hangs.py, which docs/hangs.md runs.
"""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import (BIN, PROGRAMS, REPO, clean_env, free_port, kill_launched, launched_pids, mpi_env, start,
                      watch)

USER_SCRIPT = (PROGRAMS / "user_ddp.py").read_text()  # a user's DDP script: torch only, its faults by FAULT=

SOURCE = REPO / "diagnose" / "src"
TIMEOUT = 6  # the tool's --timeout: long enough that a loaded 2-core machine never trips it in healthy steps
DEADLINE_S = TIMEOUT + 30  # from the fault to the job's end
HANG_GUARD_S = 180


def user_script(directory):
    path = Path(directory) / "user_ddp.py"
    path.write_text(USER_SCRIPT)
    return path


def line_of(marker):
    """'user_ddp.py:N', the line of USER_SCRIPT that holds `marker`."""
    for number, text in enumerate(USER_SCRIPT.splitlines(), 1):
        if marker in text:
            return f"user_ddp.py:{number}"
    raise AssertionError(marker)


def diagnose_cmd(*launch, timeout=TIMEOUT, options=()):
    return [sys.executable, "-m", "torchdiagnose", "--timeout", str(timeout), *options, *map(str, launch)]


def launch(launcher, script, nproc=2):
    if launcher == "torchrun":
        return [BIN / "torchrun", "--standalone", f"--nproc_per_node={nproc}", script]
    if launcher == "mp.spawn":
        return [sys.executable, script]
    if launcher == "mpirun":
        return [BIN / "mpirun", "-np", str(nproc), "--bind-to", "none", sys.executable, script]
    raise ValueError(launcher)


def env_for(launcher, **extra):
    # The tests run the tool from their own folder (its flight recorder dumps go there); MASTER_PORT serves
    # mp.spawn and mpirun.
    base = mpi_env if launcher == "mpirun" else clean_env
    return base(MASTER_PORT=free_port(), **extra)


def the_line(lines):
    """The tool's line: exactly one (one host), whatever the launcher printed around it; the prefix says it again
    as the job's last line, after the launcher's report."""
    found = [line for _, line in lines if line.startswith("diagnose: ")]
    assert len(found) == 1, "\n".join(line for _, line in lines)[-5000:]
    verdict = found[0].replace("diagnose: ", "torchdiagnose: verdict: ", 1).removesuffix(
        " (--keep-waiting: the job goes on waiting)")
    if lines[-1][1] != found[0] and not found[0].endswith("(--keep-waiting: the job goes on waiting)"):
        # (a line said before anything started is the only one)
        assert lines[-1][1] == verdict, "\n".join(line for _, line in lines)[-5000:]
    return found[0]


def ended_in_time(lines, fault):
    start_at = next(moment for moment, line in lines if f": {fault} at step" in line)
    took = lines[-1][0] - start_at
    assert took < DEADLINE_S, f"the job ended {took:.0f}s after the fault"


LAUNCHERS = ["torchrun", "mp.spawn", "mpirun"]


# mp.spawn: test_diagnose_installed.py; torchrun: test_hangs.py, on hangs.py
@pytest.mark.parametrize("launcher", ["mpirun"])
def test_a_killed_rank_is_named_at_once_with_its_signal(tmp_path, launcher):
    code, lines = watch(diagnose_cmd(*launch(launcher, user_script(tmp_path))), tmp_path,
                        env_for(launcher, FAULT="die"))
    line = the_line(lines)
    assert code != 0
    assert line.startswith(f"diagnose: collective #12 (all_reduce of [1409], DDP's gradients in backward() at "
                           f"{line_of('the backward line')}) failed ("), line
    # mpirun is no Python process: it cannot pass the signal on, and its own report names it.
    gone = "rank 1 is gone: its process ended" if launcher == "mpirun" else "rank 1 is gone: killed by SIGKILL"
    assert gone in line and "no torchfrtrace: rank 1 did not answer" in line, line
    killed = next(moment for moment, text in lines if ": die at step" in text)
    said = next(moment for moment, text in lines if text.startswith("diagnose: "))
    assert said - killed < 10, f"the line came {said - killed:.0f}s after the kill"


@pytest.mark.parametrize("fault, other", [("skip", "all_reduce of [1409] (Float)"),
                                          ("shape", "all_gather of [3] (Float)")])
def test_under_debug_detail_both_sides_are_named_at_once(tmp_path, fault, other):
    """TORCH_DISTRIBUTED_DEBUG=DETAIL raises on every rank before any waits; the tool names both sides (and keeps
    torch 2.13's DDP from crashing in its constructor under DETAIL with gloo)."""
    env = env_for("torchrun", FAULT=fault, TORCH_DISTRIBUTED_DEBUG="DETAIL")
    code, lines = watch(diagnose_cmd(*launch("torchrun", user_script(tmp_path))), tmp_path, env)
    line = the_line(lines)
    assert code != 0
    assert line.startswith(f"diagnose: the ranks called different collectives at #12: rank 0 all_gather of [2] (Float) "
                           f"at {line_of('the all_gather line')}; rank 1 {other} at "), line
    assert "TORCH_DISTRIBUTED_DEBUG=DETAIL stopped them before any waited" in line, line
    ended_in_time(lines, fault)


@pytest.mark.slow
def test_keep_waiting_prints_the_line_and_lets_the_job_finish(tmp_path):
    """--keep-waiting: the line, then the job goes on; here the stall ends once the line is out (the test creates the
    file rank 1 waits for) and the job finishes, exit 0."""
    cmd = diagnose_cmd(*launch("torchrun", user_script(tmp_path)), options=["--keep-waiting"])
    go = tmp_path / "go"
    env = env_for("torchrun", FAULT="stall", STALL_UNTIL=go, STALL_S=0.2, STEPS=6)
    code, lines = watch(cmd, tmp_path, env, on_line=lambda line: line.startswith("diagnose: ") and go.touch())
    line = the_line(lines)
    assert "rank 1 did not arrive" in line and line.endswith("(--keep-waiting: the job goes on waiting)"), line
    assert code == 0, "\n".join(text for _, text in lines)[-3000:]
    assert sum(text.count(" done") for _, text in lines) == 2  # the ranks share stdout: their lines can meet


def test_workers_end_when_their_launcher_is_sigkilled(tmp_path):
    """An OOM-killed torchrun agent: under the tool its workers end within seconds instead of holding on."""
    process = start(diagnose_cmd(*launch("torchrun", user_script(tmp_path)), timeout=600), REPO,
                    env_for("torchrun", FAULT="stall"))
    for line in process.stdout:
        if ": stall at step" in line:
            break
    agent = next(pid for pid in launched_pids() if b"torchrun" in Path(f"/proc/{pid}/cmdline").read_bytes()
                 and b"diagnose" not in Path(f"/proc/{pid}/cmdline").read_bytes())
    workers = [pid for pid in launched_pids() if Path(f"/proc/{pid}/stat").read_text().split()[3] == str(agent)]
    assert len(workers) == 2
    os.kill(agent, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
              for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()
                and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]], "workers outlived their agent"
    process.stdout.read()
    process.wait(timeout=30)


def test_nccl_without_a_gpu_is_one_line(tmp_path):
    script = tmp_path / "nccl.py"
    script.write_text('import torch.distributed as dist\ndist.init_process_group("nccl", rank=0, world_size=1)\n')
    env = clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port())
    code, lines = watch(diagnose_cmd(sys.executable, script), tmp_path, env)
    assert code != 0
    assert "NCCL needs CUDA GPUs, and this process sees none" in the_line(lines)


@pytest.mark.quick
@pytest.mark.parametrize("args, message", [
    ([], "no launch command given"),
    (["--timeout", "0", "torchrun"], "--timeout: must be more than 0"),
    (["no-such-launcher", "x.py"], "no-such-launcher: command not found"),
])
def test_bad_input_is_one_line(args, message):
    result = subprocess.run([sys.executable, "-m", "torchdiagnose", *args], cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode != 0 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) <= 2, result.stderr  # argparse's usage line, then the error


def test_the_private_torch_apis_it_uses_exist():
    """torchdiagnose/api.py's PRIVATE_APIS, each found in this torch; a torch upgrade that removes one fails here, by
    name (and under the tool, the job says it in one line and runs as without it: test_diagnose_installed.py)."""
    from torchdiagnose import api
    assert api.missing_api() is None, f"torch {torch.__version__} has no {api.missing_api()}"
    documented = (SOURCE / "torchdiagnose" / "api.py").read_text().split('"""')[1]
    for name in api.PRIVATE_APIS:
        assert name.rsplit(".", 1)[-1] in documented, name


@pytest.mark.parametrize("rank, cause", [(1, "nothing answers at 127.0.0.1:"),
                                         (0, "answers, but the group of 2 ranks is not complete")])
def test_a_rendezvous_that_does_not_complete_is_one_line_within_the_timeout(tmp_path, rank, cause):
    """One rank of two, started alone with no timeout of its own: rank 1 finds nothing at the address, rank 0
    hosts the store and waits for rank 1. Either way one line after --timeout, instead of torch's 30 minutes."""
    started = time.monotonic()
    code, lines = watch(diagnose_cmd(sys.executable, user_script(tmp_path)),
                        tmp_path, clean_env(RANK=rank, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(),
                                  ))
    assert code != 0
    line = the_line(lines)
    assert line.startswith(f"diagnose: init_process_group has waited {TIMEOUT}s: ") and cause in line, line
    assert "GLOO_SOCKET_IFNAME" not in line, line  # this host's name is not loopback here
    assert time.monotonic() - started < DEADLINE_S


def test_the_line_at_three_ranks_names_each_rank_by_what_it_does():
    """lines.compose from answers as ranks post them: one rank in its own code, one gone, one waiting."""
    from torchdiagnose import lines
    question = {"by": 0, "reason": "timeout", "waited": 7.0, "timeout": 6.0, "folder": "fr_traces/x"}
    waiting = {"rank": 0, "running": [{"seq": 9, "kind": "all_reduce", "shapes": "[10]", "group": "0", "waited": 7.0}],
               "where": "train.py:40", "inner": None, "backward": True, "error": None, "recorder": True}
    busy = {"rank": 1, "running": [], "where": "train.py:31", "inner": "torch/nn/functional.py:2910 in layer_norm",
            "backward": False, "error": None, "busy": 0.9, "recorder": True}
    line = lines.compose(question, {0: waiting, 1: busy}, {2: {"pid": 77, "host": "n1", "exit": -9}}, 3)
    assert line.startswith("diagnose: collective #9 (all_reduce of [10], DDP's gradients in backward() at train.py:40) "
                           "waited more than --timeout 6s: "), line
    assert ("rank 1 did not arrive: it is alive, in its own code at train.py:31 (innermost: "
            "torch/nn/functional.py:2910 in layer_norm), busy on the CPU") in line, line
    assert "rank 2 is gone: killed by SIGKILL (pid 77, on n1)" in line, line
    assert line.endswith("no torchfrtrace: rank 2 did not answer, so wrote no flight recorder dump, and torchfrtrace "
                         "compares every rank's; ranks 0, 1 wrote theirs to fr_traces/x: `torchfrtrace "
                         "--allow-incomplete-ranks fr_traces/x` reads them"), line
    stopped = lines.compose(question, {0: waiting, 1: busy}, {2: {"pid": 77, "host": "n1", "state": "T",
                                                                 "stop_signal": "SIGSTOP", "local": True}}, 3)
    assert "rank 2 is stopped by SIGSTOP (pid 77, on n1): it runs nothing until it gets SIGCONT" in stopped, stopped
    every = lines.compose(question, {0: waiting, 1: busy, 2: dict(waiting, rank=2)}, {}, 3)
    assert every.endswith("; flight recorder: `torchfrtrace fr_traces/x`"), every


def test_on_a_mesh_each_group_waits_for_its_own_and_the_rank_at_fault_comes_first():
    """compose on answers as a dp_shard 2 x tp 2 job posts them (nd_parallel.py's real stops and kills:
    test_diagnose_parallel.py). Ranks of different groups wait in different collectives by design: none is "the odd
    one out". The rank in no collective is named first, then who waits where, and for whom."""
    from torchdiagnose import lines
    question = {"by": 0, "reason": "timeout", "waited": 7.0, "timeout": 6.0, "folder": "fr_traces/x"}

    def waiting(rank, seq, name, dimension, ranks, shapes, origin):
        entry = {"seq": seq, "kind": "all_gather", "shapes": shapes, "group": f"mesh_{dimension}", "group_name": name,
                 "ranks": ranks, "waited": 7.0, "origin": origin}
        return {"rank": rank, "running": [entry], "where": "nd.py:120", "model": "model.py:136 in forward",
                "inner": None, "backward": False, "error": None, "recorder": True}

    fsdp, tp = "FSDP of layers.1", "DTensor in PrepareModuleInput of layers.0.self_attn"
    answers = {0: waiting(0, 114, "9", "dp_shard", [0, 2], "[2336]", fsdp),
               1: waiting(1, 114, "10", "dp_shard", [1, 3], "[2336]", fsdp),
               2: waiting(2, 367, "4", "tp", [2, 3], "[8, 8, 32]", tp)}
    stopped = {3: {"pid": 7, "host": "n1", "state": "T", "stop_signal": "SIGSTOP", "local": True}}
    line = lines.compose(question, answers, stopped, 4)
    assert line.startswith(
        "diagnose: collective #114 (all_gather of [2336], FSDP of layers.1 at nd.py:120 via model.py:136 in forward) "
        "in dp_shard group [1, 3] waited more than --timeout 6s: rank 3 is stopped by SIGSTOP (pid 7, on n1): it runs "
        "nothing until it gets SIGCONT; waiting: rank 0 in #114 (all_gather of [2336], FSDP of layers.1 at nd.py:120 "
        "via model.py:136 in forward) of dp_shard group [0, 2], for rank 2, which waits in turn; rank 1 in the "
        "collective above of dp_shard group [1, 3], for rank 3; rank 2 in #367 (all_gather of [8, 8, 32], DTensor in "
        "PrepareModuleInput of layers.0.self_attn at nd.py:120 via model.py:136 in forward) of tp group [2, 3], for "
        "rank 3; no torchfrtrace: rank 3 did not answer"), line
    # Every rank in a collective, each waiting for a rank that waits in another group: an order that differs.
    crossed = {0: waiting(0, 114, "9", "dp_shard", [0, 2], "[2336]", fsdp),
               1: waiting(1, 367, "3", "tp", [0, 1], "[8, 8, 32]", tp),
               2: waiting(2, 367, "4", "tp", [2, 3], "[8, 8, 32]", tp),
               3: waiting(3, 114, "10", "dp_shard", [1, 3], "[2336]", fsdp)}
    line = lines.compose(question, crossed, {}, 4)
    assert "every rank waits in a collective of its groups for ranks that wait in another" in line, line
    # Two ranks of one group in different collectives are still two sides.
    skipped = {**answers, 3: waiting(3, 368, "4", "tp", [2, 3], "[8, 8, 32]", tp)}
    line = lines.compose(question, skipped, {}, 4)
    assert ("the ranks of tp group [2, 3] wait in different collectives: rank 2 in #367 (all_gather of [8, 8, 32], "
            "DTensor in PrepareModuleInput of layers.0.self_attn at nd.py:120 via model.py:136 in forward); rank 3 in "
            "#368") in line, line
    # A killed rank: the head is a collective that failed in its group, not the asker's with a rank that failed too.
    def failed(view, error):
        return dict(view, running=[], last=view["running"][0], error=error)
    question = dict(question, by=0, reason="failed")
    broken = {0: failed(answers[0], "Connection reset by peer"), 1: failed(answers[1], "Connection closed by peer"),
              2: failed(answers[2], "Connection closed by peer")}
    line = lines.compose(question, broken, {3: {"pid": 7, "host": "n1", "exit": -9}}, 4)
    assert line.startswith("diagnose: collective #114 (all_gather of [2336], FSDP of layers.1 at nd.py:120 via "
                           "model.py:136 in forward) in dp_shard group [1, 3] failed (Connection closed by peer): rank "
                           "3 is gone: killed by SIGKILL (pid 7, on n1)"), line


def test_the_call_site_in_the_script_comes_first_then_the_innermost_frame():
    """A frame of the script the rank runs is the line named; below it, the innermost frame of the user's own code
    and the innermost of all (a library's)."""
    from traceback import FrameSummary

    from torchdiagnose import lines
    script, model = str(REPO / "x" / "train.py"), str(REPO / "x" / "model.py")
    library = str(Path(torch.__file__).parent / "nn" / "functional.py")
    frames = [FrameSummary(script, 90, "<module>"), FrameSummary(script, 41, "evaluate"),
              FrameSummary(model, 20, "forward"), FrameSummary(library, 2910, "layer_norm")]
    where, inner = lines.user_site(frames, script=script)
    assert where.endswith("train.py:41"), where
    assert inner.endswith("model.py:20 in forward, then torch/nn/functional.py:2910 in layer_norm"), inner
    assert lines.user_site(frames[:2], script=script) == (where, None)


def test_two_nodes_whose_host_names_resolve_to_loopback_are_one_line(tmp_path):
    """Two torchrun nodes in two network namespaces, each with a host name that its /etc/hosts maps to 127.0.1.1
    (Debian's default): the rendezvous works (it is given addresses), gloo then advertises 127.0.1.1 and the
    other node cannot connect. The line names the cause and the variables that fix it."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    from test_reliability import NetworkNamespaces
    script = user_script(tmp_path)
    with NetworkNamespaces() as net:
        hosts = [Path("/etc/netns") / name / "hosts" for name in net.names]
        try:
            for node, path in enumerate(hosts):
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(f"127.0.0.1 localhost\n127.0.1.1 node{node}\n")
            port = free_port()
            agents = []
            for node in (0, 1):
                torchrun = [BIN / "torchrun", "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
                            "--rdzv_id=loopback", f"--rdzv_endpoint={net.addresses[0]}:{port}",
                            f"--local_addr={net.addresses[node]}",
                            f"--rdzv_conf=is_host={int(node == 0)},join_timeout=60"]
                command = " ".join(map(str, [sys.executable, "-m", "torchdiagnose", "--timeout", TIMEOUT, *torchrun,
                                             script]))
                agents.append(start(["ip", "netns", "exec", net.names[node], "unshare", "--uts", "sh", "-c",
                                     f"hostname node{node} && exec {command}"], REPO, clean_env()))
            outputs = [finish_quietly(agent, HANG_GUARD_S) for agent in agents]
        finally:
            for path in hosts:
                subprocess.run(["rm", "-rf", path.parent])
    found = [line for output in outputs for line in output.splitlines() if line.startswith("diagnose: ")]
    assert len(found) <= 2 and all("GLOO_SOCKET_IFNAME" in line for line in found), "\n====\n".join(outputs)[-5000:]
    assert any("advertised 127.0.1.1, a loopback address" in line for line in found), found


def finish_quietly(process, timeout):
    """The whole output of a started launch; one still running after `timeout` is killed and fails the test."""
    try:
        out, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_launched()
        pytest.fail(f"{process.args} still running after {timeout}s:\n{process.communicate()[0][-3000:]}")
    return out


BAD_HOST = "no-such-host.invalid"  # .invalid never resolves (RFC 6761)


def rendezvous_at(client, script, host, port):
    """A launch by `client` whose rendezvous is at host:port, on this one node."""
    static = ["--nnodes=1", "--nproc_per_node=2", f"--master_addr={host}", f"--master_port={port}", script]
    return {
        "torchrun": [BIN / "torchrun", *static],
        "torchrun c10d": [BIN / "torchrun", "--nnodes=1", "--nproc_per_node=2", "--rdzv_backend=c10d",
                          f"--rdzv_endpoint={host}:{port}", script],
        "torch.distributed.run": [sys.executable, "-m", "torch.distributed.run", *static],
        "torch.distributed.launch": [sys.executable, "-m", "torch.distributed.launch", "--use-env", *static],
        # On one machine accelerate listens on 127.0.0.1 whatever --main_process_ip says: name two machines.
        "accelerate": [BIN / "accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines",
                       "1" if host == "127.0.0.1" else "2", "--machine_rank", "0", "--main_process_ip", host,
                       "--main_process_port", str(port), "--mixed_precision", "no", "--dynamo_backend", "no", script],
        "mpirun": [BIN / "mpirun", "-np", "2", "--bind-to", "none", "-x", f"MASTER_ADDR={host}", sys.executable,
                   script],
        "mp.spawn": [sys.executable, script],  # MASTER_ADDR from the environment
    }[client]


@pytest.mark.parametrize("client", ["torchrun", "torchrun c10d", "torch.distributed.run", "torch.distributed.launch",
                                    "accelerate", "mpirun", "mp.spawn"])
def test_a_rendezvous_host_that_does_not_resolve_is_one_line_at_once(tmp_path, client):
    # Without the tool, torchrun's agent and init_process_group retry the name until their timeout (minutes).
    env = (mpi_env if client == "mpirun" else clean_env)(MASTER_ADDR=BAD_HOST, MASTER_PORT=free_port())
    began = time.monotonic()
    code, lines = watch(diagnose_cmd(*rendezvous_at(client, user_script(tmp_path), BAD_HOST, free_port())), tmp_path,
                        env)
    line = the_line(lines)
    assert code == 1 and f"rendezvous host '{BAD_HOST}'" in line and "does not resolve" in line, line
    assert time.monotonic() - began < 20 and not any("done" in text for _, text in lines), lines


@pytest.mark.parametrize("client", ["torchrun", "accelerate"])
def test_a_rendezvous_port_in_use_is_one_line_at_once(tmp_path, client):
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, lines = watch(diagnose_cmd(*rendezvous_at(client, user_script(tmp_path), "127.0.0.1", port)),
                            tmp_path, clean_env())
    line = the_line(lines)
    flag = "--main_process_port" if client == "accelerate" else "--master_port"
    assert code == 1 and f"port {port} is already in use" in line and flag in line, line


def test_a_host_the_script_itself_names_is_checked_in_the_rank(tmp_path):
    script = tmp_path / "own_address.py"
    script.write_text(f'import torch.distributed as dist\ndist.init_process_group("gloo", "tcp://{BAD_HOST}:'
                      f'{free_port()}", rank=0, world_size=1)\n')
    began = time.monotonic()
    code, lines = watch(diagnose_cmd(sys.executable, script), tmp_path, clean_env())
    line = the_line(lines)
    assert code == 1 and f"'{BAD_HOST}' (init_method) does not resolve" in line, line
    assert time.monotonic() - began < 20


def test_a_pipelines_p2p_ops_are_named_by_the_peer_stage_and_what_they_carry():
    """lines.describe_p2p and compose on answers as pipeline stages post them (tensor_parallel.py's and
    pipeline_parallel.py's real stalls: test_diagnose_parallel.py)."""
    from torchdiagnose import lines
    question = {"by": 1, "reason": "timeout", "waited": 7.0, "timeout": 6.0, "folder": "fr_traces/x"}
    three = [{"index": s, "ranks": {0: 0, 1: 1, 2: 2}} for s in range(3)]

    def waiting(rank, kind, peer):
        return {"rank": rank, "running": [lines.describe_p2p({"kind": kind, "peer": peer, "shapes": "[8, 4]"},
                                                              [three[rank]], 7.0)],
                "where": "pp.py:50", "inner": None, "backward": False, "error": None, "recorder": True}

    idle = {"rank": 0, "running": [], "where": "pp.py:20", "inner": None, "error": None, "busy": 0.0,
            "recorder": True}
    line = lines.compose(question, {0: idle, 1: waiting(1, "recv", 0)}, {}, 2)
    assert line.startswith("diagnose: p2p recv of [8, 4] from stage 0 (rank 0), the activations for stage 1's forward, "
                           "at pp.py:50 waited more than --timeout 6s: rank 0 did not send it: it is alive, in its own "
                           "code at pp.py:20, idle"), line
    assert lines.collective(waiting(1, "recv", 2)["running"][0]) == \
        "p2p recv of [8, 4] from stage 2 (rank 2), the gradients for stage 1's backward"
    assert lines.collective(waiting(1, "send", 2)["running"][0]) == \
        "p2p send of [8, 4] to stage 2 (rank 2), stage 1's activations"
    assert lines.collective(waiting(1, "send", 0)["running"][0]) == \
        "p2p send of [8, 4] to stage 0 (rank 0), stage 1's gradients"
    # Outside a pipeline the peer is a rank; two ranks that each wait to receive from the other are two sides.
    alone = lines.describe_p2p({"kind": "recv", "peer": 1, "shapes": "[2]"})
    assert lines.collective(alone, {"where": "user.py:9"}) == "p2p recv of [2] from rank 1 at user.py:9"
    both = lines.compose(question, {0: waiting(0, "recv", 1), 1: waiting(1, "recv", 0)}, {}, 2)
    sides = ("the ranks wait in different collectives: rank 0 in p2p recv of [8, 4] from stage 1 (rank 1), the "
             "gradients for stage 0's backward, at pp.py:50; rank 1 in p2p recv of [8, 4] from stage 0 (rank 0)")
    assert sides in both, both
