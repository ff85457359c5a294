"""The Dockerfile built for real with podman, and the image's commands run in containers.

No registry is reachable here, so the base image is made locally: a Debian bookworm made by mmdebstrap
from the host's own Debian mirror, with a Python venv on PATH and torch in it (what the Dockerfile needs
of a base: `python` and a `pip` that installs into it, and their scripts on PATH; the official
pytorch/pytorch images also bring torch). It goes in through the Dockerfile's BASE_IMAGE build argument;
the default stays the official image. The pinned requirements come from a wheelhouse that the host's pip
fills beforehand, so the build itself runs without a network (--network=none), and so do the
containers: torchrun and mpirun inside use the container's own loopback.

Everything podman keeps (configuration, images, containers) lives in the tests' temporary directory,
pointed at by CONTAINERS_CONF and CONTAINERS_STORAGE_CONF; nothing in /etc is changed.
"""
import importlib.metadata
import os
import re
import resource
import shutil
import sys
from pathlib import Path

import pytest

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
    if debian_mirror() is None:
        return "no Debian mirror in /etc/apt/sources.list(.d) for mmdebstrap to make the base image from"
    return None


WHY_NOT = unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))


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
            f'tmp_dir = "{root}/tmp"\n')
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


def host_torch():
    """The host's installed torch, when the base image can carry it (the pinned version, built for the
    Python of Debian bookworm, 3.11): (its top-level packages and dist-info, its console scripts as
    {name: "module:function"}); otherwise None, and the build installs torch from the wheelhouse."""
    try:
        dist = importlib.metadata.distribution("torch")
    except importlib.metadata.PackageNotFoundError:
        return None
    pin = re.search(r"^torch==(\S+)", (REPO / "requirements.txt").read_text(), re.M)[1]
    if sys.version_info[:2] != (3, 11) or dist.version.split("+")[0] != pin:
        return None
    site = Path(dist.locate_file(""))
    paths = [site / name for name in dist.read_text("top_level.txt").split()]
    paths.append(site / f"{dist.metadata['Name']}-{dist.version}.dist-info")
    scripts = {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}
    return paths, scripts


@pytest.fixture(scope="module")
def image(podman):
    """The Dockerfile built on a locally made Debian base, from a wheelhouse, without a network.

    What the build costs, measured here: the base (mmdebstrap, about 40 s; debootstrap took 97 s), and the Dockerfile's
    `pip install` of requirements.txt, whose 1.5 GB podman then commits as a layer. So the pinned wheels
    are downloaded while the base is made, and the base carries torch, as the official pytorch/pytorch
    image does: the host's own installation of the pinned wheel, copied in, instead of 800 MB unpacked
    and byte-compiled again. The wheelhouse then holds no torch, so the build succeeds only if pip keeps
    the base's torch, as the Dockerfile says it does.
    """
    root = podman.root
    wheels = root / "wheels"
    # --python-version: wheels for the base's Python (bookworm: 3.11), whatever Python the host runs.
    download = start([sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:",
                      "--python-version=3.11", "--dest", wheels, "--requirement", REPO / "requirements.txt"], cwd=root)
    hooks = ["chroot \"$1\" python3 -m venv /opt/venv"]
    torch = host_torch()
    if torch:
        paths, scripts = torch
        bin_dir = root / "torch-bin"
        bin_dir.mkdir()
        for name, target in scripts.items():
            module, function = target.split(":")
            (bin_dir / name).write_text(f"#!/opt/venv/bin/python\nimport sys\nfrom {module} import {function}\n"
                                        f"sys.exit({function}())\n")
            (bin_dir / name).chmod(0o755)
        hooks += [f"copy-in {' '.join(map(str, paths))} /opt/venv/lib/python3.11/site-packages",
                  f"copy-in {' '.join(str(bin_dir / name) for name in scripts)} /opt/venv/bin"]
    try:
        # minbase: Debian's required packages (libstdc++ among them, which torch needs), no documentation.
        run(["mmdebstrap", "--quiet", "--variant=minbase", "--include=python3,python3-venv",
             *(f"--dpkgopt=path-exclude=/usr/share/{d}/*" for d in ("doc", "man", "locale")),
             *(f"--customize-hook={hook}" for hook in hooks), "bookworm", root / "base.tar", debian_mirror()],
            cwd=root, timeout=900)
    finally:
        out = finish(download, timeout=900)
    assert download.returncode == 0, f"pip download exited {download.returncode}:\n{out[-3000:]}"
    # podman 4.3 imports an uncompressed tar through a slow path (some 30 s for this 1.1 GB here); the same
    # tar compressed first by zstd on both cores takes a few seconds each way.
    run(["zstd", "--quiet", "-1", "-T0", "--rm", root / "base.tar", "-o", root / "base.tar.zst"], cwd=root, timeout=300)
    podman("import", "--change", f"ENV PATH=/opt/venv/bin:{DEFAULT_PATH}", root / "base.tar.zst", BASE, timeout=600)
    (root / "base.tar.zst").unlink()
    if torch:
        for wheel in wheels.glob("torch-*.whl"):
            wheel.unlink()
    # The test's pip configuration also skips byte-compiling (some 20 s of the build here): the modules
    # the containers import compile when first imported instead.
    (root / "pip.conf").write_text("[global]\nno-index = true\nfind-links = /wheels\n[install]\nno-compile = true\n")
    podman("build", "--network=none", "--build-arg", f"BASE_IMAGE={BASE}", "--volume", f"{wheels}:/wheels:ro",
           "--volume", f"{root / 'pip.conf'}:/etc/pip.conf:ro", "--tag", IMAGE, REPO, timeout=1200)
    shutil.rmtree(wheels)
    return IMAGE


