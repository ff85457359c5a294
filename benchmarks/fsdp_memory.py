"""Each rank's peak memory for the parameters while fsdp.py builds its sharded model, against the full model's.

    python benchmarks/fsdp_memory.py                      # 2 ranks, a BlockMLP of width 1024 (about 270 MB in fp32)
    python benchmarks/fsdp_memory.py --nproc 4 --width 512 --depth 4

Two ways, each in a torchrun job of its own (a process's peak memory only grows):
- meta: fsdp.py's own load_train_objs, which builds the model on the meta device, shards it, and fills each rank's
  shards one layer at a time (fsdp.init_shards);
- full: the full model built on every rank, then sharded (what fsdp.py did before, and most examples do).
Measured, not computed: each rank's peak resident memory (ru_maxrss) grows by what building the model took, above
what the process held just before. fsdp.py's model is widened here (its BlockMLP replaced by a wider one) so that
the parameters dwarf the allocator's noise. Writes fsdp_memory.json to --out (default benchmarks/results).
"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file: make the repository importable
from benchmarks import common, report
from benchmarks.launches import BIN, REPO, clean_env

WORKER = r'''
import functools, gc, json, resource, sys
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
sys.path.insert(0, {repo!r})
import fsdp
from models_and_data import BlockMLP

way, width, depth = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
wide = functools.partial(BlockMLP, width=width, hidden=4 * width, depth=depth)
dist.init_process_group("gloo")
mesh = dist.device_mesh.init_device_mesh("cpu", (dist.get_world_size(),))


def build(make):
    if way == "meta":
        fsdp.BlockMLP = make
        return fsdp.load_train_objs(0, mesh, False, torch.device("cpu"))[1]
    torch.manual_seed(0)
    model = make(input_size=20)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


build(functools.partial(BlockMLP, width=8, hidden=32, depth=depth))  # the first build loads code: not counted
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
model = build(wide)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
shard = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
full = sum(p.numel() * p.element_size() for p in model.parameters())
rows = [None] * dist.get_world_size()
dist.all_gather_object(rows, {{"rank": dist.get_rank(), "peak_bytes": peak, "shard_bytes": shard, "full_bytes": full}})
if dist.get_rank() == 0:
    print(json.dumps(rows))
del model  # as fsdp.py ends: FSDP2's reference cycles and DTensor's caches hold the group, which would otherwise be
gc.collect()  # torn down at interpreter exit, where gloo's threads can abort the process (seen once: SIGABRT)
mesh._pg_registry.clear()
dist.destroy_process_group()
'''


def measure(way, args, worker):
    out = subprocess.run([str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={args.nproc}", worker, way,
                          str(args.width), str(args.depth)], capture_output=True, text=True, timeout=args.timeout,
                         env=clean_env(OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072"))
    if out.returncode != 0:
        raise common.UsageError(f"the {way} job failed (exit {out.returncode}): {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(args):
    with tempfile.TemporaryDirectory() as tmp:
        worker = Path(tmp) / "build.py"
        worker.write_text(WORKER.format(repo=str(REPO)))
        results = {way: measure(way, args, worker) for way in ("meta", "full")}
    full = results["meta"][0]["full_bytes"]
    print(report.machine_line(report.machine("gloo", args.nproc)))
    print(f"BlockMLP width {args.width}, depth {args.depth}: the full model's parameters take "
          f"{report.human_bytes(full)}")
    rows = [[r["rank"], report.human_bytes(r["shard_bytes"]), report.human_bytes(r["peak_bytes"]),
             report.human_bytes(f["peak_bytes"]), f"{r['peak_bytes'] / full:.2f}", f"{f['peak_bytes'] / full:.2f}"]
            for r, f in zip(results["meta"], results["full"])]
    print(report.table(["rank", "its shard", "peak, meta", "peak, full first", "meta / full model",
                        "full first / full model"], rows))
    for r in results["meta"]:
        print(f"Rank {r['rank']}: peak {r['peak_bytes'] / full:.2f} of the full model's parameters built from the "
              f"meta device ({report.human_bytes(r['peak_bytes'])} of {report.human_bytes(full)})")
    report.write_json(Path(args.out) / "fsdp_memory.json",
                      {"machine": report.machine("gloo", args.nproc), "width": args.width, "depth": args.depth,
                       "full_bytes": full, "results": results})


if __name__ == "__main__":
    parser = common.ArgumentParser(description=__doc__, formatter_class=common.argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=common.positive_int, default=2, help="ranks (default 2)")
    parser.add_argument("--width", type=common.positive_int, default=1024, help="the blocks' width (default 1024)")
    parser.add_argument("--depth", type=common.positive_int, default=4, help="blocks (default 4)")
    parser.add_argument("--timeout", type=common.positive_float, default=300, help="seconds for each job")
    parser.add_argument("--out", default=report.DEFAULT_OUT, help="folder of fsdp_memory.json")
    common.run(main, parser)
