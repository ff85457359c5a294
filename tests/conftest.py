"""Helpers for launching the real scripts under their real launchers, in subprocesses."""
import functools
import json
import threading
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import zlib
from collections import namedtuple
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from support.launching import (ABORT_MARKERS, BIN, clean_env, mpi_env, mpirun_cmd, python_cmd,  # noqa: E402,F401
                               rank_0_env, torchrun_cmd, write_idx)
from models_and_data import mnist_splits, read_idx  # noqa: E402,F401


def _ephemeral_low():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; macOS's starts at 49152


def free_port(host="127.0.0.1"):
    """A port nobody listens on right now, below the ephemeral range: the OS gives none of those to a `bind(0)`
    (torchrun --standalone, a script's own free port) or to an outgoing connection, so a port picked here and
    released stays free until the test binds it. Under pytest-xdist (-n N), each worker takes only ports whose
    number is its index modulo N: no other worker picks it."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:])
    low = min(_ephemeral_low(), 32768)
    while True:
        port = random.randrange(low // 2, low)
        if port % workers != index:
            continue
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        return port


# The official MNIST test set's two IDX files, carried in the repository (data/mnist/README.md says where they
# come from); MNIST_DIR points at another copy.
MNIST = Path(os.environ.get("MNIST_DIR", REPO / "data" / "mnist"))


# Every process a test launches, and every process those start (torchrun's workers live in sessions of
# their own, and outlive a killed launcher), inherit this variable: it is how teardown finds them all.
TOKEN_VARIABLE = "DDP_EXAMPLES_TEST_LAUNCH"
SESSION_TOKEN = f"session-{os.getpid()}"  # launches of module-scoped fixtures, made before any test's token
_current_token = SESSION_TOKEN


# tests/support/sitecustomize.py: every launched process checks that destroy_process_group freed the group.
PROBE = REPO / "tests" / "support"
PROGRAMS = PROBE / "programs"  # programs the tests run that are not the repository's: a user's, a wrapper
PROBE_MARKER = "ddp-examples-probe:"


def check_no_abort(output, what):
    for marker in (*ABORT_MARKERS, PROBE_MARKER):
        if marker in output:
            pytest.fail(f"{what} printed {marker!r}:\n{output[-4000:]}")


GPU_LAUNCH = "DDP_EXAMPLES_TEST_GPUS"  # in a launch's environment (gpu_env): the launch may use the GPUs


def gpu_env(base=clean_env, **extra):
    """The environment of a launch that trains on the machine's GPUs (tests/test_gpu.py)."""
    return base(**{GPU_LAUNCH: "1"}, **extra)


def _tagged(env, probes=True):
    env = {**(env or clean_env()), TOKEN_VARIABLE: _current_token}
    # Every other launch checks the CPU paths, on any machine: its GPUs hidden, a 2-rank job on a one-GPU machine
    # trains on the CPU as on a laptop rather than beside the GPU (test_gpu.py's case).
    if env.pop(GPU_LAUNCH, None) is None:
        env["CUDA_VISIBLE_DEVICES"] = ""
    # OpenMP's threads (torch's intra-op pool) spin while they wait for work, by default. With two tests side by
    # side (-n 2) on 2 cores, the spinning threads take the cores from the processes that have work: test_tutorial.py
    # took 232 s of CPU for 123 s of wall time, and 190 s for 101 s once they sleep instead. Results do not change.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if probes:  # tests/support's sitecustomize in every process of the launch
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROBE), env.get("PYTHONPATH")]))
    return env


def process_state(pid):
    """A process's state letter in /proc (R, S, T: stopped, Z: a zombie ...), or None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def listening(port):
    """Whether a process listens on `port` by now: read from /proc, without connecting, so that the listener
    sees nothing. torchrun's c10d rendezvous store is hosted by the first agent to bind its port; a test that
    kills a node's agent must know which one that was."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        if any(row.split()[3] == "0A" and row.split()[1].endswith(f":{port:04X}") for row in rows):
            return True
    return False


