"""The benchmarks at smoke-test sizes (--quick): they run under their launchers and write JSON whose
figures are consistent with their own definitions, and a real PNG."""
import json
import sys

import pytest
import torch
from benchmarks import clean_exit, launches
from conftest import REPO, mpi_env, mpirun_cmd, python_cmd, run, torchrun_cmd
from language_model import Decoder, DecoderConfig
from models_and_data import BlockMLP

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_machine(data, backend, world_size):
    machine = data["machine"]
    assert machine["hostname"] and machine["cpu_model"] and machine["cpu_cores"] >= 1
    assert len(machine["load_average_1_5_15min"]) == 3
    assert data["torch"] == torch.__version__
    if backend is not None:
        assert data["backend"] == backend
    if world_size is not None:
        assert data["world_size"] == world_size


def assert_png(path):
    assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 5000


def check_allreduce(path, world_size, mpi):
    data = json.loads(path.read_text())
    assert_machine(data, "gloo", world_size)
    factor = 2 * (world_size - 1) / world_size
    assert data["bus_factor"] == pytest.approx(factor)
    sizes = [row["bytes"] for row in data["results"]]
    assert sizes[0] == 1024 and all(b == 2 * a for a, b in zip(sizes, sizes[1:]))
    for row in data["results"]:
        assert 0 < row["time_s"] < 1
        assert row["algbw_GBps"] == pytest.approx(row["bytes"] / row["time_s"] / 1e9)
        # Physics, not arithmetic: every rank must at least read its buffer and write the result, so an
        # all-reduce cannot move bytes faster than a memory copy of the same bytes on the same machine.
        assert row["algbw_GBps"] < row["copy_GBps"], row
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * factor)
        assert row["copy_GBps"] > 0 and row["tcp_GBps"] > 0
        assert ("mpi_busbw_GBps" in row) == mpi
        if mpi:
            assert row["mpi_busbw_GBps"] == pytest.approx(row["bytes"] / row["mpi_time_s"] / 1e9 * factor)
    return data


def test_allreduce_quick_under_torchrun(tmp_path):
    result = run(torchrun_cmd("benchmarks/allreduce.py", "--quick", "--out", tmp_path), cwd=REPO, timeout=120)
    data = check_allreduce(tmp_path / "allreduce-gloo-n2.json", world_size=2, mpi=False)
    assert data["launcher"] == "torchrun" and [r["bytes"] for r in data["results"]][-1] == 64 * 1024
    assert_png(tmp_path / "allreduce-gloo-n2.png")
    assert "busbw GB/s" in result.stdout and "Peak busbw" in result.stdout


def test_allreduce_under_mpirun_adds_mpi_allreduce(tmp_path):
    run(mpirun_cmd("benchmarks/allreduce.py", "--quick", "--max_size", "4K", "--out", tmp_path), cwd=REPO,
        env=mpi_env(), timeout=120)
    data = check_allreduce(tmp_path / "allreduce-gloo-n2.json", world_size=2, mpi=True)
    assert data["launcher"] == "mpirun" and len(data["results"]) == 3


@pytest.mark.parametrize("args, message", [
    ([], "is started by torchrun"),
    (["--max_size", "3"], "multiple of 4 bytes"),
])
def test_allreduce_bad_input_is_one_line(args, message):
    result = run(python_cmd("benchmarks/allreduce.py", *args), cwd=REPO, check=False, timeout=60)
    assert result.returncode == 2 and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


