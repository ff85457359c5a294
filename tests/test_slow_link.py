"""Training across a slow link (diloco.py, launch/two_sites.py, benchmarks/slow_link.py): a real torchft_lighthouse
and real torchrun replica groups. DiLoCo's outer step equals a hand computation from the groups' own inner steps
(the pseudo-gradient averaged, Nesterov applied). Where the machine allows network namespaces and tc (root; CI):
two sites behind a shaped veth pair, one SIGKILLed mid-sync: the other discards that round alone and syncs on,
the dead one started again resumes from its snapshot, heals and rejoins, both end bitwise equal; the bytes are
counted on the veth. Bad input, a site with another model and no lighthouse: one line.
"""
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from conftest import (BIN, REPO, assert_bitwise_equal, assert_one_line_error, clean_env, finish, forked,
                      free_port, listening, load_snapshot, python_cmd, run, start, torchrun_cmd)

SYNC = re.compile(r"^(?:\[site (\d)\] )?Sync (\d+) \| step (\d+) \| groups (\d+) \| sent (\d+) B \| loss ([\d.]+)$",
                  re.M)


def start_lighthouse(min_replicas):
    port = free_port()
    process = start([BIN / "torchft_lighthouse", "--bind", f"127.0.0.1:{port}", "--min_replicas", min_replicas,
                     "--join_timeout_ms", "1000", "--heartbeat_timeout_ms", "2000"], cwd=REPO,
                    env=clean_env(RUST_LOG="warn"))
    deadline = time.monotonic() + 30
    while not listening(port):
        assert process.poll() is None and time.monotonic() < deadline, process.stdout.read()
        time.sleep(0.05)
    return process, f"http://127.0.0.1:{port}"


def group(tmp_path, lighthouse, replica_id, *args):
    return start(torchrun_cmd("diloco.py", "--replica_id", replica_id, "--lighthouse", lighthouse,
                              "--snapshot_path", tmp_path / f"group{replica_id}.pt", *args, nproc=1), cwd=tmp_path,
                 env=clean_env(OMP_NUM_THREADS=1))


def namespaces_allowed():
    """Why network namespaces cannot be made here, or None where they can."""
    if sys.platform != "linux" or os.geteuid() != 0:
        return "network namespaces and tc need Linux and root (CI runs as root)"
    name = f"ddpprobe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    return None if shutil.which("tc") else "tc (iproute2) is not installed"


BAD_FLAGS = [
    (["--sync_every", "0"], "--sync_every must be at least 1"),
    (["--fragments", "3"], "--fragments 3 does not divide the model's 4 blocks"),
    (["--quantize"], "--quantize needs a CUDA GPU and triton"),
]


@pytest.fixture(scope="module")
def said(tmp_path_factory):
    """Each bad command line of diloco.py in a process forked from one that imported torch once
    (conftest.forked), one process for all; the tests that read it kept on one worker."""
    return forked([["diloco.py", ["--replica_id", "0", *args], None] for args, _ in BAD_FLAGS],
                       cwd=tmp_path_factory.mktemp("one-line"))


@pytest.mark.xdist_group("test_slow_link_bad_flags")
@pytest.mark.parametrize("case", range(len(BAD_FLAGS)), ids=[message for _, message in BAD_FLAGS])
def test_bad_flags_are_one_line(said, case):
    assert_one_line_error(said[case], BAD_FLAGS[case][1])


def test_no_lighthouse_is_one_line_within_seconds(tmp_path):
    began = time.monotonic()
    result = run(torchrun_cmd("diloco.py", "--replica_id", "0", "--lighthouse", f"http://127.0.0.1:{free_port()}",
                              "--timeout", "2", nproc=1), cwd=tmp_path, timeout=60, check=False)
    assert_one_line_error(result, "no lighthouse answers at http://127.0.0.1:", "--lighthouse", code=1)
    assert time.monotonic() - began < 40


