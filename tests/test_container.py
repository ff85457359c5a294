"""The Dockerfile built for real with podman, and the image's commands run in containers without GPUs.

No registry is reachable here, so the base image is made locally: a Debian bookworm made by mmdebstrap
from the host's own Debian mirror, with a Python venv on PATH and torch in it (what the Dockerfile needs
of a base: `python` and a `pip` that installs into it, and their scripts on PATH; the official
pytorch/pytorch images also bring torch). It goes in through the Dockerfile's BASE_IMAGE build argument;
the default stays the official image. The base's torch is the host's: the installation in the venv that
runs pytest, with everything it requires (host_torch()).

Which build the image then runs is the venv's, and these tests need PyPI's torch for Linux, the CUDA build
(2.13.0+cu130, its CUDA libraries in the nvidia-* packages): the image's real torch, as the official base
carries it. In a venv with another build (the CPU wheel of the README's venv on this machine) they are skipped
with that reason: they would prove an image nobody ships, and .ci/run runs them from its second venv, the one
with PyPI's build. The containers have no GPU, so these tests prove the Dockerfile's
`docker run --rm ddp-examples:latest` without GPUs: the default command trains on 2 CPU processes with gloo,
although torch.accelerator.current_accelerator() names cuda there (only check_available=True finds none; a
script that asks without it goes for NCCL and fails).
test_image_torch_is_the_base_build_and_sees_no_accelerator checks that the containers run the venv's build.

The pinned requirements come from a wheelhouse that the host's pip fills beforehand, so the build itself
runs without a network (--network=none), and so do the containers: torchrun and mpirun inside use the
container's own loopback.

Everything podman keeps (configuration, images, containers) lives in the tests' temporary directory,
pointed at by CONTAINERS_CONF and CONTAINERS_STORAGE_CONF; nothing in /etc is changed.
"""
import importlib.metadata
import os
import re
import resource
import shlex
import shutil
import sys
import tomllib
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from conftest import PROBE, REPO, epoch_losses, finish, run, start, summary

PACKAGES = "podman runc mmdebstrap zstd"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
IMAGE = "localhost/ddp-examples:test"
BASE = "localhost/ddp-examples-base:test"


def debian_mirror():
    """The first Debian archive the host's apt uses (deb822 .sources or one-line sources.list)."""
    sources = sorted(Path("/etc/apt/sources.list.d").glob("*.sources")) + [Path("/etc/apt/sources.list")]
    for path in sources:
        text = path.read_text() if path.is_file() else ""
        for uri in re.findall(r"^URIs:\s*(\S+)", text, re.M) + re.findall(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)", text, re.M):
            if uri.rstrip("/").endswith("/debian"):
                return uri
    return None


def unavailable():
    if os.geteuid() != 0:
        return "podman builds and runs as root here (no user namespaces for rootless podman)"
    absent = [name for name in ("podman", "runc", "mmdebstrap", "zstd") if shutil.which(name) is None]
    if absent:
        return f"{', '.join(absent)} not installed: apt-get install {PACKAGES} (.ci/run does)"
    if torch.version.cuda is None:
        return (f"torch {torch.__version__} here; the image's is the official base's CUDA build: run these from a venv "
                "with PyPI's torch (pip --isolated, as .ci/run's second phase does)")
    if debian_mirror() is None:
        return "no Debian mirror in /etc/apt/sources.list(.d) for mmdebstrap to make the base image from"
    return None


WHY_NOT = unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))]


