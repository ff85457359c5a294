"""The launch files (slurm/, k8s/, Dockerfile): they parse, every script and flag they name exists, the
image keeps the pins, and the PyTorchJob's command trains here with the variables the Kubernetes operator
would set (epochs shortened to 2). The SLURM files run under a real cluster in test_slurm.py, the
Dockerfile is built and run with podman in test_container.py; no Kubernetes cluster can be started here."""
import functools
import re
import subprocess
import sys

import pytest
import yaml
from conftest import BIN, REPO, clean_env, free_port, load_snapshot, run

SBATCH = sorted((REPO / "slurm").glob("*.sbatch"))
SHELL_FILES = SBATCH + sorted(p for p in REPO.rglob("*.sh") if ".git" not in p.parts)
YAML_FILES = sorted((REPO / "k8s").glob("*.yaml"))
DOCKERFILE = REPO / "Dockerfile"
FLAG = re.compile(r"^--[A-Za-z0-9][A-Za-z0-9_-]*")


def logical_lines(path):
    """Lines with comment markers stripped (commented alternatives are documentation users run too) and
    backslash continuations joined."""
    joined, pending = [], ""
    for raw in path.read_text().splitlines():
        line = re.sub(r"^\s*#+\s?", "", raw).rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        joined.append(pending + line)
        pending = ""
    return joined


def commands_in(path):
    """Token lists of the commands a file runs: YAML container commands, or shell-like lines."""
    if path.suffix == ".yaml":
        found = []
        for doc in yaml.safe_load_all(path.read_text()):
            for spec in doc["spec"]["pytorchReplicaSpecs"].values():
                for container in spec["template"]["spec"]["containers"]:
                    found.append([*container.get("command", []), *container.get("args", [])])
        return found
    # Prose punctuation (a word ending in ':', ',' or '.') ends a command, as a ';' would.
    return [[token.strip("\"'[],") if not token.endswith((":", ",", ".")) else ";" for token in line.split()]
            for line in logical_lines(path)]


@functools.lru_cache(maxsize=None)
def flags_of(program):
    """The flags a program accepts, read from its own --help."""
    cmd = [BIN / "torchrun"] if program == "torchrun" else [sys.executable, REPO / program]
    help_text = run([*cmd, "--help"], cwd=REPO, timeout=120).stdout
    return set(re.findall(r"--[A-Za-z0-9][A-Za-z0-9_-]*", help_text))


def script_uses():
    """(file, program, flag) for every flag given to torchrun or to one of the repository's scripts."""
    uses = []
    for path in [*SBATCH, *YAML_FILES, DOCKERFILE]:
        for tokens in commands_in(path):
            scripts = [i for i, t in enumerate(tokens) if t.endswith(".py")]
            if not scripts:
                continue
            i = scripts[0]
            uses.append((path, tokens[i], None))
            end = next((j for j in range(i + 1, len(tokens)) if tokens[j] in (";", "|", "&&", "||")), len(tokens))
            uses += [(path, tokens[i], m[0]) for t in tokens[i + 1:end] if (m := FLAG.match(t))]
            if "torchrun" in tokens[:i]:
                start = tokens.index("torchrun")
                uses += [(path, "torchrun", m[0]) for t in tokens[start + 1:i] if (m := FLAG.match(t))]
    return uses


def test_shell_files_parse():
    assert len(SBATCH) >= 2
    for path in SHELL_FILES:
        result = subprocess.run(["bash", "-n", path], capture_output=True, text=True)
        assert result.returncode == 0, f"{path}: {result.stderr}"


def test_pytorchjob_has_master_and_workers():
    assert YAML_FILES
    for path in YAML_FILES:
        (job,) = list(yaml.safe_load_all(path.read_text()))
        assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
        replicas = job["spec"]["pytorchReplicaSpecs"]
        assert set(replicas) == {"Master", "Worker"}
        assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] >= 1
        assert int(job["spec"]["nprocPerNode"]) >= 1
        for spec in replicas.values():
            (container,) = spec["template"]["spec"]["containers"]
            assert container["name"] == "pytorch"  # the container the operator injects its variables into
            assert container["command"][0] == "torchrun" and "multinode.py" in container["command"]
            snapshot = next(a.split("=", 1)[1] for a in container["command"] if a.startswith("--snapshot_path"))
            mounts = [m["mountPath"] for m in container["volumeMounts"]]
            assert any(snapshot.startswith(m + "/") for m in mounts), f"snapshot {snapshot} not on a volume"