def test_diloco_outer_step_is_nesterov_on_the_averaged_pseudo_gradient(tmp_path):
    """Two groups, a tiny model, two rounds of 5 steps. At the first sync one group takes the other's weights
    (torchft's init_sync), so the first pseudo-gradient is that group's alone; the second is the mean of both.
    Each group's inner steps are done again here, and the outer step computed by hand."""
    import diloco
    from models_and_data import BlockMLP, regression_dataset

    lr, outer_lr, momentum, h = 0.05, 0.7, 0.9, 5
    flags = ["--algorithm", "diloco", "--sync_every", h, "--steps", 2 * h, "--width", 4, "--hidden", 8, "--depth",
             2, "--lr", lr, "--outer_lr", outer_lr, "--outer_momentum", momentum]
    process, lighthouse = start_lighthouse(2)  # the first sync waits for both groups
    try:
        groups = [group(tmp_path, lighthouse, i, *flags) for i in (0, 1)]
        outputs = [finish(g, 120) for g in groups]
    finally:
        process.kill()
        process.communicate()
    assert [g.returncode for g in groups] == [0, 0], outputs
    healed = [i for i, out in enumerate(outputs) if "Healed from a live group: at sync 0 now (was 0)" in out]
    assert len(healed) == 1, outputs
    source = 1 - healed[0]

    torch.manual_seed(0)
    model = BlockMLP(width=4, hidden=8, depth=2)
    dataset = regression_dataset(seed=0)
    theta0 = [p.detach().clone() for p in model.parameters()]

    def inner(start, weights, optimizer_state, replica):
        """The group's own inner steps: SGD with momentum from `weights`, on its batches of steps start..start+h."""
        local = BlockMLP(width=4, hidden=8, depth=2)
        with torch.no_grad():
            for p, w in zip(local.parameters(), weights):
                p.copy_(w)
        optimizer = torch.optim.SGD(local.parameters(), lr=lr, momentum=0.9)
        if optimizer_state is not None:
            optimizer.load_state_dict(copy.deepcopy(optimizer_state))  # SGD steps the loaded buffers in place
        sampler = diloco.StepSampler(len(dataset), replica, 2, 32, 0)
        for step in range(start, start + h):
            x, y = dataset[sampler.indices(step)]
            optimizer.zero_grad()
            F.mse_loss(local(x), y).backward()
            optimizer.step()
        return [p.detach().clone() for p in local.parameters()], optimizer.state_dict()

    # Round 1: the source group's pseudo-gradient (the healed group sends the same one).
    local, state = inner(0, theta0, None, source)
    delta1 = [a - b for a, b in zip(theta0, local)]
    buffer1 = delta1  # torch's SGD: the first momentum buffer is the gradient itself
    theta1 = [t - outer_lr * (d + momentum * b) for t, d, b in zip(theta0, delta1, buffer1)]  # Nesterov
    # Round 2: both groups from theta1 with the source's momentum; their pseudo-gradients averaged.
    locals_ = [inner(h, theta1, state, replica)[0] for replica in (0, 1)]
    delta2 = [(2 * t - a - b) / 2 for t, a, b in zip(theta1, *locals_)]
    buffer2 = [momentum * b + d for b, d in zip(buffer1, delta2)]
    theta2 = [t - outer_lr * (d + momentum * b) for t, d, b in zip(theta1, delta2, buffer2)]

    plain = [(a + b) / 2 for a, b in zip(*locals_)]  # what averaging the weights (LocalSGD) would give
    for i in (0, 1):
        snapshot = load_snapshot(tmp_path / f"group{i}.pt")
        assert snapshot["torchft"]["step"] == 2
        weights = list(snapshot["user"]["default"]["model"].values())
        outer = snapshot["user"]["StreamingDiLoCoFragment_0"]
        for got, want, kept in zip(weights, theta2, outer["original_parameters"].values()):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(kept, want, rtol=1e-5, atol=1e-6)  # the weights of the last sync, kept
        assert max((w - p).abs().max() for w, p in zip(weights, plain)) > 1e-3, "Nesterov moved it past the mean"
        for buf, want in zip(outer["outer_optimizer"]["state"].values(), buffer2):
            torch.testing.assert_close(buf["momentum_buffer"], want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # some 30 s: two groups that must start and meet at their first sync
def test_a_site_with_another_model_is_one_line(tmp_path):
    # --min_replicas 2: the first sync waits for both. (With 1, a group whose syncs never coincide with the
    # other's may form quorums of its own, and never meet it: torchft's lighthouse lets the two alternate.)
    process, lighthouse = start_lighthouse(2)
    try:
        running = group(tmp_path, lighthouse, 0, "--steps", "100", "--sync_every", "10", "--timeout", "60")
        began = time.monotonic()
        result = run(torchrun_cmd("diloco.py", "--replica_id", "1", "--lighthouse", lighthouse, "--hidden", "128",
                                  "--sync_every", "10", "--snapshot_path", tmp_path / "misfit.pt", nproc=1),
                     cwd=tmp_path, timeout=90, check=False, env=clean_env(OMP_NUM_THREADS=1))
        assert_one_line_error(result, "this group's settings do not fit the running groups'", "--hidden 128",
                              "theirs: --algorithm diloco --sync_every 10 --fragments 1 --width 64 --hidden 256",
                              code=1)
        assert time.monotonic() - began < 60
        assert running.poll() is None, "the running group waits for a quorum"
        running.kill()
        finish(running, 30)
    finally:
        process.kill()
        process.communicate()


@pytest.mark.slow  # about a minute: the killed site's restart must come while the other still trains
def test_two_sites_over_a_shaped_link_a_killed_site_costs_one_round_and_rejoins(tmp_path):
    why = namespaces_allowed()
    if why:
        pytest.skip(why)
    # 35,329 parameters (141 KB a sync) at 2 Mbit/s: a sync takes some 0.6 s, and the kill lands in one (the
    # helper slows the link from site 1's sync 3 to the kill: the sync cannot end before it, however late it comes).
    # Both sites' groups wait after their imports until both have come that far (the probe's DDP_EXAMPLES_HOLD, in
    # tests/support): else one that started
    # seconds later on a busy machine finds the other synced alone past sync 3 (--min_replicas 1).
    (tmp_path / "hold").mkdir()
    hold = {"DDP_EXAMPLES_HOLD": f"torchft:{tmp_path / 'hold'}:2"}
    result = run(python_cmd("launch/two_sites.py", "--rate", "2mbit", "--min_replicas", "1", "--kill_site", "1",
                            "--kill_after_sync", "3", "--mid_sync", "--restart_after", "0", "--",
                            "--sync_every", "10", "--steps", "400", "--hidden", "64", "--step_delay", "0.1",
                            "--save_every", "2", "--timeout", "20"),
                 cwd=tmp_path, timeout=240, env=clean_env(OMP_NUM_THREADS=1, **hold))
    out = result.stdout
    names = re.search(r"^Sites: (\S+) 10\.214\.\d+\.1 \(lighthouse\) \| (\S+) ", out, re.M)
    assert names, out[-3000:]
    assert not set(names.groups()) & set(subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                         text=True).stdout.split()), "namespaces torn down"
    assert "Killed site 1 (SIGKILL) after its sync 3" in out
    site0 = [(int(m[2]), int(m[3]), int(m[4])) for m in SYNC.finditer(out) if m[1] == "0"]
    # Every sync committed once, in order (from the first, or from where site 0 healed if site 1 synced alone
    # before site 0 was up); the round the kill interrupted was trained again, alone.
    committed = [s for s, _, _ in site0]
    assert committed[0] <= 3 and committed == list(range(committed[0], 41)), out[-3000:]
    assert re.search(r"^\[site 0\] Sync 4 \| not committed \(a group was lost\): weights put back as at the last "
                     r"sync, steps 31-40 trained again$", out, re.M), out[-4000:]
    assert len(re.findall(r"^\[site 0\] Sync \d+ \| not committed", out, re.M)) == 1, out[-4000:]
    groups = {s: g for s, _, g in site0}
    assert groups[3] == 2 and groups[4] == 1 and groups[40] == 2, out[-4000:]
    # The site started again resumed from its snapshot of sync 2, then healed from site 0.
    restart = out.split("Killed site 1")[1]
    assert "[site 1] Resuming from site1.pt at sync 2 (step 20)" in restart, restart[:3000]
    healed = int(re.search(r"^\[site 1\] Healed from a live group: at sync (\d+) now \(was 2\)$", restart, re.M)[1])
    assert 4 <= healed < 40
    summaries = re.findall(r"^\[site (\d)\] Summary: steps 400 \| syncs 40 \|.*final loss ([\d.]+) \|", out, re.M)
    assert len(summaries) == 2 and summaries[0][1] == summaries[1][1], out[-2000:]
    a, b = load_snapshot(tmp_path / "site0.pt"), load_snapshot(tmp_path / "site1.pt")
    assert a["torchft"]["step"] == b["torchft"]["step"] == 40
    assert_bitwise_equal(a["user"]["default"]["model"], b["user"]["default"]["model"], "model")
    assert_bitwise_equal(a["user"]["StreamingDiLoCoFragment_0"], b["user"]["StreamingDiLoCoFragment_0"], "outer")
    # Counted on the veth: site 0 sent at least its share of every two-site sync (2 ranks: the whole payload).
    link = re.search(r"^Link: 2mbit \| site 0 to 1 ([\d.]+) MB \| site 1 to 0 ([\d.]+) MB", out, re.M)
    payload = int(next(m[5] for m in SYNC.finditer(out)))
    assert payload == 35_329 * 4
    together = sum(1 for _, _, g in site0 if g == 2)
    assert float(link[1]) * 1e6 > 0.9 * together * payload, (link[0], together)