class Podman:
    def __init__(self, root):
        self.root = root
        nofile, nproc = (min(8192, resource.getrlimit(limit)[1]) for limit in
                         (resource.RLIMIT_NOFILE, resource.RLIMIT_NPROC))
        (root / "containers.conf").write_text(
            "[containers]\n"
            # podman's default (nofile 1048576) is above what this machine lets runc set.
            f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]\n'
            "[engine]\n"
            # crun fails on this kind of host (cgroups in hybrid mode); runc works.
            'runtime = "runc"\n'
            'cgroup_manager = "cgroupfs"\n'
            'events_logger = "file"\n'
            f'events_logfile_path = "{root}/events.log"\n'
            f'tmp_dir = "{root}/tmp"\n'
            # Where an import or a commit first writes a layer's blob (the CUDA build's base: 2.8 GB): here,
            # not /var/tmp.
            f'image_copy_tmp_dir = "{root}/image-copy"\n')
        (root / "image-copy").mkdir()
        (root / "storage.conf").write_text(
            f'[storage]\ndriver = "overlay"\ngraphroot = "{root}/storage"\nrunroot = "{root}/run"\n')
        self.env = {**os.environ, "CONTAINERS_CONF": str(root / "containers.conf"),
                    "CONTAINERS_STORAGE_CONF": str(root / "storage.conf")}

    def __call__(self, *args, cwd=None, timeout=300, check=True):
        return run(["podman", *args], cwd=cwd or self.root, env=self.env, timeout=timeout, check=check)

    def remove_everything(self):
        self("rm", "--all", "--force", "--time=0", timeout=120, check=False)
        self("rmi", "--all", "--force", timeout=300, check=False)
        leftover = self("ps", "--all", "--quiet", timeout=60, check=False).stdout.split()
        shutil.rmtree(self.root / "storage", ignore_errors=True)
        return leftover


@pytest.fixture(scope="module")
def podman(tmp_path_factory):
    engine = Podman(tmp_path_factory.mktemp("podman"))
    yield engine
    assert engine.remove_everything() == [], "containers outlived the tests"


SITE_PACKAGES = "/opt/venv/lib/python3.11/site-packages"
# What `python3 -m venv` puts in the base's venv itself (Python 3.11's ensurepip): the base keeps its own, and
# the build's pip upgrades them from the wheelhouse where a requirement asks for more (torch: setuptools>=77).
VENV_OWN = {"pip", "setuptools"}
HostTorch = namedtuple("HostTorch", "version site files scripts carried")


def installed_closure(names):
    """{canonical name: distribution} of the host's installed distributions that `names` need, their
    requirements and theirs in turn (extras and environment markers as pip evaluates them here)."""
    installed = {}
    for dist in importlib.metadata.distributions():  # in sys.path's order: the first is the one imported
        if dist.metadata["Name"]:
            installed.setdefault(canonicalize_name(dist.metadata["Name"]), dist)
    found, extras_seen = {}, {}
    pending = [Requirement(name) for name in names]
    while pending:
        requirement = pending.pop()
        key = canonicalize_name(requirement.name)
        extras = extras_seen.setdefault(key, set())
        if key in found and requirement.extras <= extras:
            continue
        if key not in installed:
            raise LookupError(f"{requirement.name} is required but not installed")
        found[key] = installed[key]
        extras |= requirement.extras
        for text in installed[key].requires or []:
            needed = Requirement(text)
            if needed.marker is None or any(needed.marker.evaluate({"extra": extra}) for extra in extras | {""}):
                pending.append(needed)
    return found


def pinned_requirements():
    """The names requirements.txt lists."""
    lines = (line.split("#")[0].strip() for line in (REPO / "requirements.txt").read_text().splitlines())
    return [Requirement(line).name for line in lines if line]