def test_every_script_and_flag_named_exists():
    uses = script_uses()
    scripts = {program for _, program, _ in uses if program != "torchrun"}
    assert {"multinode.py", "run_with_mpirun.py", "multigpu_torchrun.py"} <= scripts
    for path, program, flag in uses:
        if program != "torchrun":
            assert (REPO / program).is_file(), f"{path.name} names {program}, which does not exist"
        if flag is not None:
            assert flag in flags_of(program), f"{path.name}: {program} has no flag {flag}"


def requirement_pins():
    pins = {}
    for line in (REPO / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.lower()] = version
    return pins


def test_dockerfile_installs_the_pinned_requirements():
    pins = requirement_pins()
    text = DOCKERFILE.read_text()
    base = re.search(r"^ARG BASE_IMAGE=(\S+)", text, re.M)[1]
    assert re.fullmatch(r"pytorch/pytorch:(\S+?)-cuda[\d.]+-cudnn\d+-runtime", base)
    assert base.split(":")[1].split("-")[0] == pins["torch"], "base image torch differs from the pin"
    assert re.search(r"^FROM \$\{BASE_IMAGE\}", text, re.M)
    pip_lines = [line for line in logical_lines(DOCKERFILE) if "pip install" in line]
    assert any("-r requirements.txt" in line for line in pip_lines)
    for line in pip_lines:
        packages = line.split("pip install", 1)[1].split("&&")[0].split()
        for package in packages:
            if package.startswith("-") or package == "requirements.txt":
                continue
            name, _, version = package.partition("==")
            assert pins.get(name.lower()) == version, f"Dockerfile pip installs {package}, requirements pin {pins}"
    assert re.search(r"^COPY requirements.txt", text, re.M)
    env = dict(re.findall(r"(OMPI_ALLOW_RUN_AS_ROOT(?:_CONFIRM)?)=(\S+)", text))
    assert env == {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def assert_trained(result, snapshot, world_size):
    summary = [line for line in result.stdout.splitlines() if line.startswith("Summary:")]
    assert len(summary) == 1, result.stdout[-2000:]
    assert f"world size {world_size} | backend gloo" in summary[0]
    assert load_snapshot(snapshot)["epochs_run"] == 2


def shortened(argv, snapshot):
    """The same command with 2 epochs and the snapshot in the test's folder."""
    text = re.sub(r"--total_epochs[ =]\d+", "--total_epochs=2", " ".join(argv))
    return re.sub(r"--snapshot_path[ =]\S+", f"--snapshot_path={snapshot}", text)


def test_pytorchjob_command_trains_with_the_operator_variables(tmp_path):
    (job,) = list(yaml.safe_load_all(YAML_FILES[0].read_text()))
    command = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"]
    operator = {"PET_NNODES": "1", "PET_NPROC_PER_NODE": job["spec"]["nprocPerNode"], "PET_NODE_RANK": "0",
                "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(free_port())}
    # Kubernetes expands $(VAR) in a command from the container's environment, where the operator put these.
    argv = [re.sub(r"\$\((\w+)\)", lambda m: operator[m[1]], arg) for arg in command]
    argv = shortened(argv, tmp_path / "snap.pt").split()
    result = run([BIN / argv[0], *argv[1:]], cwd=REPO, env=clean_env(**operator), timeout=180)
    assert_trained(result, tmp_path / "snap.pt", world_size=int(operator["PET_NPROC_PER_NODE"]))


# torchrun accepts both spellings of its flags; the repository uses one, with underscores.
TORCHRUN_DASHED = re.compile(r"--(?:nproc-per-node|node-rank|rdzv-backend|rdzv-endpoint|rdzv-id|rdzv-conf|max-restarts|"
                             r"master-addr|master-port|local-addr)\b")


@pytest.mark.parametrize("path", [*SBATCH, *YAML_FILES, DOCKERFILE], ids=lambda p: p.name)
def test_torchrun_flags_are_spelled_with_underscores(path):
    assert not TORCHRUN_DASHED.findall(path.read_text()), path


@pytest.mark.parametrize("path", SBATCH, ids=lambda p: p.name)
def test_sbatch_header_and_launch(path):
    text = path.read_text()
    assert text.startswith("#!/bin/bash\n") and "#SBATCH --nodes=" in text
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1' in text
    if path.name == "multinode.sbatch":
        assert re.search(r"--rdzv_id=\"?\$SLURM_JOB_ID", text) and "--rdzv_backend=c10d" in text
        assert "--ntasks-per-node=1" in text  # one torchrun per node
    else:
        assert "srun --mpi=pmix" in text and re.search(r"^# mpirun ", text, re.M)
