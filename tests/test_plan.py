"""plan.py, the planner: its bytes a step against the sockets' counts of real runs (benchmarks/parallel_bytes.py,
the same model, batch and layouts), and a bad layout in one line before any work."""
import json
from types import SimpleNamespace

import pytest

from conftest import REPO, forked

MODEL = "--dim 32 --n_layers 4 --n_heads 8 --n_kv_heads 4 --hidden 64 --seq_len 16 --global_batch_size 64"
# (parallel_bytes.py's layout name, the planner's flags, processes, the ranks to trace: one a pipeline stage).
LAYOUTS = [
    ("FSDP2 2", "--dp_shard 2", 2, [0]),
    ("TP 2", "--tp 2", 2, [0]),
    ("FSDP2 x TP 2x2", "--dp_shard 2 --tp 2", 4, [0]),
    ("HSDP 2x2", "--dp_replicate 2 --dp_shard 2", 4, [0]),
    ("3-D 2x2x2", "--dp_shard 2 --tp 2 --pp 2", 8, [0, 4]),
]


@pytest.fixture(scope="module")
def quick_runs():
    """The quick tests' one process: tests/support/plan_traffic.py on LAYOUTS, then plan.py on each of
    BAD_LAYOUTS."""
    return forked([["tests/support/plan_traffic.py", [json.dumps(LAYOUTS), MODEL], None],
                   *(["plan.py", flags.split(), None] for flags, _ in BAD_LAYOUTS)], cwd=REPO, timeout=900)


@pytest.fixture(scope="module")
def planned(quick_runs):
    """The planner's bytes a step of each layout's traced ranks, gloo's count (and its peak memory)."""
    done = quick_runs[0]
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def stage_of(rank, world_size, flags):
    pp = 2 if "--pp 2" in flags else 1
    return rank // (world_size // pp)


def compare(planned, results):
    """Every rank's counted bytes a step within 2% of the planner's for its stage; its peak memory, where the run
    measured it, within 15%."""
    by_name = {result["layout"]: result for result in results}
    for name, flags, world_size, traced in LAYOUTS:
        if name not in by_name:
            continue
        for row in by_name[name]["ranks"]:
            rank = next(r for r in traced if stage_of(r, world_size, flags) == stage_of(row["rank"], world_size,
                                                                                            flags))
            plan_bytes, plan_peak = planned[f"{name} {rank}"]
            assert row["bytes_per_step"] == pytest.approx(plan_bytes, rel=0.02), (name, row["rank"], plan_bytes)
            if row.get("peak_bytes") is not None:
                assert row["peak_bytes"] == pytest.approx(plan_peak, rel=0.15), (name, row["rank"], plan_peak)


@pytest.mark.quick
def test_plan_matches_the_recorded_counts(planned):
    """Against benchmarks/results/parallel_bytes.json, the counts of the recorded real runs."""
    data = json.loads((REPO / "benchmarks/results/parallel_bytes.json").read_text())
    assert data["global_batch_size"] == 64 and data["model"]["dim"] == 32 and data["model"]["max_seq_len"] == 16
    compare(planned, data["results"])
    assert sum(name in {r["layout"] for r in data["results"]} for name, *_ in LAYOUTS) == len(LAYOUTS)


@pytest.mark.slow
def test_plan_matches_real_runs(planned, tmp_path):
    """The same layouts run now, one torchrun job per world size (2, 4 and 8 processes), bytes counted on the
    sockets by benchmarks/parallel_bytes.py's worker: within 2% of the planner's, every rank."""
    from benchmarks import parallel_bytes
    args = SimpleNamespace(steps=3, global_batch_size=64, timeout=900)
    data = tmp_path / "text.txt"
    parallel_bytes.text_file(data, args.steps, args.global_batch_size, parallel_bytes.CONFIG.max_seq_len)
    (tmp_path / "worker.py").write_text(parallel_bytes.WORKER.format(repo=str(REPO)))
    wanted = {name for name, *_ in LAYOUTS}
    results = []
    for world_size in (2, 4, 8):
        layouts = [layout for layout in parallel_bytes.LAYOUTS if layout[0] in wanted and layout[1] == world_size]
        found, _ = parallel_bytes.run_world(world_size, layouts, args, tmp_path, data)
        results += found
    assert {r["layout"] for r in results} == wanted
    compare(planned, results)