@pytest.mark.slow
def test_scaling_quick_writes_efficiencies(tmp_path):
    """Plain DDP and DDP with PowerSGD side by side. SimpleCNN has two gradient buckets: torch's PowerSGD hook
    deadlocks gloo's two worker threads when both compress at once, unless benchmarks/comm_hooks.py runs them one
    after the other (a hang fails the launch's timeout)."""
    result = run([sys.executable, REPO / "benchmarks/scaling.py", "--quick", "--world_sizes", "1", "2",
                  "--models", "cnn", "--comm_hook", "none", "powersgd", "--powersgd_warmup", "2", "--out", tmp_path],
                 cwd=REPO, timeout=180)
    data = json.loads((tmp_path / "scaling.json").read_text())
    assert_machine(data, "gloo", None)
    assert data["threads_per_rank"] == 1 and data["world_sizes"] == [1, 2] and data["accuracy_images"] == 200
    rows = {(r["setting"], r["world_size"]): r for r in data["results"]}
    assert set(rows) == {("ddp", 1), ("ddp", 2), ("ddp+powersgd", 1), ("ddp+powersgd", 2)}
    for (setting, n), r in rows.items():
        one = rows[(setting, 1)]
        assert r["ddp_samples_per_s"] > 0 and r["independent_samples_per_s"] > 0
        assert r["scaling_efficiency"] == pytest.approx(r["ddp_samples_per_s"] / (n * one["ddp_samples_per_s"]))
        assert r["ceiling_scaling_efficiency"] == pytest.approx(
            r["independent_samples_per_s"] / (n * one["independent_samples_per_s"]))
        assert r["ddp_vs_ceiling"] == pytest.approx(r["ddp_samples_per_s"] / r["independent_samples_per_s"])
        assert (r["ddp_overhead"] is None) == (n != 1)
        assert 0 <= r["accuracy"] <= 1  # after --quick's 3 steps: only that it was measured
    assert rows[("ddp", 1)]["batch_per_rank"] == 64
    # SimpleCNN's 421,642 fp32 gradients; PowerSGD sends rank-1 factors of the matrices and the vectors whole.
    assert rows[("ddp", 2)]["bytes_per_step"] == 421_642 * 4
    assert 0 < rows[("ddp+powersgd", 2)]["bytes_per_step"] < rows[("ddp", 2)]["bytes_per_step"] / 10
    targets = {t["target"]: t for t in data["targets"]}
    assert len(targets) == 3 and all(isinstance(t["pass"], bool) for t in targets.values())
    for t in targets.values():
        assert ("PASS" if t["pass"] else "MISS") + ": " + t["target"] in result.stdout
    assert_png(tmp_path / "scaling.png")
    assert_png(tmp_path / "scaling-comm.png")


def test_startup_times_a_script_to_its_first_epoch(tmp_path):
    run([sys.executable, REPO / "benchmarks/startup.py", "--scripts", "singlegpu.py", "--repeats", "1",
         "--out", tmp_path], cwd=REPO, timeout=120)
    (row,) = json.loads((tmp_path / "startup.json").read_text())["results"]
    assert row["status"] in ("PASS", "MISS") and 0 < row["first_step_s"] < row["exit_s"]
    assert row["status"] == ("PASS" if row["first_step_s"] <= 5 else "MISS")


@pytest.mark.slow  # one real launch; the test below counts over repeats without launching
def test_clean_exit_counts_clean_runs(tmp_path):
    run([sys.executable, REPO / "benchmarks/clean_exit.py", "--jobs", "run_with_python.py", "--repeats", "1",
         "--out", tmp_path], cwd=REPO, timeout=180)
    data = json.loads((tmp_path / "clean_exit.json").read_text())
    assert data["total"] == {"launches": 1, "clean": 1, "aborted": 0, "hung": 0, "failed": 0}
    assert_machine(data, None, None)


def test_clean_exit_tells_an_abort_after_a_good_exit_code_from_a_clean_run(monkeypatch):
    """What torchrun does with a worker that aborts after the summary line: exit code 0, the text says it."""
    fake = [sys.executable, "-c", "print('Summary: done'); print('terminate called without an active exception')"]
    monkeypatch.setitem(launches.LAUNCHES, "aborts.py", (lambda script: fake, "", ""))
    row = clean_exit.stress("aborts.py", repeats=2, timeout=60)
    assert (row["launches"], row["clean"], row["aborted"]) == (2, 0, 2)
    assert row["failures"][0]["exit_code"] == 0 and row["failures"][0]["markers"] == ["terminate called"]


