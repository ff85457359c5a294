"""What the checkpoints' sums cost (fsdp_checkpoint.py): saving and loading a sharded checkpoint of fsdp.py's model,
with and without them, and how fast each candidate sum runs.

    python benchmarks/checkpoint_sums.py                      # 2 ranks, a BlockMLP of width 1024 (128 MiB in fp32)
    python benchmarks/checkpoint_sums.py --width 256 --repeats 1 --dir /shared/scratch

One torchrun job of --nproc ranks builds fsdp.py's model widened (its load_train_objs, BlockMLP replaced by a wider
one), takes one SGD step so that the momentum exists, and then, --repeats times (after a round unrecorded), each
way in turn, each first every other round:
- without: dcp.save with DCP's FileSystemWriter, dcp.load;
- with: dcp.save with fsdp_checkpoint.SummingWriter (each rank sums the files it wrote) and rank 0's gathering of
  the sums (gather_sums, what the marker lists), then CheckpointDir.check_files (each rank sums a share of the
  files) before dcp.load.
Each time is the slowest rank's, between two barriers. A load is timed twice: the files as the save left them in
the page cache, and read from disk (each file dropped from the page cache first, posix_fadvise DONTNEED). The
checkpoints go to --dir (default: the system's temporary folder): put it on the filesystem your checkpoints use.
Rank 0 also times each candidate sum over one shard held in memory. Writes checkpoint_sums.json to --out (default
benchmarks/results).
"""
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file: make the repository importable
from benchmarks import common, report
from benchmarks.launches import BIN, REPO, clean_env

WORKER = r'''
import functools, hashlib, json, os, shutil, sys, time, zlib
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
sys.path.insert(0, {repo!r})
import fsdp
import fsdp_checkpoint
from models_and_data import BlockMLP

width, depth, repeats, root = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = dist.device_mesh.init_device_mesh("cpu", (dist.get_world_size(),))
fsdp.BlockMLP = functools.partial(BlockMLP, width=width, hidden=4 * width, depth=depth)
_, model, optimizer = fsdp.load_train_objs(0, mesh, False, torch.device("cpu"))
model(torch.randn(8, 20)).sum().backward()
optimizer.step()  # the momentum: what fsdp.py's checkpoints hold besides the weights
model_state, optimizer_state = get_state_dict(model, optimizer)
state = {{"model": model_state, "optimizer": optimizer_state}}
checkpoints = fsdp_checkpoint.CheckpointDir(root, log=print)  # its gloo group, as fsdp.py's
group = checkpoints.group


def timed(work):
    dist.barrier(group=group)
    start = time.perf_counter()
    result = work()
    dist.barrier(group=group)  # the slowest rank's time
    return time.perf_counter() - start, result


def drop_from_page_cache(path):
    if rank == 0:
        for name in os.listdir(path):
            fd = os.open(os.path.join(path, name), os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


rows = []
for repeat in range(-1, repeats):  # -1: a round unrecorded, DCP's first save and load (its planners) warm
    for way in ("without", "with") if repeat % 2 else ("with", "without"):  # each way first every other round
        path = os.path.join(root, f"{{way}}-{{repeat}}")

        def save():
            if way == "without":
                dcp.save(state, checkpoint_id=path, process_group=group)
                return None
            dcp.save(state, storage_writer=fsdp_checkpoint.SummingWriter(path), process_group=group)
            return fsdp_checkpoint.gather_sums(path) if rank == 0 else None

        save_s, files = timed(save)
        box = [files]
        dist.broadcast_object_list(box, src=0, group=group)
        files = box[0]

        def load():
            if way == "with":
                damage = checkpoints.check_files(path, files)
                assert damage is None, damage
            dcp.load(state, checkpoint_id=path, process_group=group)

        row = {{"way": way, "repeat": repeat, "save_s": save_s}}
        row["load_cached_s"], _ = timed(load)
        drop_from_page_cache(path)
        row["load_from_disk_s"], _ = timed(load)
        row["checkpoint_bytes"] = sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))
        if repeat >= 0:
            rows.append(row)
        dist.barrier(group=group)
        if rank == 0:
            shutil.rmtree(path)

digests = {{}}
if rank == 0:  # one shard in memory: the sums alone, no file reading
    shard = b"".join(t.to_local().numpy().tobytes() for t in model_state.values())  # rank 0's weights
    candidates = {{"zlib.crc32": zlib.crc32, "zlib.adler32": zlib.adler32,
                  **{{f"hashlib.{{name}}": functools.partial(lambda name, data: hashlib.new(name, data).digest(), name)
                     for name in ("md5", "sha1", "sha256", "blake2b")}}}}
    for name, digest in candidates.items():
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            digest(shard)
            best = min(best, time.perf_counter() - start)
        digests[name] = len(shard) / best / 1e9
    print(json.dumps({{"rows": rows, "digest_GBps": digests, "digest_bytes": len(shard),
                      "full_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}}))
del model, optimizer, model_state, optimizer_state, state
mesh._pg_registry.clear()
dist.destroy_process_group()
'''


