"""The launch files (slurm/, k8s/, Dockerfile): they parse, every script and flag they name exists, the
image keeps the pins. The SLURM files run under a real cluster in test_slurm.py, the Dockerfile is built
and run with podman in test_container.py, and the Kubernetes manifests are checked against their API models
and their commands run as pods would in test_kubernetes.py (no Kubernetes cluster can be started here)."""
import re
import subprocess

import pytest
import yaml
from conftest import REPO, help_text

SBATCH = sorted((REPO / "slurm").glob("*.sbatch"))
# The repository's own shell files: not those of .git, nor of a virtual environment made inside the clone (the
# README's .venv holds packages' shell files, which are not ours to check).
VENVS = {p.parent.name for p in REPO.glob("*/pyvenv.cfg")}
SHELL_FILES = SBATCH + sorted(p for p in REPO.rglob("*.sh") if not {".git", *VENVS} & set(p.relative_to(REPO).parts))
YAML_FILES = sorted((REPO / "k8s").glob("*.yaml"))
K8S_CLAIM = REPO / "k8s" / "snapshots-pvc.yaml"  # a volume: no command
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


def containers_in(node):
    """Every mapping with a command or args list in a YAML document, wherever the kind puts it: a pod's
    containers, a PyTorchJob's replica templates, a TrainJob's trainer."""
    if isinstance(node, dict):
        if isinstance(node.get("command"), list) or isinstance(node.get("args"), list):
            yield node
        for value in node.values():
            yield from containers_in(value)
    elif isinstance(node, list):
        for value in node:
            yield from containers_in(value)


def commands_in(path):
    """Token lists of the commands a file runs: YAML container commands, or shell-like lines."""
    if path.suffix == ".yaml":
        return [[*c.get("command", []), *c.get("args", [])] for doc in yaml.safe_load_all(path.read_text())
                for c in containers_in(doc)]
    # Prose punctuation (a word ending in ':', ',' or '.') ends a command, as a ';' would.
    return [[token.strip("\"'[],") if not token.endswith((":", ",", ".")) else ";" for token in line.split()]
            for line in logical_lines(path)]


def flags_of(program, programs):
    """The flags a program accepts, read from its own --help (all of `programs` asked in one process)."""
    return set(re.findall(r"--[A-Za-z0-9][A-Za-z0-9_-]*", help_text(program, programs)))


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


def test_every_script_and_flag_named_exists():
    uses = script_uses()
    programs = {program for _, program, _ in uses}
    scripts = programs - {"torchrun"}
    assert {"multinode.py", "run_with_mpirun.py", "multigpu_torchrun.py"} <= scripts
    assert {path for path, program, _ in uses if program == "torchrun"} >= set(YAML_FILES) - {K8S_CLAIM}
    for path, program, flag in uses:
        if program != "torchrun":
            assert (REPO / program).is_file(), f"{path.name} names {program}, which does not exist"
        if flag is not None:
            assert flag in flags_of(program, programs), f"{path.name}: {program} has no flag {flag}"


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
            if package.startswith("./"):  # a project of this repository (torchdiagnose), as requirements-dev.txt has it
                assert (REPO / package / "pyproject.toml").is_file(), package
                assert f"-e {package}" in (REPO / "requirements-dev.txt").read_text(), package
                continue
            name, _, version = package.partition("==")
            assert pins.get(name.lower()) == version, f"Dockerfile pip installs {package}, requirements pin {pins}"
    assert re.search(r"^COPY requirements.txt", text, re.M)
    env = dict(re.findall(r"(OMPI_ALLOW_RUN_AS_ROOT(?:_CONFIRM)?)=(\S+)", text))
    assert env == {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


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