def start(cmd, cwd, env=None, merge_output=True, probes=True):
    """Popen a launch in its own session, tagged for teardown; read it with finish(). probes=False: without the
    tests' probes, as a user's job runs."""
    return subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=_tagged(env, probes), text=True, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merge_output else subprocess.PIPE)


def finish(process, timeout):
    """Wait for a started launch; its output (stdout, or (stdout, stderr) if kept apart). A launch still
    running after `timeout` seconds is killed with everything it started, and the test fails."""
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_launched()
        out, err = process.communicate()
        pytest.fail(f"{' '.join(map(str, process.args))} still running after {timeout}s:\n{(out or '')[-3000:]}"
                    f"\n{(err or '')[-3000:]}")
    check_no_abort((out or "") + (err or ""), " ".join(map(str, process.args)))
    return out if err is None else (out, err)


def run(cmd, cwd, timeout=120, env=None, check=True):
    """Run a command to its end; on an unexpected exit code fail with its output, so a broken run explains
    itself. Returns a CompletedProcess with stdout and stderr apart."""
    process = start(cmd, cwd, env, merge_output=False)
    out, err = finish(process, timeout)
    result = subprocess.CompletedProcess(process.args, process.returncode, out, err)
    if check and result.returncode != 0:
        pytest.fail(f"{' '.join(map(str, cmd))} exited {result.returncode}\n"
                    f"--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}")
    return result


def forked(cases, cwd, env=None, modules=(), timeout=300):
    """Each case, [script, args, N processes or None(, {"cwd": folder, "env": {name: value}})], as its command line
    in a child forked from one process that imported torch once (tests/support/forked_runs.py; `modules` imported
    there too): for bad input, refused before any work, a CompletedProcess each, at a fraction of a launch's
    start-up. Paths may stand for strings anywhere in a case, numbers for arguments."""
    def plain(item):
        if isinstance(item, dict):
            return {key: plain(value) for key, value in item.items()}
        if isinstance(item, (list, tuple)):
            return [plain(value) for value in item]
        return str(item) if isinstance(item, Path) else item
    cases = [[script, [str(arg) for arg in args], *plain(rest)] for script, args, *rest in cases]
    done = run(python_cmd(REPO / "tests" / "support" / "forked_runs.py", json.dumps(cases), *modules), cwd=cwd,
               env=env, timeout=timeout)
    results = json.loads(done.stdout.splitlines()[-1])
    assert len(results) == len(cases), done.stdout[-3000:]
    return [subprocess.CompletedProcess([case[0], *case[1]], *result) for case, result in zip(cases, results)]


@functools.lru_cache(maxsize=None)
def _help_texts(programs):
    return json.loads(run([sys.executable, REPO / "tests" / "support" / "help_texts.py", *programs], cwd=REPO,
                          timeout=300).stdout)


def help_text(program, programs):
    """The --help text of `program` (a script of the repository, or "torchrun"). All of `programs` are asked at once,
    in one process (tests/support/help_texts.py); a program it could not ask is asked on its own."""
    text = _help_texts(tuple(sorted(programs))).get(program)
    if not text:
        command = [BIN / "torchrun"] if program == "torchrun" else [sys.executable, REPO / program]
        text = run([*command, "--help"], cwd=REPO, timeout=120).stdout
    return text


