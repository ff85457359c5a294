"""torchdiagnose as a user gets it: the wheel built from diagnose/, installed in a venv of its own (torch from the
Python that runs the tests, through a .pth naming its site-packages; nothing of the repository importable), run from
a folder outside the repository on scripts in the shapes users write (tests/support/programs): the PyTorch DDP
tutorial's (mp.spawn, MASTER_PORT set by the script, world_size passed to init_process_group; under mpirun too) and a
torchrun script that evaluates on rank 0 while the others wait. Each case checks the words of its line and that the
tool's last line repeats it after the launcher's report, the job ended at once, and no frame of the tool is in any
traceback.
"""
import fcntl
import os
import re
import site
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import conftest
from conftest import BIN, PROGRAMS, REPO, TOKEN_VARIABLE, free_port, mpi_env, watch

# The users' programs the tool runs, as files (tests/support/programs). The port in them, the tutorial's, is replaced
# with a free one.
SPAWN_SCRIPT = (PROGRAMS / "spawn_tutorial.py").read_text()  # the PyTorch DDP tutorial's shape: mp.spawn
TORCHRUN_SCRIPT = (PROGRAMS / "torchrun_train.py").read_text()  # env://, evaluation on rank 0 after each epoch
OTHER_TORCH_SCRIPT = (PROGRAMS / "other_torch.py").read_text()  # one rank on a torch without a private API
FSDP_TP_MODEL = (PROGRAMS / "fsdp_tp_model.py").read_text()  # the user's model, in a file of its own
FSDP_TP_SCRIPT = (PROGRAMS / "fsdp_tp_train.py").read_text()  # a user's FSDP2 x TP script
TUTORIAL_PORT = "12355"
TIMEOUT = 6  # the tool's --timeout
ENDS_WITHIN_S = 15  # from the tool's line to the job's last line (a stopped rank took torchrun 30 s more)
TOOL_FRAME = re.compile(r'File "[^"]*[/\\]torchdiagnose[/\\]')


def line_of(script, marker):
    found = [n for n, text in enumerate(script.splitlines(), 1) if marker in text]
    assert len(found) == 1, marker
    return found[0]


@pytest.fixture(scope="session")
def venv(tmp_path_factory):
    """The wheel, built once (pytest-xdist's workers share it through a lock), installed into a fresh venv that
    takes torch from this machine's Python."""
    run = tmp_path_factory.getbasetemp()
    # Under pytest-xdist each worker's folder is in the run's; without it, the run's folder is the base: its parent
    # is every run's, where a wheel of an older diagnose/ would stay.
    shared = (run.parent if os.environ.get("PYTEST_XDIST_WORKER") else run) / "torchdiagnose-installed"
    shared.mkdir(exist_ok=True)
    with open(shared / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        venv = shared / "venv"
        if not (venv / "ready").exists():
            subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", shared / "wheels",
                            REPO / "diagnose"], check=True, cwd=shared, timeout=300)
            (wheel,) = (shared / "wheels").glob("torchdiagnose-*.whl")
            # No pip of its own (ensurepip costs ~6 CPU-s): this Python's pip installs into it (--python).
            subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=120)
            # torch from the Python that runs the tests, whether it is a venv (the README's install) or not:
            # --system-site-packages would reach only the base interpreter's packages. A .pth's plain folder lines
            # put the folders on sys.path without running their own .pth files, so the repository's editable
            # install of the tool (requirements-dev.txt) stays out of this venv.
            purelib = subprocess.run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_path("
                                      "'purelib'))"], check=True, capture_output=True, text=True, timeout=60)
            folders = dict.fromkeys([*site.getsitepackages(), str(Path(torch.__file__).parent.parent)])
            Path(purelib.stdout.strip(), "torch_of_the_tests.pth").write_text("\n".join(folders) + "\n")
            subprocess.run([sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "--no-deps",
                            "--no-index", "-q", wheel], check=True, cwd=shared, timeout=300)
            (venv / "ready").write_text("")
    return venv


@pytest.fixture
def elsewhere(tmp_path):
    """A folder of the user's, outside the repository."""
    folder = tmp_path / "user"
    folder.mkdir()
    assert REPO not in folder.parents
    return folder


