"""One job under three launchers: run_with_torchrun.py, run_with_python.py and run_with_mpirun.py."""
import re
import socket

import pytest
import torch
import torch.distributed as dist

from conftest import (assert_bitwise_equal, assert_one_line_error, clean_env, epoch_lines, forked, load_snapshot,
                      mpi_env, mpirun_cmd, python_cmd, run, summary, torchrun_cmd)

import run_with_torchrun

HOST = socket.gethostname()
TABLE_ROW = re.compile(r"^(\S.*?)\s*\| (.+?)\s*\| (.+?)\s*\| (yes|NO on rank [\d, ]+)$", re.MULTILINE)
TINY_TRAINING = ("--train", "--total_epochs", "2", "--save_every", "1", "--batch_size", "64")


def table(output):
    """Rank 0's table as {collective: (expected, got, ok)}."""
    return {m.group(1): m.group(2, 3, 4) for m in TABLE_ROW.finditer(output) if m.group(1) != "collective"}


def expected_table(world_size):
    total = world_size * (world_size + 1) // 2
    return {
        "all_reduce sum": (f"[{total}, {10 * total}]",) * 2 + ("yes",),
        "all_reduce avg": (f"[{total}]",) * 2 + ("yes",),
        "all_gather": (str([[r, r * r] for r in range(world_size)]),) * 2 + ("yes",),
        f"broadcast from {world_size - 1}": (f"[{100 + world_size - 1}]",) * 2 + ("yes",),
        "reduce to each rank in turn": (f"[{total}]",) * 2 + ("yes",),  # rank 0's share: total * (0 + 1)
        "barrier": (f"{world_size} arrived",) * 2 + ("yes",),
    }


def assert_every_rank_announced(output, world_size):
    lines = output.splitlines()
    for rank in range(world_size):
        assert f"{HOST}$Process {rank}: {rank} # {world_size}" in lines, output
        assert f"{HOST}$Process {rank}: Default device is set to cpu" in lines, output
    assert not re.search(rf"Process {world_size}\b", output), "one process too many"


def test_torchrun_two_ranks_print_who_they_are_and_check_the_collectives(tmp_path):
    out = run(torchrun_cmd("run_with_torchrun.py"), cwd=tmp_path).stdout
    assert_every_rank_announced(out, 2)
    for rank in range(2):
        assert (f"Process {rank}: rank from RANK, local rank {rank} from LOCAL_RANK, world size from WORLD_SIZE, "
                f"all set by torchrun; backend gloo") in out.splitlines()
    assert table(out) == expected_table(2)


@pytest.mark.parametrize("world_size", [2, 3])
def test_python_spawns_the_world_size_it_is_given(tmp_path, world_size):
    out = run(python_cmd("run_with_python.py", "--world_size", str(world_size)), cwd=tmp_path).stdout
    assert_every_rank_announced(out, world_size)
    assert table(out) == expected_table(world_size)
    assert len(set(re.findall(r"rendezvous (tcp://127\.0\.0\.1:\d+)", out))) == 1, "one rendezvous for all"


@pytest.mark.parametrize("world_size", [2, 3])
def test_mpirun_ranks_agree_with_mpi_itself(tmp_path, world_size):
    out = run(mpirun_cmd("run_with_mpirun.py", np_=world_size), cwd=tmp_path, env=mpi_env()).stdout
    assert_every_rank_announced(out, world_size)
    for rank in range(world_size):
        assert (f"Process {rank}: rank from MPI.COMM_WORLD.Get_rank(), local rank {rank} from "
                f"OMPI_COMM_WORLD_LOCAL_RANK, world size {world_size} from MPI.COMM_WORLD.Get_size()") in out
    masters = set(re.findall(r"master (127\.0\.0\.1:\d+) chosen by rank 0, sent by MPI bcast \(mpirun\)", out))
    assert len(masters) == 1 and len(re.findall("sent by MPI bcast", out)) == world_size, out
    total = world_size * (world_size + 1) // 2
    assert table(out) == {**expected_table(world_size),
                          "all_reduce vs MPI allreduce": (f"[{total}]", f"[{total}]", "yes")}


