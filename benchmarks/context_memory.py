"""The longest sequence one training step of causal attention fits in a fixed memory per rank, at cp 1 (one
process, PyTorch's SDPA), cp 2 and cp 4 (context_parallel.py's ring and all-gather), and its time per token.

    python benchmarks/context_memory.py                  # a budget of 32 MiB a rank
    python benchmarks/context_memory.py --quick          # 8 MiB: 2 minutes

context_parallel.py's tiles at their default size (TILE, 128). The attention of language_model.py's shape at a small
width, so that the sequences grow long on 2 cores: batch 1, 8 query heads, 2 key/value heads, head_dim 32, float32.
Each rank makes its own slice of q, k and v (as a cp rank of nd_parallel.py holds them), runs the attention and its
backward (the loss: the outputs' sum). One torchrun job a configuration tries lengths 2^n and 3 x 2^(n-1) tokens, in
order, until a step's peak passes the budget. Measured, not computed: the peak resident memory (ru_maxrss) above
what the process held after a warm-up step, the largest over the ranks; malloc returns large blocks to the system
(MALLOC_MMAP_THRESHOLD_), so the peak is the step's. Time: one step's wall time over the whole sequence's tokens.
Writes context_memory.json to --out.
"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file: make the repository importable
from benchmarks import common, report
from benchmarks.launches import REPO, clean_env, torchrun_cmd

WORKER = r'''
import json, resource, sys, time
import torch, torch.distributed as dist, torch.nn.functional as F
sys.path.insert(0, {repo!r})
from context_parallel import CP_ATTENTION

form, budget = sys.argv[1], float(sys.argv[2])
dist.init_process_group("gloo")
cp = dist.get_world_size()


def step(seq):
    q, k, v = (torch.randn(1, heads, seq // cp, 32, requires_grad=True) for heads in (8, 2, 2))
    start = time.perf_counter()
    if form == "sdpa":
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        out = CP_ATTENTION[form](q, k, v, dist.group.WORLD)
    out.sum().backward()
    dist.barrier()
    return time.perf_counter() - start


def rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


step(64 * cp)  # the first step loads code and opens gloo's buffers: not counted
before = rss()
lengths = sorted({{2 ** n for n in range(8, 24)}} | {{3 * 2 ** n for n in range(7, 23)}})
for seq in lengths:
    seconds = step(seq)
    peak = torch.tensor(rss() - before, dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        print(json.dumps({{"seq": seq, "peak_bytes": int(peak), "s_per_token": seconds / seq}}), flush=True)
    if peak > budget:
        break
dist.destroy_process_group()
'''

CONFIGS = [("sdpa", 1), ("ring", 2), ("allgather", 2), ("ring", 4), ("allgather", 4)]


def measure(form, cp, budget, worker, timeout):
    out = subprocess.run(torchrun_cmd(worker, form, str(budget), nproc=cp), capture_output=True, text=True,
                         timeout=timeout,
                         env=clean_env(OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072"))
    if out.returncode != 0:
        raise common.UsageError(f"the {form} job at cp {cp} failed (exit {out.returncode}): {out.stderr[-500:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def main(args):
    budget = args.budget_mib * 2 ** 20
    with tempfile.TemporaryDirectory() as tmp:
        worker = Path(tmp) / "attend.py"
        worker.write_text(WORKER.format(repo=str(REPO)))
        results = [{"form": form, "cp": cp, "steps": measure(form, cp, budget, worker, args.timeout)}
                   for form, cp in CONFIGS]
    machine = report.machine("gloo", 4)
    print(report.machine_line(machine))
    common_seq = max(row["seq"] for row in results[0]["steps"] if row["peak_bytes"] <= budget)
    rows = []
    for result in results:
        fits = [row for row in result["steps"] if row["peak_bytes"] <= budget]
        result["longest"] = fits[-1] if fits else None
        at_common = next(row for row in result["steps"] if row["seq"] == common_seq)
        rows.append([result["cp"], result["form"], fits[-1]["seq"] if fits else "none",
                     report.human_bytes(fits[-1]["peak_bytes"]) if fits else "-",
                     f"{fits[-1]['s_per_token'] * 1e6:.0f}" if fits else "-",
                     f"{at_common['s_per_token'] * 1e6:.0f}"])
    print(f"One step of causal attention, a budget of {args.budget_mib} MiB a rank:")
    print(report.table(["cp", "attention", "longest sequence", "its peak a rank", "us a token",
                        f"us a token at {common_seq}"], rows))
    report.write_json(Path(args.out) / "context_memory.json",
                      {"machine": machine, "budget_bytes": budget, "results": results})


if __name__ == "__main__":
    parser = common.ArgumentParser(description=__doc__, formatter_class=common.argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget_mib", type=common.positive_float, default=32, help="memory a rank (default 32)")
    parser.add_argument("--quick", action="store_const", const=8, dest="budget_mib", help="a budget of 8 MiB")
    parser.add_argument("--timeout", type=common.positive_float, default=1200, help="seconds for each job")
    parser.add_argument("--out", default=report.DEFAULT_OUT, help="folder of context_memory.json")
    common.run(main, parser)