def job_env(**extra):
    """A fresh shell's environment, nothing of the repository on PYTHONPATH (not even the tests' probes), and the
    tests' token, by which conftest finds and ends every process a test leaves."""
    env = mpi_env(OMP_NUM_THREADS=1, OMP_WAIT_POLICY="PASSIVE", CUDA_VISIBLE_DEVICES="", **extra)
    env.pop("PYTHONPATH", None)
    env[TOKEN_VARIABLE] = conftest._current_token
    return env


def diagnosed(venv, cwd, *launch, **env):
    """torchdiagnose --timeout TIMEOUT LAUNCH... to its end, as test_hangs.watch runs it but in job_env (nothing of
    the repository, not even the tests' probes): (exit code, [(time, line)]); no frame of the tool in a traceback."""
    cmd = [venv / "bin" / "torchdiagnose", "--timeout", TIMEOUT, *launch]
    code, lines = watch(cmd, cwd, job_env(**env), probes=False)
    output = "\n".join(line for _, line in lines)
    assert not TOOL_FRAME.search(output), f"a frame of the tool in a traceback:\n{output[-5000:]}"
    return code, lines


def verdict(code, lines):
    """The tool's line (exactly one), which the job's last line repeats after the launcher's report; the job ended
    within ENDS_WITHIN_S of it."""
    output = "\n".join(line for _, line in lines)
    found = [(moment, line) for moment, line in lines if line.startswith("diagnose: ")]
    assert code != 0 and len(found) == 1, output[-5000:]
    said, line = found[0]
    assert lines[-1][1] == line.replace("diagnose: ", "torchdiagnose: verdict: ", 1), output[-5000:]
    assert lines[-1][0] - said < ENDS_WITHIN_S, f"the job ended {lines[-1][0] - said:.0f}s after the line"
    return line


def test_the_wheel_installs_the_command_and_its_hook_and_nothing_of_the_repository(venv, elsewhere):
    python = venv / "bin" / "python"
    version = subprocess.run([venv / "bin" / "torchdiagnose", "--version"], cwd=elsewhere, env=job_env(),
                             capture_output=True, text=True, timeout=60, check=True).stdout
    assert version.startswith("torchdiagnose ") and f"tested with torch {torch.__version__.split('+')[0]}" in version
    same = subprocess.run([python, "-m", "torchdiagnose", "--version"], cwd=elsewhere, env=job_env(),
                          capture_output=True, text=True, timeout=60, check=True).stdout
    assert same == version
    probe = ("import torchdiagnose, importlib.util, sys; print(torchdiagnose.__file__); "
             "print(importlib.util.find_spec('models_and_data'), importlib.util.find_spec('benchmarks'), "
             "'torchdiagnose.hook' in sys.modules)")
    found = subprocess.run([python, "-c", probe], cwd=elsewhere, env=job_env(), capture_output=True, text=True,
                           timeout=60, check=True).stdout.split("\n")
    # The wheel's: the tests' Python's folders come after the venv's own on sys.path, and its editable install
    # (requirements-dev.txt) is not loaded here.
    assert found[0].startswith(str(venv)), found
    assert found[1] == "None None False", found  # nothing of the repository; the hook only under the prefix
    # Under the tool (DIAGNOSE_TIMEOUT set: the hook loads at start-up), a user's own diagnose.py is the one
    # `import diagnose` gets: the tool's package has a name of its own.
    (elsewhere / "diagnose.py").write_text('WHO = "the user\'s"\n')
    hooked = subprocess.run([python, "-c", "import sys, torchdiagnose.hook as h, diagnose; print("
                             "'torchdiagnose.hook' in sys.modules, h.__file__, diagnose.__file__, diagnose.WHO)"],
                            cwd=elsewhere, env=job_env(DIAGNOSE_TIMEOUT="5"), capture_output=True, text=True,
                            timeout=60, check=True).stdout.split()
    assert hooked[0] == "True" and hooked[1].startswith(str(venv)), hooked  # loaded at start-up, from the wheel
    assert hooked[2] == str(elsewhere / "diagnose.py") and hooked[3:] == ["the", "user's"], hooked