def test_mpi_script_without_mpirun_is_a_world_of_one(tmp_path):
    out = run(python_cmd("run_with_mpirun.py"), cwd=tmp_path, env=clean_env()).stdout
    assert_every_rank_announced(out, 1)
    assert "world size 1 from MPI.COMM_WORLD.Get_size()" in out
    assert "no launcher: MPI runs this process as a world of one" in out
    assert table(out) == {**expected_table(1), "all_reduce vs MPI allreduce": ("[1]", "[1]", "yes")}


@pytest.mark.slow
def test_mpirun_training_matches_torchrun_bitwise_and_resumes(tmp_path):
    # One thread each: torchrun sets OMP_NUM_THREADS=1 by itself, mpirun does not, and a different thread
    # count may sum a matrix product in another order.
    mpi_out = run(mpirun_cmd("run_with_mpirun.py", *TINY_TRAINING, "--snapshot_path", tmp_path / "mpi.pt"),
                  cwd=tmp_path, env=mpi_env(OMP_NUM_THREADS=1)).stdout
    torchrun_out = run(torchrun_cmd("multigpu_torchrun.py", *TINY_TRAINING[1:], "--snapshot_path",
                                    tmp_path / "torchrun.pt"), cwd=tmp_path, env=clean_env(OMP_NUM_THREADS=1)).stdout
    mpi_summary, torchrun_summary = summary(mpi_out), summary(torchrun_out)
    fields = ("epochs", "steps", "loss", "world_size", "backend")
    assert [getattr(mpi_summary, f) for f in fields] == [getattr(torchrun_summary, f) for f in fields]
    assert (mpi_summary.epochs, mpi_summary.steps, mpi_summary.backend) == (2, 2 * 2048 // (64 * 2), "gloo")
    assert epoch_lines(mpi_out) == epoch_lines(torchrun_out)
    mpi_state, torchrun_state = load_snapshot(tmp_path / "mpi.pt"), load_snapshot(tmp_path / "torchrun.pt")
    assert mpi_state["epochs_run"] == torchrun_state["epochs_run"] == 2
    assert_bitwise_equal(mpi_state["model"], torchrun_state["model"], "model")
    assert_bitwise_equal(mpi_state["optimizer"], torchrun_state["optimizer"], "optimizer")

    resumed = run(mpirun_cmd("run_with_mpirun.py", "--train", "--total_epochs", "3", "--save_every", "1",
                             "--batch_size", "64", "--snapshot_path", tmp_path / "mpi.pt"),
                  cwd=tmp_path, env=mpi_env(OMP_NUM_THREADS=1)).stdout
    assert f"Resuming from {tmp_path / 'mpi.pt'} at epoch 2" in resumed
    assert [line.epoch for line in epoch_lines(resumed)] == [2], "only the missing epoch runs"
    assert summary(resumed).epochs == 1
    resumed_state = load_snapshot(tmp_path / "mpi.pt")
    assert resumed_state["epochs_run"] == 3
    assert not torch.equal(resumed_state["model"]["net.0.weight"], mpi_state["model"]["net.0.weight"])


def listening_socket():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


# Each case: the script's command line under plain python (None), or the launcher's command, and the line it says.
BAD_INPUT = {
    "torchrun-script-without-torchrun": (("run_with_torchrun.py",), None,
        "run_with_torchrun.py: error: start it with torchrun: torchrun --standalone --nproc_per_node=2 "
        "run_with_torchrun.py", 2),
    "world-size-0": (("run_with_python.py", "--world_size", "0"), None,
        "run_with_python.py: error: --world_size and --timeout must be positive", 2),
    "world-size-negative": (("run_with_python.py", "--world_size", "-3"), None,
        "run_with_python.py: error: --world_size and --timeout must be positive", 2),
    "unreachable-address": (("run_with_python.py", "--master_addr", "10.255.255.1"), None,
        "run_with_python.py: error: cannot listen on 10.255.255.1 port any (Cannot assign requested address): give "
        "an address of this machine (e.g. 127.0.0.1)", 2),
    "unresolvable-address": (("run_with_python.py", "--master_addr", "no-such-host.invalid"), None,
        "run_with_python.py: error: master address 'no-such-host.invalid' does not resolve", 2),
    "python-nccl": (("run_with_python.py", "--backend", "nccl"), None,
        "error: --backend nccl needs a CUDA GPU for each process; leave --backend out for gloo on the CPU", 1),
    "python-mpi": (("run_with_python.py", "--backend", "mpi"), None,
        "run_with_python.py: error: argument --backend: invalid choice: 'mpi'", 2),
    "timeout-0": (("run_with_torchrun.py", "--timeout", "0"), None,
        "run_with_torchrun.py: error: --timeout must be positive", 2),
    "mpi-script-nccl": (("run_with_mpirun.py", "--backend", "nccl"), None,
        "error: --backend nccl needs a CUDA GPU for each process", 1),
    "mpirun-mpi-backend": (mpirun_cmd("run_with_mpirun.py", "--backend", "mpi"), mpi_env(),
        "error: this torch build has no MPI backend", 1),
    "spawn-script-under-mpirun": (mpirun_cmd("run_with_python.py", np_=1), mpi_env(),
        "run_with_python.py: error: it starts its own processes: under a launcher every copy would start a job", 2),
    "mpi-script-under-torchrun": (torchrun_cmd("run_with_mpirun.py", nproc=1), clean_env(),
        "run_with_mpirun.py: error: it takes its ranks from mpirun, not torchrun", 1),
}


@pytest.fixture(scope="module")
def under_python(tmp_path_factory):
    """The plain-python cases, and a --master_port that another process listens on: each its script's command line
    in a child forked from one process that imported torch once (forked_runs), the taken port held meanwhile.
    ({case: CompletedProcess}, the port)."""
    cases = {name: [argv[0], list(argv[1:]), None] for name, (argv, env, _, _) in BAD_INPUT.items() if env is None}
    with listening_socket() as taken:
        port = taken.getsockname()[1]
        cases["port-in-use"] = ["run_with_python.py", ["--master_port", port], None]
        results = forked(list(cases.values()), cwd=tmp_path_factory.mktemp("under_python"))
    return dict(zip(cases, results)), port


@pytest.mark.quick
@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_fails_fast_with_one_line(request, tmp_path, case):
    cmd, env, message, code = BAD_INPUT[case]
    if env is None:  # the script under plain python: a forked child's
        result = request.getfixturevalue("under_python")[0][case]
    else:
        result = run(cmd, cwd=tmp_path, env=env, timeout=60, check=False)
    line = assert_one_line_error(result, code=code)  # mpirun passes its rank's code on; torchrun says 1
    assert line.startswith(message), line


@pytest.mark.quick
def test_port_in_use_is_refused_before_any_process_starts(under_python):
    results, port = under_python
    result = results["port-in-use"]
    line = assert_one_line_error(result)
    assert line.startswith(f"run_with_python.py: error: cannot listen on 127.0.0.1 port {port} (Address already "
                           "in use)"), line
    assert result.stdout == ""


def test_a_wrong_result_fails_its_check_naming_the_collective_and_the_rank(capfd, monkeypatch):
    """A backend that returns a wrong sum: the table says NO and the rank stops with one line naming the
    collective (sys.exit: exit code 1). The script's own functions, in a group of one."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        all_reduce = dist.all_reduce

        def off_by_one(tensor, *args, **kwargs):
            all_reduce(tensor, *args, **kwargs)
            tensor += 1

        with monkeypatch.context() as patch:
            patch.setattr(dist, "all_reduce", off_by_one)
            checks = run_with_torchrun.check_collectives(0, 1, torch.device("cpu"), store)
        with pytest.raises(SystemExit) as failed:
            run_with_torchrun.report(checks, 0, 1, torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    rows = table(capfd.readouterr().out)  # the scripts write with os.write, to file descriptor 1
    assert rows["all_reduce sum"] == ("[1, 10]", "[2, 11]", "NO on rank 0")
    assert rows["all_reduce avg"] == ("[1]", "[2]", "NO on rank 0")
    assert rows["all_gather"][2] == rows["barrier"][2] == "yes"
    assert str(failed.value) == ("error: rank 0 got wrong results: all_reduce sum gave [2, 11], expected [1, 10]; "
                                 "all_reduce avg gave [2], expected [1]")