@pytest.mark.slow  # a minute or more: four launches of two sites
def test_the_benchmark_quick_mode_counts_the_link(tmp_path):
    why = namespaces_allowed()
    if why:
        pytest.skip(why)
    result = run(python_cmd("benchmarks/slow_link.py", "--quick", "--out", tmp_path), cwd=REPO, timeout=400)
    data = json.loads((tmp_path / "slow_link.json").read_text())
    assert data["benchmark"] == "slow_link" and data["steps"] == 40 and data["torch"] == torch.__version__
    rows = {r["way"]: r for r in data["results"]}
    assert set(rows) == {"ddp", "diloco-h10"} and all(r["rate"] == "20mbit" for r in rows.values())
    payload = 134_401 * 4
    for way, syncs in (("ddp", 40), ("diloco-h10", 4)):
        r = rows[way]
        assert r["syncs"] == syncs and r["final_losses_equal"]
        # Both directions of the veth carried at least the all-reduces (2 ranks: each sends the payload).
        assert r["link_bytes"] >= 2 * syncs * payload * 0.95, r["link_bytes"]
        assert [p["step"] for p in r["curve"]][-1] == 40
        assert all(a["link_bytes"] <= b["link_bytes"] for a, b in zip(r["curve"], r["curve"][1:]))
    assert rows["diloco-h10"]["link_bytes"] < rows["ddp"]["link_bytes"] / 5
    assert (tmp_path / "slow_link.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "loss at T" in result.stdout