def container(podman, image, *command, timeout=300):
    """`docker run --rm` with no network but the container's loopback. The tests' probes (tests/support)
    load in every Python process inside, as in the tests' other launches. conmon, not the test, bounds the
    container's life (--timeout), so that not even a killed pytest leaves it running."""
    return podman("run", "--rm", "--network=none", f"--timeout={timeout}", "--volume", f"{PROBE}:/probe:ro",
                  "--env", "PYTHONPATH=/probe", image, *command, timeout=timeout + 60)


def test_image_holds_the_pinned_torch_and_the_repository_less_what_dockerignore_lists(podman, image):
    out = container(podman, image, "sh", "-c",
                    "pwd; ls -A; python -c 'import torch, mpi4py; print(torch.__version__, mpi4py.__version__)'"
                    ).stdout.split()
    assert out[0] == "/workspace/ddp-examples"
    assert {"multigpu_torchrun.py", "run_with_mpirun.py", "ddp_common", "requirements.txt"} <= set(out)
    assert not {".git", ".ci", ".env", "snapshots"} & set(out), out
    assert out[-2].split("+")[0] == "2.13.0" and out[-1] == "4.1.2", out


def test_default_command_is_the_quick_start_on_two_cpu_processes(podman, image):
    out = container(podman, image).stdout
    trained = summary(out)
    assert (trained.epochs, trained.steps, trained.world_size, trained.backend) == (20, 640, 2, "gloo"), out[-3000:]
    losses = epoch_losses(out)
    assert len(losses) == 20 and losses[-1] < losses[0] / 10, losses
    assert "Epoch 19 | Snapshot saved at snapshot.pt" in out


def test_mpirun_trains_inside_the_image(podman, image):
    out = container(podman, image, "mpirun", "-np", "2", "python", "run_with_mpirun.py", "--train",
                    "--total_epochs", "2", "--save_every", "1").stdout
    trained = summary(out)
    assert (trained.epochs, trained.world_size, trained.backend) == (2, 2, "gloo"), out[-3000:]
    assert "Process 1: rank from MPI.COMM_WORLD.Get_rank(), local rank 1 from OMPI_COMM_WORLD_LOCAL_RANK" in out