def launched_pids():
    """The processes that carry this test's token in their environment, wherever they sit in the tree."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if f"{TOKEN_VARIABLE}={_current_token}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:  # gone already, or not ours to read
                pass
    return found


def kill_launched():
    for pid in launched_pids():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(autouse=True)
def no_process_outlives_its_test(request):
    """Each test gets a token; after it, nothing that carries the token may still run. A test that passed
    but left a process behind (a worker that never exits) errors; after a failed one they are only killed."""
    global _current_token
    _current_token = f"{request.node.nodeid}-{os.getpid()}-{time.monotonic_ns()}"
    yield
    deadline = time.monotonic() + 15  # processes of a finished launch may take a moment to exit
    while launched_pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    leftover = launched_pids()
    kill_launched()
    _current_token = SESSION_TOKEN
    failed = getattr(request.node, "rep_call", None) is None or request.node.rep_call.failed
    if leftover and not failed:
        pytest.fail(f"processes still running 15s after the test: {leftover}")


# Under pytest-xdist (-n 2; pytest.ini sets --dist loadgroup), each test goes to whichever worker is free, except
# those of these files: one worker runs a file's tests in order, so that its module-scoped launch (a reference
# run, a SLURM cluster, an image) is made once, and two Ray clusters never start side by side.
SHARED_SETUP = {"test_compile", "test_container", "test_evaluation", "test_fsdp", "test_launchers", "test_linear_ddp",
                "test_parallelism", "test_plan", "test_ray", "test_reliability", "test_sending_less", "test_slurm",
                "test_step_checkpoints", "test_submitit", "test_torchx", "test_train_hf", "test_tutorial"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the marks
def pytest_collection_modifyitems(items):
    for item in items:
        if item.module.__name__ in SHARED_SETUP:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


def pytest_sessionfinish(session, exitstatus):
    global _current_token
    _current_token = SESSION_TOKEN
    kill_launched()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


SUMMARY = re.compile(r"^Summary: epochs (?P<epochs>[\d.]+) \| steps (?P<steps>\d+) \| final loss (?P<loss>[\d.]+) \| "
                     r"(?:samples|tokens)/s (?P<samples_per_s>[\d.]+) \| wall (?P<wall>[\d.]+)s \| "
                     r"world size (?P<world_size>\d+) \| backend (?P<backend>\w+)$", re.MULTILINE)
Summary = namedtuple("Summary", "epochs steps loss samples_per_s wall world_size backend")
COLLECTIVES = re.compile(r"^ddp-examples-count: rank (\d+) issued (\d+) collectives$", re.MULTILINE)
# Two formats: the tutorial's "Epoch 3 | Batchsize 32 | Steps 32 | Loss 0.1" and the linear classifier's
# "[DDP] Epoch 3 | loss 0.1 | accuracy 0.9 | 0.12s" (ddp.py puts the mode in front).
EPOCH_LINE = re.compile(r"^(?:\[(?P<mode>[^\]]+)\] )?Epoch (?P<epoch>\d+) \| (?:Batchsize (?P<batch_size>\d+) \| "
                        r"Steps (?P<steps>\d+) \| Loss (?P<tutorial_loss>[\d.]+)|loss (?P<loss>[\d.]+) \| "
                        r"accuracy (?P<accuracy>[\d.]+)(?: \| samples (?P<samples>\d+))?)", re.MULTILINE)
EpochLine = namedtuple("EpochLine", "mode epoch loss accuracy batch_size steps samples")


def summary(output):
    """The summary line every training run ends with, as named fields; fails the test if there is none."""
    match = SUMMARY.search(output)
    if not match:
        pytest.fail(f"no summary line in:\n{output[-3000:]}")
    f = match.groupdict()
    return Summary(float(f["epochs"]), int(f["steps"]), float(f["loss"]), float(f["samples_per_s"]),
                   float(f["wall"]), int(f["world_size"]), f["backend"])


def epoch_lines(output, mode=None):
    """Every epoch line of a run (of one mode of ddp.py's, if given), in order."""
    found = []
    for m in EPOCH_LINE.finditer(output):
        if mode is None or m["mode"] == mode:
            loss = float(m["loss"] or m["tutorial_loss"])
            found.append(EpochLine(m["mode"], int(m["epoch"]), loss, m["accuracy"] and float(m["accuracy"]),
                                   m["batch_size"] and int(m["batch_size"]), m["steps"] and int(m["steps"]),
                                   m["samples"] and int(m["samples"])))
    return found


def epoch_losses(output, mode=None):
    return [line.loss for line in epoch_lines(output, mode)]


def collectives_issued(output):
    """{rank: collectives issued}, from a run launched with DDP_EXAMPLES_PROBE_COLLECTIVES=1."""
    return {int(rank): int(count) for rank, count in COLLECTIVES.findall(output)}


def assert_same_training_state(path_a, path_b):
    """Model, optimizer, epoch count and torch RNG of two snapshots: all that the training depends on."""
    a, b = load_snapshot(path_a), load_snapshot(path_b)
    for key in ("epochs_run", "model", "optimizer", "rng"):
        assert_bitwise_equal(a[key], b[key], key)


def assert_one_line_error(result, *fragments, code=2):
    """A launch that stopped on bad input: the exit code, and an error line (`error: ...` from the scripts,
    `script.py: error: ...` from argparse) with every fragment, before any traceback; launchers may add
    their own report of the failed process after it. Returns the line."""
    assert result.returncode == code, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
    # The ranks share the launcher's stderr, and Python writes a sys.exit message and its newline in two writes:
    # two ranks' messages can meet on one line ("...CPUerror: ..."; seen under -n 2). Each starts a line here.
    stderr = re.sub(r"(?<=\S)(?=error: )", "\n", result.stderr)
    lines = [line for line in stderr.splitlines() if line.startswith("error: ") or ": error: " in line]
    assert lines, result.stderr[-3000:]
    assert len(set(lines)) == 1, f"one error, said once per node: {lines}"
    assert "Traceback" not in stderr.split(lines[0])[0], result.stderr[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def checkpoint_sums(checkpoint):
    """{file: {"bytes", "crc32"}} of every file of a DCP checkpoint but its marker (fsdp_checkpoint.MARKER), computed
    here, as the marker lists them."""
    return {p.name: {"bytes": p.stat().st_size, "crc32": f"{zlib.crc32(p.read_bytes()):08x}"}
            for p in checkpoint.iterdir() if p.name != "complete.json"}


def flip(path, count=400):
    """Flip every bit of `count` bytes in the middle of a file, in place: what a bad disk or a bad copy does."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + count] = bytes(byte ^ 0xFF for byte in data[middle:middle + count])
    path.write_bytes(data)


def assert_said_by_rank_0(result, *fragments):
    """One error line, said once (rank 0's; the other ranks say nothing), exit code 1, before any training step."""
    line = assert_one_line_error(result, *fragments, code=1)  # torchrun exits 1
    assert result.stderr.count("error: ") == 1, result.stderr[-3000:]
    assert not epoch_lines(result.stdout), result.stdout[-2000:]
    return line


def load_snapshot(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_bitwise_equal(a, b, what=""):
    """Recursively compare nested state dicts: tensors with torch.equal, everything else with ==."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"{what} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{what} keys differ"
        for key in a:
            assert_bitwise_equal(a[key], b[key], f"{what}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{what} lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{what}[{i}]")
    else:
        assert a == b, f"{what}: {a!r} != {b!r}"


@pytest.fixture(scope="session")
def mnist_dir(tmp_path_factory):
    """The real MNIST test images split 8,000 train / 2,000 eval (as train.py splits data/mnist itself), written
    as the four IDX files."""
    (train_images, train_labels), (test_images, test_labels), _ = mnist_splits(str(MNIST))
    directory = tmp_path_factory.mktemp("mnist")
    for name, array in (("train-images", train_images), ("train-labels", train_labels),
                        ("t10k-images", test_images), ("t10k-labels", test_labels)):
        write_idx(str(directory / f"{name}-idx{3 if 'images' in name else 1}-ubyte.gz"), array.numpy())
    return directory


# ---- processes and their lines: waits, torchrun's workers, held workers, a launch read line by line ----

# How long a whole training job may take before the test calls it hung: it asserts no speed (an idle machine
# runs these jobs in under a minute), it only ends a test that would otherwise wait forever.
HANG_GUARD_S = 600


def wait_for(condition, timeout, what):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.005)


def children(pid):
    """Direct child processes of pid, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def environ(pid):
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def torchrun_worker(agent_pid, local_rank, restart=0):
    """The pid of the worker torchrun started with this LOCAL_RANK, in this restart round, or None."""
    for pid in children(agent_pid):
        env = environ(pid)
        if env.get("LOCAL_RANK") == str(local_rank) and env.get("TORCHELASTIC_RESTART_COUNT") == str(restart):
            return pid
    return None


def stopped_worker(job, local_rank, restart=0):
    """The pid of torchrun's worker once the probe has stopped it (DDP_EXAMPLES_PROBE_STOP_AT in
    tests/support/sitecustomize.py), to be killed at exactly that step: no wait from outside can race the job."""
    def stopped():
        pid = torchrun_worker(job.pid, local_rank, restart)
        return pid if pid and process_state(pid) == "T" else None
    wait_for(lambda: stopped() or job.poll() is not None, 120, f"rank {local_rank} to stop at its step")
    pid = stopped()
    assert pid, f"the job ended before rank {local_rank} stopped: {finish(job, 30)}"
    return pid


# What docs/elastic.md's commands set: torchrun's shared store deadlocks a node that joins later.
ELASTIC = clean_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)


def alive(pid):
    return process_state(pid) not in (None, "Z")


def signal_pending(pid, sig):
    """Whether `sig` waits to be delivered to the process: a stopped one gets it only once continued."""
    try:
        with open(f"/proc/{pid}/status") as f:
            status = f.read()
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


# torchrun's defaults would cost minutes: 30 s in which a lone node waits for more before it starts (last
# call), 15 s before a dead node is dropped (3 missed heartbeats, 5 s apart).
RDZV_CONF = "join_timeout=60,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"


def events(directory, rank, restart=0):
    """The probe's events of one rank in one restart round, in order (one process each; whole lines only, since
    the process may be writing the last one)."""
    (path,) = directory.glob(f"rank{rank}-restart{restart}-*.jsonl")
    return [json.loads(line) for line in path.read_text().split("\n")[:-1]]


def epoch_batches(directory, rank, restart=0):
    """[[batch indices, ...] of each pass of the DataLoader] of one process."""
    passes = []
    for event in events(directory, rank, restart):
        if "iter" in event:
            passes.append([])
        elif "batch" in event:
            passes[-1].append(event["batch"])
    return passes


def watch(cmd, cwd, env=None, aborts=False, probes=True, on_line=None, guard=HANG_GUARD_S):
    """Run a launch to its end, every line with the time it came: (exit code, [(time, line)]). One still running
    after `guard` seconds is killed and fails the test, and so does one that printed an abort marker (a crash)
    unless `aborts`. on_line(line) as each line comes; probes=False: without the tests' probes (start)."""
    process = start(cmd, cwd, env, probes=probes)
    hung = threading.Event()
    timer = threading.Timer(guard, lambda: (hung.set(), kill_launched()))
    timer.start()
    lines = []
    for line in process.stdout:
        lines.append((time.monotonic(), line.rstrip("\n")))
        if on_line:
            on_line(lines[-1][1])
    process.wait()
    timer.cancel()
    output = "\n".join(line for _, line in lines)
    if hung.is_set():
        pytest.fail(f"{' '.join(map(str, cmd))} still running after {guard}s:\n{output[-3000:]}")
    if not aborts:
        check_no_abort(output, " ".join(map(str, cmd)))
    return process.returncode, lines


LIGHTHOUSE_FLAGS = ["--min_replicas", "1", "--join_timeout_ms", "1000", "--heartbeat_timeout_ms", "2000"]


def start_lighthouse():
    port = free_port()
    process = start([BIN / "torchft_lighthouse", "--bind", f"127.0.0.1:{port}", *LIGHTHOUSE_FLAGS], cwd=REPO,
                    env=clean_env(RUST_LOG="warn"))  # at "info" it logs every quorum: a full pipe would stall it
    deadline = time.monotonic() + 30
    while not listening(port):
        assert process.poll() is None and time.monotonic() < deadline, process.stdout.read()
        time.sleep(0.05)
    return process, f"http://127.0.0.1:{port}"


# The scripts test_submitit.py submits: (first submission's arguments, the second's).
CLIENT_SCRIPTS = {
    "multigpu_torchrun.py": (("2", "1"), ("4", "1")),
}