def host_torch():
    """The host's installed torch with everything it requires, when the base image can carry them (the pinned
    version, built for the Python of Debian bookworm, 3.11); otherwise None, and the build installs torch from
    the wheelhouse.

    Carried: every file that the installation records (RECORD) in site-packages, of torch and of each
    distribution in its requirements' closure, less the venv's own pip and setuptools. For PyPI's Linux wheel,
    the CUDA build, that is what the official pytorch/pytorch image holds as well: the nvidia-* libraries
    (libtorch_cuda.so links cuBLAS, cuDNN, NCCL, ... and so loads them at `import torch`), triton,
    cuda-bindings, some 4.9 GB; for the CPU wheel only torch and a few pure-Python packages. Returns
    (torch.__version__, site-packages, [files relative to it], {console script: "module:function"},
    {name: version carried})."""
    try:
        dist = importlib.metadata.distribution("torch")
    except importlib.metadata.PackageNotFoundError:
        return None
    pin = re.search(r"^torch==(\S+)", (REPO / "requirements.txt").read_text(), re.M)[1]
    if sys.version_info[:2] != (3, 11) or dist.version.split("+")[0] != pin:
        return None
    carried = {name: d for name, d in installed_closure(["torch"]).items() if name not in VENV_OWN}
    if any(d.files is None for d in carried.values()):
        return None  # installed without a RECORD (not by pip): which files are its own is unknown
    site = Path(dist.locate_file(""))
    # RECORD's paths outside site-packages (../../../bin/torchrun, a man page) are left out: the console
    # scripts are written for the base's venv instead.
    files = sorted({str(f) for d in carried.values() for f in d.files if not str(f).startswith("..")})
    scripts = {ep.name: ep.value for d in carried.values() for ep in d.entry_points if ep.group == "console_scripts"}
    return HostTorch(torch.__version__, site, files, scripts, {name: d.version for name, d in carried.items()})


def toml_build_requires(path):
    """A pyproject.toml's [build-system] requires: what pip installs to build the project."""
    return tomllib.loads(path.read_text())["build-system"]["requires"]


def wheelhouse_requirements(carried):
    """What `pip download` fetches for the build. With torch carried by the base: the host's own versions of
    what requirements.txt needs beyond what the base carries, each without its dependencies, so that no
    torch wheel (and, for the CUDA build, none of its 2.7 GB of CUDA wheels) is downloaded only to go
    unused. Otherwise requirements.txt itself, resolved by pip."""
    if not carried:
        return ["--requirement", REPO / "requirements.txt"]
    needed = installed_closure(pinned_requirements())
    return ["--no-deps", *(f"{d.metadata['Name']}=={d.version}" for name, d in sorted(needed.items())
                           if name not in carried)]


@pytest.fixture(scope="module")
def base_torch():
    return host_torch()