def test_torchrun_evaluation_on_rank_0_is_named_at_its_line_its_innermost_frame_and_its_call(venv, elsewhere):
    (elsewhere / "train.py").write_text(TORCHRUN_SCRIPT)
    code, lines = diagnosed(venv, elsewhere, venv / "bin" / "python", "-m", "torch.distributed.run", "--standalone",
                            "--nproc_per_node=2", "train.py", FAULT="slow")
    line = verdict(code, lines)
    assert f"(barrier at train.py:{line_of(TORCHRUN_SCRIPT, 'the barrier')}) waited" in line, line
    at = f"rank 0 did not arrive: it is alive, in its own code at train.py:{line_of(TORCHRUN_SCRIPT, 'the evaluation')}"
    phase = f"busy on the CPU in evaluate(), called at train.py:{line_of(TORCHRUN_SCRIPT, 'evaluate(model.module)')}:"
    assert at in line and "(innermost: torch/nn/" in line and phase in line, line  # the call that names the phase
    assert "flight recorder: `torchfrtrace fr_traces/" in line, line
    folder = line.split("torchfrtrace ")[1].split("`")[0]
    assert sorted(p.name for p in (elsewhere / folder).iterdir()) == ["rank_0", "rank_1"]


def test_a_users_fsdp_x_tp_script_a_stopped_rank_is_named_alone_with_its_groups_and_the_models_line(venv, elsewhere):
    """A user's FSDP2 x TP script on 4 processes under torchrun, its model in model.py, rank 3 stopped (SIGSTOP, as
    Ctrl-Z or a debugger would): named first and alone, as stopped with the signal torchrun's agent saw; its tp partner
    and its dp partner wait for it, each in its own group, at the script's line via the model's. No torchfrtrace hint
    (rank 3 wrote no dump); the tool ends the job at once and has the last word, after torchrun's report."""
    (elsewhere / "model.py").write_text(FSDP_TP_MODEL)
    (elsewhere / "train.py").write_text(FSDP_TP_SCRIPT)
    code, lines = diagnosed(venv, elsewhere, venv / "bin" / "python", "-m", "torch.distributed.run", "--standalone",
                            "--nproc_per_node=4", "train.py", STOP_RANK="3")
    line = verdict(code, lines)
    assert re.search(r"waited more than --timeout \d+s: rank 3 is stopped by SIGSTOP \(pid \d+, on [^)]+\): it runs "
                     r"nothing until it gets SIGCONT; waiting: ", line), line
    waits = dict(re.findall(r"(?:waiting: |; )(rank \d) in (.*?), for rank", line))
    assert set(waits) == {"rank 0", "rank 1", "rank 2"}, line
    assert waits["rank 1"].endswith(" of dp group [1, 3]") or "rank 1 in the collective above" in line, line
    assert re.search(r"rank 2 in .*? of tp group \[2, 3\], for rank 3", line), line
    model_lines = (line_of(FSDP_TP_MODEL, "the block's line"), line_of(FSDP_TP_MODEL, "the layers' line"))
    assert re.search(rf"at train\.py:{line_of(FSDP_TP_SCRIPT, 'the step')} via model\.py:({model_lines[0]}|"
                     rf"{model_lines[1]}) in forward", line), line
    # Rank 1's gather of the first block's weights (the root holds none), named by the block: in the head or its wait.
    assert re.search(rf"\(all_gather of \[\d+\], FSDP of layers\.0 at train\.py:{line_of(FSDP_TP_SCRIPT, 'the step')} "
                     rf"via model\.py:{model_lines[1]} in forward\)", line), line
    assert "odd one out" not in line and "did not arrive" not in line, line
    assert "no torchfrtrace: rank 3 did not answer, so wrote no flight recorder dump" in line, line
    assert "Root Cause" in "\n".join(text for _, text in lines)  # torchrun's report, before the tool's last line


def test_spawn_a_stalled_rank_is_named_with_its_line(venv, elsewhere):
    script = SPAWN_SCRIPT.replace(TUTORIAL_PORT, str(free_port()))
    (elsewhere / "tutorial.py").write_text(script)
    code, lines = diagnosed(venv, elsewhere, venv / "bin" / "python", "tutorial.py", FAULT="stall")
    line = verdict(code, lines)
    assert f"DDP's gradients in backward() at tutorial.py:{line_of(script, 'the backward line')}) waited" in line, line
    assert (f"rank 1 did not arrive: it is alive, in its own code at tutorial.py:{line_of(script, 'the stall')}, "
            "idle") in line, line
    assert "flight recorder: `torchfrtrace fr_traces/" in line, line