@pytest.mark.slow
def test_diagnose_cost_pairs_each_job_with_and_without_the_prefix(tmp_path):
    run([sys.executable, REPO / "benchmarks" / "diagnose_cost.py", "--quick", "--jobs", "step3", "--out", tmp_path],
        cwd=REPO, timeout=600)  # train.py's pair launches the same way
    data = json.loads((tmp_path / "diagnose_cost.json").read_text())
    assert data["machine"]["torch"] == torch.__version__ and data["quick"] and data["repeats"] == 1
    assert data["processes"] == data["machine"]["world_size"] == 1  # --quick: one process a launch
    assert [row["job"].split()[0] for row in data["rows"]] == ["multigpu_torchrun.py"]
    for row in data["rows"]:
        (without, with_tool), = row["pairs"]
        assert without > 0 and with_tool > 0
        assert row["ratio_median"] == pytest.approx(with_tool / without)


@pytest.mark.slow
def test_restart_store_counts_each_way_and_the_group_store_uses_its_restarts(tmp_path):
    """One job each way: the counts add up, and with the group's own store (what the torchrun examples do) or
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 the job gets through its restart (plain may or may not). One crash, one
    restart (--crashes 1): the crashed attempt leaves its keys in torchrun's store as each of the 3 by default does."""
    run([sys.executable, REPO / "benchmarks" / "restart_store.py", "--jobs", "1", "--crashes", "1", "--job_timeout",
         "40", "--out", tmp_path], cwd=REPO, timeout=300)
    data = json.loads((tmp_path / "restart_store.json").read_text())
    results = data["results"]
    assert set(results) == {"plain", "group_store", "env"} and data["crashes"] == 1
    for way in results.values():
        assert way["finished"] + way["burned"] + way["hung"] == 1
    assert results["group_store"]["finished"] == 1 and results["env"]["finished"] == 1, results
    for way in ("group_store", "env"):  # both ranks started in the first attempt and in the restart
        assert sorted(results[way]["runs"][0]["starts"]) == ["0:0", "0:1", "1:0", "1:1"], results[way]


def test_fsdp_memory_measures_the_meta_build_below_the_full_model(tmp_path):
    """fsdp.py's build from the meta device: each rank's peak is its shard and one layer in full, below the full
    model's parameters; building the full model first peaks above them. Measured (peak RSS), at a width where the
    parameters (32 MiB) dwarf the allocator's noise."""
    result = run([sys.executable, REPO / "benchmarks/fsdp_memory.py", "--width", "512", "--out", tmp_path], cwd=REPO,
                 timeout=240)
    data = json.loads((tmp_path / "fsdp_memory.json").read_text())
    full = data["full_bytes"]
    assert full == 4 * sum(p.numel() for p in BlockMLP(20, 512, 2048, 4).parameters())
    for meta, first in zip(data["results"]["meta"], data["results"]["full"]):
        assert meta["shard_bytes"] < 0.51 * full
        assert meta["shard_bytes"] < meta["peak_bytes"] < 0.8 * full, meta
        assert first["peak_bytes"] > full, first
    assert "Rank 1: peak 0." in result.stdout


def test_checkpoint_sums_times_saves_and_loads_with_and_without_them(tmp_path):
    """fsdp.py's model, small: each way saved and loaded (from the page cache and from disk), the checkpoints of
    both the same files (the ranks' files of sums gathered into the marker and gone), every candidate sum timed."""
    result = run([sys.executable, REPO / "benchmarks/checkpoint_sums.py", "--width", "128", "--repeats", "1", "--dir",
                  tmp_path, "--out", tmp_path], cwd=REPO, timeout=240)
    data = json.loads((tmp_path / "checkpoint_sums.json").read_text())
    assert data["full_bytes"] == 4 * sum(p.numel() for p in BlockMLP(20, 128, 512, 4).parameters())
    assert sorted(row["way"] for row in data["results"]) == ["with", "without"]
    for row in data["results"]:
        assert min(row["save_s"], row["load_cached_s"], row["load_from_disk_s"]) > 0, row
        assert 2 * data["full_bytes"] < row["checkpoint_bytes"] < 2.2 * data["full_bytes"], "weights and momentum"
    sizes = [data["medians"][way]["checkpoint_bytes"] for way in ("with", "without")]
    assert abs(sizes[0] - sizes[1]) < 100, sizes  # .metadata names the folder: a few bytes apart
    assert sorted(data["digest_GBps"]) == ["hashlib.blake2b", "hashlib.md5", "hashlib.sha1", "hashlib.sha256",
                                           "zlib.adler32", "zlib.crc32"]
    assert min(data["digest_GBps"].values()) > 0 and "without sums" in result.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint_sums.json"], "the checkpoints removed"