@pytest.fixture(scope="module")
def image(podman, base_torch):
    """The Dockerfile built on a locally made Debian base, from a wheelhouse, without a network.

    What the build costs, measured here: the base (mmdebstrap, about 40 s; debootstrap took 97 s), and the
    Dockerfile's `pip install` of requirements.txt, whose 1.5 GB podman then commits as a layer. So the
    pinned wheels are downloaded while the base is made, and the base carries torch, as the official
    pytorch/pytorch image does: the host's own installation of the pinned wheel with what it requires,
    instead of 800 MB unpacked and byte-compiled again. The wheelhouse then holds no torch, so the build
    succeeds only if pip keeps the base's torch, as the Dockerfile says it does.

    The CUDA build makes the base 5.1 GB (2.8 GB in zstd) instead of 1.1 GB (0.3 GB). Its files are
    hard-linked into mmdebstrap's tree where the host's venv shares its file system (copied otherwise, as
    with a TMPDIR elsewhere), and the tar goes to zstd as mmdebstrap writes it, not to disk first. What
    remains comes with a 5 GB layer: reading and compressing it, and podman's import, which unpacks it into
    its storage (65 s instead of 20 s at a quiet hour here; at a busy one 134 s, and 180 s for the same tar
    uncompressed). Measured on the shared 2-core machine at a quiet hour, this module took 213 to 224 s with
    the CUDA build and 115 to 130 s with the CPU wheel (545 to 1063 s and 531 to 749 s at busy hours), and
    its disk use peaked at 10.4 GB instead of 3.4 GB.
    """
    root = podman.root
    wheels = root / "wheels"
    # --python-version: wheels for the base's Python (bookworm: 3.11), whatever Python the host runs.
    download = start([sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:",
                      "--python-version=3.11", "--dest", wheels,
                      *wheelhouse_requirements(base_torch and base_torch.carried)], cwd=root)
    hooks = ["chroot \"$1\" python3 -m venv /opt/venv"]
    if base_torch:
        bin_dir = root / "torch-bin"
        bin_dir.mkdir()
        for name, target in base_torch.scripts.items():
            module, function = target.split(":")
            (bin_dir / name).write_text(f"#!/opt/venv/bin/python\nimport sys\nfrom {module} import {function}\n"
                                        f"sys.exit({function}())\n")
            (bin_dir / name).chmod(0o755)
        file_list = root / "torch-files"
        file_list.write_text("".join(f"{name}\0" for name in base_torch.files))
        # Hard links where the host's venv shares a file system with mmdebstrap's tree (the tar is the same,
        # without writing 4.9 GB first); nothing writes to the tree's /opt after this hook. Otherwise copies.
        copy = f"cp --parents --preserve=mode,timestamps -t \"$1{SITE_PACKAGES}\""
        files = shlex.quote(str(file_list))
        hooks += [f"cd {shlex.quote(str(base_torch.site))} && {{ xargs -0 {copy} --link < {files} 2>/dev/null"
                  f" || xargs -0 {copy} --remove-destination < {files}; }}"]
        if base_torch.scripts:
            hooks.append(f"copy-in {' '.join(str(bin_dir / name) for name in base_torch.scripts)} /opt/venv/bin")
    base = root / "base.tar.zst"
    try:
        # minbase: Debian's required packages (libstdc++ among them, which torch needs), no documentation.
        # The tar goes straight to zstd (-1, on all cores): podman 4.3 imports an uncompressed tar through a
        # slow path (some 30 s for the 1.1 GB of the CPU build here), the compressed one several times faster.
        mmdebstrap = ["mmdebstrap", "--quiet", "--variant=minbase", "--format=tar", "--include=python3,python3-venv",
                      *(f"--dpkgopt=path-exclude=/usr/share/{d}/*" for d in ("doc", "man", "locale")),
                      *(f"--customize-hook={hook}" for hook in hooks), "bookworm", "-", debian_mirror()]
        run(["bash", "-c", 'set -o pipefail; out=$1; shift; "$@" | zstd --quiet -1 -T0 -o "$out"', "bash", base,
             *mmdebstrap], cwd=root, timeout=1200)
    finally:
        out = finish(download, timeout=900)
    assert download.returncode == 0, f"pip download exited {download.returncode}:\n{out[-3000:]}"
    # The Dockerfile's `pip install ./diagnose` builds torchdiagnose's wheel: its build backend, with what it needs.
    build_backend = toml_build_requires(REPO / "diagnose" / "pyproject.toml")
    run([sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--python-version=3.11",
         "--dest", wheels, *build_backend], cwd=root, timeout=300)
    podman("import", "--change", f"ENV PATH=/opt/venv/bin:{DEFAULT_PATH}", base, BASE, timeout=900)
    base.unlink()
    # The test's pip configuration also skips byte-compiling (some 20 s of the build here): the modules
    # the containers import compile when first imported instead.
    (root / "pip.conf").write_text("[global]\nno-index = true\nfind-links = /wheels\n[install]\nno-compile = true\n")
    podman("build", "--network=none", "--build-arg", f"BASE_IMAGE={BASE}", "--volume", f"{wheels}:/wheels:ro",
           "--volume", f"{root / 'pip.conf'}:/etc/pip.conf:ro", "--tag", IMAGE, REPO, timeout=1200)
    shutil.rmtree(wheels)
    return IMAGE