def test_spawn_a_killed_rank_is_named_with_its_signal(venv, elsewhere):
    script = SPAWN_SCRIPT.replace(TUTORIAL_PORT, str(free_port()))
    (elsewhere / "tutorial.py").write_text(script)
    code, lines = diagnosed(venv, elsewhere, venv / "bin" / "python", "tutorial.py", FAULT="die")
    line = verdict(code, lines)
    assert "failed (" in line and re.search(r"rank 1 is gone: killed by SIGKILL \(pid \d+", line), line


def test_spawn_a_rank_stopped_before_init_is_named_and_the_size_comes_from_the_call(venv, elsewhere):
    """No WORLD_SIZE in the environment: the group's size is the world_size the script passed; rank 1 has not
    checked in, and it is stopped."""
    script = SPAWN_SCRIPT.replace(TUTORIAL_PORT, str(free_port()))
    (elsewhere / "tutorial.py").write_text(script)
    code, lines = diagnosed(venv, elsewhere, venv / "bin" / "python", "tutorial.py", FAULT="stop_before_init")
    line = verdict(code, lines)
    assert line.startswith(f"diagnose: init_process_group has waited {TIMEOUT}s: the store at localhost:"), line
    assert ("the group of 2 ranks is not complete: rank 1 has not called init_process_group: it is stopped "
            "(pid") in line, line


def test_spawn_a_rank_stopped_while_importing_is_found_on_this_host_and_ended(venv, elsewhere):
    """A spawned process stops itself while it still imports the script, before mp.spawn's wrapper runs: it is found
    among this host's processes by the index mp.spawn started it with, named stopped, and ended with the job (as
    rank 1 the other waits for it in the group; as rank 0 nothing answers where it would open the store)."""
    script = SPAWN_SCRIPT.replace(TUTORIAL_PORT, str(free_port()))
    (elsewhere / "tutorial.py").write_text(script)
    code, lines = diagnosed(venv, elsewhere, venv / "bin" / "python", "tutorial.py", FAULT="stop_at_import")
    line = verdict(code, lines)
    pid = (elsewhere / "stopped.pid").read_text()
    assert line.startswith(f"diagnose: init_process_group has waited {TIMEOUT}s: "), line
    assert re.search(rf"rank [01] has not called init_process_group: it is stopped \(pid {pid}, on ", line), line


def test_spawn_a_port_in_use_names_the_scripts_own_line(venv, elsewhere):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        script = SPAWN_SCRIPT.replace(TUTORIAL_PORT, str(port))
        (elsewhere / "tutorial.py").write_text(script)
        code, lines = diagnosed(venv, elsewhere, venv / "bin" / "python", "tutorial.py")
    line = verdict(code, lines)
    setting = line_of(script, "the tutorial's line")
    assert (f"port {port} is already in use on this host" in line
            and f"the script sets MASTER_PORT={port} itself at tutorial.py:{setting}: change it there" in line), line
    assert "--master_port" not in line, line


def test_mpirun_a_stalled_rank_is_named_with_its_line(venv, elsewhere):
    script = SPAWN_SCRIPT.replace(TUTORIAL_PORT, str(free_port()))
    (elsewhere / "tutorial.py").write_text(script)
    code, lines = diagnosed(venv, elsewhere, BIN / "mpirun", "-np", "2", "--bind-to", "none", venv / "bin" / "python",
                            "tutorial.py", FAULT="stall")
    line = verdict(code, lines)
    assert (f"rank 1 did not arrive: it is alive, in its own code at tutorial.py:{line_of(script, 'the stall')}"
            in line), line


def test_on_a_torch_without_a_private_api_it_says_which_and_the_job_runs_untouched(venv, elsewhere):
    (elsewhere / "other_torch.py").write_text(OTHER_TORCH_SCRIPT.replace(TUTORIAL_PORT, str(free_port())))
    code, lines = diagnosed(venv, elsewhere, venv / "bin" / "python", "other_torch.py")
    output = [text for _, text in lines]
    assert code == 0 and output[-1] == "done", output
    (line,) = [text for text in output if text.startswith("diagnose: ")]
    assert line.startswith(f"diagnose: torch {torch.__version__} has no torch._C._distributed_c10d._dump_fr_trace, "
                           "a private API this tool reads (tested with torch "), line
    assert line.endswith("not watching this job, which runs as without the tool"), line