BAD_LAYOUTS = [
    ("--world_size 6 --tp 4", "--dp_replicate 1 x --tp 4 x --pp 1 = 4 does not divide --world_size 6"),
    ("--world_size 16 --tp 16", "tp 16 does not divide --n_heads (4)"),
    ("--world_size 8 --pp 8", "8 stages (--pp 8, schedule 1f1b) are more than the 4 layers"),
    ("--world_size 8192 --model llama3-70b --tp 16", "tp 16 does not divide --n_kv_heads (8)"),
]


@pytest.fixture(scope="module")
def bad_layouts(quick_runs):
    """plan.py on each of BAD_LAYOUTS: {flags: CompletedProcess}."""
    return dict(zip((flags for flags, _ in BAD_LAYOUTS), quick_runs[1:]))


@pytest.mark.quick
@pytest.mark.parametrize("flags, says", BAD_LAYOUTS)
def test_bad_layout_one_line(bad_layouts, flags, says):
    done = bad_layouts[flags]
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and says in done.stderr, done.stderr


SEARCH = ["--search", "--gpus", "4", "--global_batch_size", "8", "--gpu_memory", "0.0075"]
SCHEDULES = ("zbv", "dualpipev")


@pytest.fixture(scope="module")
def traced():
    """The other tests' plan.py command lines in one process: 1F1B on 8 processes at the first and the last stage (4
    micro-batches: warmup + 1 of them are 3 and 2), shortened and --every_microbatch; ZBV and DualPipeV; --search.
    {what: CompletedProcess}."""
    cases = {(rank, every): [*MODEL.split(), "--world_size", "8", "--dp_shard", "2", "--tp", "2", "--pp", "2",
                             "--microbatches", "4", "--rank", str(rank), *(["--every_microbatch"] if every else [])]
             for rank in (0, 4) for every in (False, True)}
    # 4 micro-batches on 2 ranks' V: DualPipeV's rank 0 runs 3 of its forwards paired with a backward (OVERLAP_F_B).
    cases.update({schedule: [*MODEL.split(), "--world_size", "4", "--dp_shard", "2", "--pp", "2", "--microbatches",
                             "4", "--schedule", schedule] for schedule in SCHEDULES})
    cases["search"] = SEARCH
    return dict(zip(cases, forked([["plan.py", args, None] for args in cases.values()], cwd=REPO, timeout=900)))


def test_plan_of_fewer_microbatches_is_exact(traced):
    """1F1B traced over its first warmup + 1 micro-batches, the rest added as copies of the last (1 on the first
    stage, 2 on the last): the same bytes, FLOPs and peak as tracing all 4, on the first stage and the last."""
    for rank in (0, 4):
        said = []
        for done in (traced[rank, False], traced[rank, True]):
            assert done.returncode == 0, done.stderr[-2000:]
            said.append([line for line in done.stdout.splitlines() if not line.startswith("Method:")])
        assert said[0] == said[1], rank
        assert any(line.startswith("Peak memory:") for line in said[0])


def test_search_ranks_the_layouts_that_fit(traced):
    """--search on 4 GPUs of the steps' decoder: every layout traced, ranked by its estimated step, the
    assumptions printed; with too little memory, none fits and it says so."""
    done = traced["search"]
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("Search: steps, 4 GPUs of 0.0075 GiB")
    assert sum(line.startswith("Assumed:") for line in lines) == 2 and lines[3].startswith("Method:")
    header = next(i for i, line in enumerate(lines) if line.startswith("rank |"))
    rows = [line.split("|") for line in lines[header + 1:] if line[:4].strip().isdigit()]
    traced_ = [line for line in done.stderr.splitlines() if line.startswith("traced ")]
    unfit = lines[-1].removeprefix("Do not fit in ").split(": ", 1)[1]
    assert len(traced_) == len(rows) + (0 if unfit == "none" else unfit.count(" GiB)")) >= 4
    assert rows and unfit != "none"  # 7.5 MiB: some layouts fit, some do not
    steps = [float(row[4]) for row in rows]
    assert steps == sorted(steps)
    for row in rows:
        assert float(row[3]) <= 0.0075 * 0.9


def test_dualpipev_traces_as_zbv_sends(traced):
    """DualPipeV runs a forward and a backward as one action (OVERLAP_F_B): traced action by action, a step of its
    rank 0 sends and holds what ZBV's does (the same V of stages, the same micro-batches), in another order."""
    said = {}
    for schedule in SCHEDULES:
        done = traced[schedule]
        assert done.returncode == 0, done.stderr[-2000:]
        said[schedule] = [line for line in done.stdout.splitlines() if line.startswith(("Holds:", "  ", "FLOPs:"))]
    assert said["zbv"] == said["dualpipev"] and len(said["zbv"]) >= 5, said