def main(args):
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        worker = Path(tmp) / "sums.py"
        worker.write_text(WORKER.format(repo=str(REPO)))
        (Path(tmp) / "checkpoints").mkdir()
        out = subprocess.run([str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={args.nproc}", worker,
                              str(args.width), str(args.depth), str(args.repeats), str(Path(tmp) / "checkpoints")],
                             capture_output=True, text=True, timeout=args.timeout, env=clean_env())
    if out.returncode != 0:
        raise common.UsageError(f"the job failed (exit {out.returncode}): {out.stderr.strip()[-500:]}")
    data = json.loads(out.stdout.strip().splitlines()[-1])
    machine = report.machine("gloo", args.nproc)
    medians = {way: {key: statistics.median(row[key] for row in data["rows"] if row["way"] == way)
                     for key in ("save_s", "load_cached_s", "load_from_disk_s", "checkpoint_bytes")}
               for way in ("without", "with")}
    print(report.machine_line(machine))
    print(f"BlockMLP width {args.width}, depth {args.depth}: {report.human_bytes(data['full_bytes'])} of parameters; "
          f"a checkpoint of {report.human_bytes(medians['with']['checkpoint_bytes'])} (weights and momentum) at "
          f"{args.nproc} ranks, medians of {args.repeats}")
    rows = []
    for key, what in (("save_s", "save"), ("load_cached_s", "load, files in the page cache"),
                      ("load_from_disk_s", "load, files read from disk")):
        without, with_ = medians["without"][key], medians["with"][key]
        rows.append([what, f"{without:.3f} s", f"{with_:.3f} s", f"{with_ - without:+.3f} s",
                     f"{with_ / without - 1:+.0%}"])
    print(report.table(["", "without sums", "with sums", "cost", ""], rows))
    print("One core, one shard in memory: " + ", ".join(f"{name} {rate:.2f} GB/s"
                                                        for name, rate in data["digest_GBps"].items()))
    result = {"benchmark": "checkpoint_sums", "machine": machine, "width": args.width, "depth": args.depth,
              "world_size": args.nproc, "repeats": args.repeats, "full_bytes": data["full_bytes"],
              "medians": medians, "results": data["rows"], "digest_GBps": data["digest_GBps"],
              "digest_bytes": data["digest_bytes"]}
    print(f"Wrote {report.write_json(Path(args.out) / 'checkpoint_sums.json', result)}")


if __name__ == "__main__":
    parser = common.ArgumentParser(description=__doc__, formatter_class=common.argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=common.positive_int, default=2, help="ranks (default 2)")
    parser.add_argument("--width", type=common.positive_int, default=1024, help="the blocks' width (default 1024)")
    parser.add_argument("--depth", type=common.positive_int, default=4, help="blocks (default 4)")
    parser.add_argument("--repeats", type=common.positive_int, default=5, help="saves and loads each way (default 5)")
    parser.add_argument("--dir", help="where the checkpoints are written (default: the system's temporary folder)")
    parser.add_argument("--timeout", type=common.positive_float, default=600, help="seconds for the job")
    parser.add_argument("--out", default=report.DEFAULT_OUT, help="folder of checkpoint_sums.json")
    common.run(main, parser)
