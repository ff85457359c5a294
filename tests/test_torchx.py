"""The examples under torchx 0.7.0's `dist.ddp` component on its `local_cwd` scheduler: the real `torchx run` in a
subprocess. Every rank takes part (the summary's world size is 2) and a second submission resumes from the
first's snapshot: multinode.py first as two nodes of one (`-j 2x1`), two torchrun agents that meet on
`--rdzv_port`, then as one node of two (`-j 1x2`). dist.ddp starts torchrun, which runs every other script
elsewhere: multinode.py is step 3 (multigpu_torchrun.py) plus its node-local snapshots, so step 3 needs no
submission of its own, and train.py under torchrun (test_train_hf.py: both ranks, weights identical, the steps
saved) needs none either: what torchx adds, its command line for torchrun, is the same for every script.

torchx 0.7.0 pins urllib3<1.27 (this repository's 2.x would go back to 1.26), so it is not in
requirements-dev.txt: the tests install it into a venv of its own under ~/.cache, which sees this python's
packages (torch among them) and checks that pip brought no torch of its own.
"""
import fcntl
import hashlib
import json
import os
import re
import shutil
import site
import sys
from pathlib import Path

import pytest
import torch

from conftest import BIN, REPO, clean_env, epoch_lines, free_port, run, summary

pytestmark = pytest.mark.slow  # about a minute: two submissions, each starting torchx and torchrun

TORCHX = "torchx==0.7.0"
# dist.ddp's command is the bare word `torchrun`, found on PATH: this python's (the venv has no torchrun).
ENV = clean_env(OMP_NUM_THREADS=1, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
# Which torch the venv's `import torch` would load, and that file's version (what torch/__init__.py imports as
# __version__), found without importing torch there: that import alone costs 2.5 CPU-s.
VENV_INFO = ("import importlib.util, json, pathlib, runpy, sysconfig, torchx; "
             "torch = pathlib.Path(importlib.util.find_spec('torch').origin); "
             "print(json.dumps(dict(torch=str(torch), torch_version=runpy.run_path(torch.parent / 'version.py')"
             "['__version__'], torchx=torchx.__version__, site=sysconfig.get_path('purelib'))))")


@pytest.fixture(scope="session")
def torchx():
    """The torchx executable of a venv built once per python and torch, kept between sessions."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ddp-examples"
    venv = cache / f"torchx-0.7.0-{hashlib.sha256(f'{sys.executable} {torch.__version__}'.encode()).hexdigest()[:12]}"
    python = venv / "bin" / "python"
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # pytest-xdist's workers: one builds, the others wait for it
        if not (venv / "ready").exists():
            shutil.rmtree(venv, ignore_errors=True)
            run([sys.executable, "-m", "venv", "--system-site-packages", venv], cwd=cache)
            # --system-site-packages sees the base python's packages only: where this python is itself a venv,
            # torch sits in this venv's site-packages, which the .pth adds.
            purelib = run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=cache)
            Path(purelib.stdout.strip(), "ddp_examples_parent.pth").write_text("\n".join(site.getsitepackages()) + "\n")
            run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", TORCHX], cwd=cache, timeout=600)
            (venv / "ready").touch()
    info = json.loads(run([python, "-c", VENV_INFO], cwd=cache).stdout)
    assert info["torchx"] == "0.7.0", info
    assert (Path(info["torch"]) == Path(torch.__file__) and info["torch_version"] == torch.__version__), \
        f"the torchx venv imports another torch: {info}"
    assert not list(Path(info["site"]).glob("torch-*")), f"pip installed a torch of its own into {info['site']}"
    return venv / "bin" / "torchx"


def submit(torchx, tmp_path, script, *args, nodes="1x2", timeout=180):
    """`torchx run` of dist.ddp; the ranks' lines, without torchx's prefixes. The script's own options follow
    `--`, or torchx takes them for dist.ddp's. With one node, dist.ddp ignores --rdzv_port (torchrun's store
    takes a free port); with several, it is 29500 unless given."""
    cmd = [torchx, "run", "-s", "local_cwd", "-cfg", f"log_dir={tmp_path / 'torchx_logs'}", "dist.ddp",
           "-j", nodes, "--rdzv_port", free_port(), "--script", REPO / script, "--", *args]
    stderr = run(cmd, cwd=tmp_path, env=ENV, timeout=timeout).stderr
    # torchx prints each node's output on its stderr as `<script stem>/<node> [<local rank>]:<line>`.
    lines = re.findall(rf"^{re.escape(Path(script).stem)}/\d+ \[\d+\]:(.*)$", stderr, re.MULTILINE)
    assert lines, stderr[-3000:]
    return "\n".join(lines)


def test_multinode_trains_on_every_rank_of_two_nodes_and_resumes_on_one_node_of_two_under_torchx(torchx, tmp_path):
    # local_cwd runs in the submitting folder; an explicit path keeps the snapshot where the next job looks.
    snapshot = tmp_path / "snapshot.pt"
    out = submit(torchx, tmp_path, "multinode.py", "2", "1", "--snapshot_path", snapshot, nodes="2x1")
    assert summary(out).world_size == 2 and [line.epoch for line in epoch_lines(out)] == [0, 1], out[-3000:]
    assert snapshot.exists(), out[-3000:]
    out = submit(torchx, tmp_path, "multinode.py", "4", "1", "--snapshot_path", snapshot, nodes="1x2")
    assert f"Resuming from {snapshot}" in out and [line.epoch for line in epoch_lines(out)] == [2, 3], out[-3000:]
    assert summary(out).world_size == 2, out[-3000:]