def container(podman, image, *command, timeout=300, check=True):
    """`docker run --rm` with no network but the container's loopback. The tests' probes (tests/support)
    load in every Python process inside, as in the tests' other launches. conmon, not the test, bounds the
    container's life (--timeout), so that not even a killed pytest leaves it running."""
    return podman("run", "--rm", "--network=none", f"--timeout={timeout}", "--volume", f"{PROBE}:/probe:ro",
                  "--env", "PYTHONPATH=/probe", image, *command, timeout=timeout + 60, check=check)


def test_image_holds_the_pinned_torch_and_the_repository_less_what_dockerignore_lists(podman, image):
    out = container(podman, image, "sh", "-c",
                    "pwd; ls -A; python -c 'import torch, mpi4py; print(torch.__version__, mpi4py.__version__)'"
                    ).stdout.split()
    assert out[0] == "/workspace/ddp-examples"
    expected = {"multigpu_torchrun.py", "models_and_data.py", "run_with_mpirun.py", "diagnose", "requirements.txt"}
    assert expected <= set(out)
    assert not {".git", ".ci", ".env", "snapshots"} & set(out), out
    assert out[-2].split("+")[0] == "2.13.0" and out[-1] == "4.1.2", out


def test_image_torch_is_the_base_build_and_sees_no_accelerator(podman, image, base_torch):
    """The torch the containers run is the build the base carries (with the host's CUDA wheel: 2.13.0+cu130,
    as in the official image), and in a container without GPUs it finds no accelerator when asked
    check_available=True; current_accelerator() alone still answers cuda for the CUDA build, its kind, GPU
    or not: the trap that sends a script to NCCL and CUDA devices that are not there."""
    code = ("import torch; a = torch.accelerator; print('torch-build:', torch.__version__, torch.version.cuda, "
            "a.current_accelerator(), a.current_accelerator(check_available=True), torch.cuda.is_available())")
    out = container(podman, image, "python", "-c", code).stdout
    version, cuda, accelerator, available, cuda_available = re.search(r"^torch-build: (.*)$", out, re.M)[1].split()
    if base_torch:
        assert version == base_torch.version, (version, base_torch.version)
    assert version.split("+")[0] == "2.13.0", version
    assert (available, cuda_available) == ("None", "False"), out
    assert accelerator == ("cuda" if cuda != "None" else "None"), out


def test_default_command_is_the_quick_start_on_two_cpu_processes(podman, image):
    out = container(podman, image).stdout
    trained = summary(out)
    assert (trained.epochs, trained.steps, trained.world_size, trained.backend) == (20, 640, 2, "gloo"), out[-3000:]
    losses = epoch_losses(out)
    assert len(losses) == 20 and losses[-1] < losses[0] / 10, losses
    assert "Epoch 19 | Snapshot saved at multigpu_torchrun.pt" in out


def test_torchdiagnose_in_the_image_names_a_stalled_rank_and_its_line(podman, image):
    """The Dockerfile installs torchdiagnose (its console script and its start-up hook): the commented command
    finds hangs.py's stalled rank inside a container."""
    result = container(podman, image, "torchdiagnose", "--timeout", "10", "torchrun", "--standalone",
                       "--nproc_per_node=2", "hangs.py", "--fault", "stall", check=False)
    said = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("diagnose: ")]
    verdict = said[-1] if said else ""
    assert result.returncode != 0 and verdict.startswith("diagnose: collective #"), result.stderr[-3000:]
    assert "rank 1 did not arrive: it is alive, in its own code at hangs.py:" in verdict, verdict


def test_mpirun_trains_inside_the_image(podman, image):
    out = container(podman, image, "mpirun", "-np", "2", "python", "run_with_mpirun.py", "--train",
                    "--total_epochs", "2", "--save_every", "1").stdout
    trained = summary(out)
    assert (trained.epochs, trained.world_size, trained.backend) == (2, 2, "gloo"), out[-3000:]
    assert "Process 1: rank from MPI.COMM_WORLD.Get_rank(), local rank 1 from OMPI_COMM_WORLD_LOCAL_RANK" in out