def check_parallel_bytes(data):
    """Every layout's counted bytes against its own formula and mesh: never below the formula (the bytes must
    cross), at most 5% above (gloo's headers); the ranks of one pipeline stage send the same bytes (to 1%: gloo's
    headers differ by a few bytes); nothing sent between steps, nor to the store; each rank sends only to ranks
    that share a group with it (one mesh coordinate apart; pipeline stages to their neighbours). The speed: each
    layout's tokens/s from its median step and its Summary line, its model-FLOPs utilization against the
    machine's matmul peak (6 x parameters + 12 x layers x seq x dim a token), and nd_parallel.py on one process
    against the plain loop."""
    assert data["backend"] == "gloo" and data["machine"]["cpu_cores"] >= 1
    for n, factors in data["collectives"].items():  # gloo's own, counted: ring all-reduce and all-gather
        n = int(n)
        assert factors["all_reduce"] == pytest.approx(2 * (n - 1) / n, rel=0.01)
        assert factors["all_gather_into_tensor"] == pytest.approx((n - 1) / n, rel=0.01)
        assert factors["reduce_scatter_tensor"] == pytest.approx(2 * (n - 1) / n, rel=0.01)  # as an all-reduce
    model = data["model"]
    config = DecoderConfig(**{key: value for key, value in model.items() if key != "parameters"})
    assert model["parameters"] == sum(p.numel() for p in Decoder(config).parameters())
    assert data["flops_per_token"] == 6 * model["parameters"] + 12 * config.n_layers * config.max_seq_len * config.dim
    peak = data["matmul_peak"]
    assert peak["flops"] == max(peak["threads"] * peak["one_thread_flops"], peak["all_threads_flops"]) > 1e8
    assert [peak["one_thread_flops"], peak["all_threads_flops"]] == [max(column) for column in zip(*peak["measured"])]
    tokens = data["global_batch_size"] * config.max_seq_len  # a step's
    single = data["one_process"]
    for layout in [*data["results"], single]:
        assert layout["tokens_per_s_steps"] == pytest.approx(tokens / layout["step_s"])
        assert layout["mfu"] == pytest.approx(layout["tokens_per_s_steps"] * data["flops_per_token"] / peak["flops"])
        assert 0 < layout["mfu"] < 1 and layout["tokens_per_s_summary"] > 0
        assert layout["steps_counted"] == data["steps"] - data["warmup_steps"]
    for summary in [layout["summary"] for layout in data["results"]] + single["summaries"]:
        assert summary.startswith("Summary: epochs 1 | steps ") and f"| steps {data['steps']} |" in summary
    assert len(single["summaries"]) == len(single["plain_run_medians_s"]) == single["repeats"]
    assert single["cost"] == pytest.approx(single["step_s"] / single["plain_step_s"] - 1)
    for layout in data["results"]:
        mesh = layout["mesh"]
        sizes = [mesh[name] for name in ("pp", "dp_replicate", "dp_shard", "tp")]
        assert layout["processes"] == sizes[0] * sizes[1] * sizes[2] * sizes[3]
        assert 0 < layout["step_s"] < 10

        def coordinates(rank):
            found = []
            for size in reversed(sizes):
                rank, position = divmod(rank, size)
                found.insert(0, position)
            return found

        for row in layout["ranks"]:
            assert row["formula_bytes"] == sum(row["formula"].values())
            assert row["ratio"] == pytest.approx(row["bytes_per_step"] / row["formula_bytes"])
            assert 1.0 <= row["ratio"] <= 1.05, (layout["layout"], row)
            assert row["between_steps"] == 0 and "store or agent" not in row["to"], row
            assert sum(row["to"].values()) == pytest.approx(row["bytes_per_step"])
            here = coordinates(row["rank"])
            for peer in map(int, row["to"]):
                there = coordinates(peer)
                apart = [i for i in range(4) if here[i] != there[i]]
                assert len(apart) == 1 and (apart != [0] or abs(here[0] - there[0]) == 1), (layout["layout"], row)
        stages = {}
        for row in layout["ranks"]:
            stages.setdefault(coordinates(row["rank"])[0], set()).add(row["bytes_per_step"])
        assert all(max(sent) < 1.01 * min(sent) for sent in stages.values()), (layout["layout"], stages)


def test_parallel_bytes_counts_what_the_formula_says(tmp_path):
    """benchmarks/parallel_bytes.py --quick: the 2-process layouts (DDP-like, FSDP2, TP, PP, a V-shaped PP) of
    the decoder, 4 steps each, each rank's TCP bytes counted by the kernel against the formula, which is checked
    against the model here: DDP-like sends the gradients' bytes, FSDP2 twice that (each layer gathered forward and
    backward, the gradients reduce-scattered); TP per layer 4 all-gathers and 4 reduce-scatters of a [batch, seq,
    dim] activation, 2 more of each for the embedding and lm_head, 3 all-reduces of one number a token for the
    loss and one of each norm's weight gradient; PP one batch of activations each way, V-shaped
    twice that (each rank runs two stages, both with a neighbour on the other rank)."""
    result = run([sys.executable, REPO / "benchmarks/parallel_bytes.py", "--quick", "--out", tmp_path], cwd=REPO,
                 timeout=420)
    data = json.loads((tmp_path / "parallel_bytes.json").read_text())
    assert_machine(data, "gloo", None)
    assert data["quick"] and data["steps"] == 4
    check_parallel_bytes(data)
    config = DecoderConfig(dim=32, n_layers=4, n_heads=8, n_kv_heads=4, hidden=64, max_seq_len=16)
    whole = 4 * sum(p.numel() for p in Decoder(config).parameters())
    batch, layers = data["global_batch_size"], config.n_layers
    activation = 4 * batch * config.max_seq_len * config.dim  # [batch, seq, dim] in float32; at 2 ranks a ring
    tp = ((4 * layers + 2) * (activation / 2 + activation)  # all-gather sends half of it, gloo's reduce-scatter all
          + 3 * 4 * batch * config.max_seq_len + (2 * layers + 1) * 4 * config.dim)
    expected = {"DDP-like 2": whole, "FSDP2 2": 2 * whole, "TP 2": tp, "PP 2": activation,
                "PP 2, V (zbv)": 2 * activation}
    assert [layout["layout"] for layout in data["results"]] == list(expected)
    for layout in data["results"]:
        for row in layout["ranks"]:
            assert row["formula_bytes"] == pytest.approx(expected[layout["layout"]], abs=2), row
            assert list(row["to"]) == [str(1 - row["rank"])]
    assert_png(tmp_path / "parallel_bytes.png")
    assert "bytes sent/step" in result.stdout and "measured/formula" in result.stdout
    assert "MFU" in result.stdout and "One process: nd_parallel.py" in result.stdout


def test_parallel_bytes_results_agree_with_their_formulas():
    """The committed run of every layout (2, 4 and 8 processes, and one): the same checks, on what it measured."""
    data = json.loads((REPO / "benchmarks/results/parallel_bytes.json").read_text())
    assert not data["quick"] and {layout["processes"] for layout in data["results"]} == {2, 4, 8}
    check_parallel_bytes(data)
