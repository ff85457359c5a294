"""All-reduce time and bandwidth of the process group, next to the ceilings of the same machine.

    torchrun --standalone --nproc_per_node=2 benchmarks/allreduce.py              # 1 KiB .. 256 MiB
    torchrun --standalone --nproc_per_node=2 benchmarks/allreduce.py --quick      # a few seconds
    torchrun --standalone --nproc_per_node=gpu benchmarks/allreduce.py            # NCCL, one rank per GPU
    mpirun -np 2 python benchmarks/allreduce.py       # adds MPI's own allreduce (mpi4py) as a reference

Bandwidths as nccl-tests define them: algbw = bytes / time per call, and busbw = algbw * 2(n-1)/n, the
bytes each rank's link carries per second in a ring all-reduce; busbw is what compares across world
sizes and against the hardware. Time per call is the median over iterations of the slowest rank (a
collective is done when its last rank is), after warm-up calls. Ceilings, measured in the same run at
the same sizes, all ranks at once as the all-reduce runs:
  copy  torch copy_ of the same bytes on the same device: memory bandwidth, which bounds any reduction;
  tcp   a connected socket pair on 127.0.0.1: the transport gloo uses between processes of one machine;
  mpi   MPI_Allreduce of numpy buffers through mpi4py, when started by mpirun.
Writes allreduce-<backend>-n<world size>.json and .png to --out (default benchmarks/results).
"""
import argparse
import math
import os
import queue
import re
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file: make the repository importable
from benchmarks import common, report
import torch.distributed.nn  # before any process group: docs/failures.md, clean exits
from benchmarks.common import UsageError, check_backend, group_store

ELEMENT = torch.tensor([], dtype=torch.float32).element_size()


def synchronize(device):
    """Wait for the device to finish: GPUs run asynchronously, so a clock read without this stops early."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def byte_size(text):
    """'1K', '256MiB', '4096' -> bytes; a whole number of float32 elements."""
    match = re.fullmatch(r"(\d+)\s*([kmg]?)(i?b)?", text.strip(), re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"expected a size like 1K, 64MiB or 4096, got {text!r}")
    value = int(match[1]) * 1024 ** ("", "k", "m", "g").index(match[2].lower())
    if value < ELEMENT or value % ELEMENT:
        raise argparse.ArgumentTypeError(f"size must be a positive multiple of {ELEMENT} bytes (float32), "
                                         f"got {text}")
    return value


def bus_factor(world_size):
    """nccl-tests' all-reduce factor: a ring moves 2(n-1)/n of the buffer through every rank's link."""
    return 2 * (world_size - 1) / world_size


class LoopbackTCP:
    """A socket pair on 127.0.0.1 with a sending thread: one rank's share of what gloo does on one machine."""

    def __init__(self, max_bytes):
        with socket.create_server(("127.0.0.1", 0)) as listener:
            self.sender = socket.create_connection(listener.getsockname())
            self.receiver, _ = listener.accept()
        for sock in (self.sender, self.receiver):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as gloo: no delay on small sends
        self.payload = memoryview(bytearray(max_bytes))
        self.buffer = memoryview(bytearray(max_bytes))
        self.requests = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._send_loop, daemon=True)
        self.thread.start()

    def _send_loop(self):
        while (size := self.requests.get()) is not None:
            self.sender.sendall(self.payload[:size])

    def transfer(self, size):
        self.requests.put(size)
        received = 0
        while received < size:
            received += self.receiver.recv_into(self.buffer[received:size])

    def close(self):
        self.requests.put(None)
        self.thread.join()
        self.sender.close()
        self.receiver.close()


class Timer:
    """Times a call on every rank together; all ranks must ask for the same measurements in the same order."""

    def __init__(self, device, warmup, max_iterations, budget_s):
        self.device = device
        self.warmup = warmup
        self.max_iterations = max_iterations
        self.budget_s = budget_s

    def _batch(self, call, repeat):
        dist.barrier(device_ids=[self.device.index] if self.device.type != "cpu" else None)
        start = time.perf_counter()
        for _ in range(repeat):
            call()
        synchronize(self.device)
        return (time.perf_counter() - start) / repeat

    def median_seconds(self, call):
        estimate = report.slowest([self._batch(call, max(1, self.warmup))], self.device)[0]
        # Calls far below a millisecond are timed in back-to-back batches: a barrier before each single call
        # would add the ranks' exit skew to what is measured.
        repeat = max(1, min(100, int(1e-3 / max(estimate, 1e-9))))
        iterations = max(3, min(self.max_iterations, int(self.budget_s / max(estimate * repeat, 1e-9))))
        return statistics.median(report.slowest([self._batch(call, repeat) for _ in range(iterations)], self.device))


def measure(sizes, timer, device, comm):
    world_size = dist.get_world_size()
    tcp = LoopbackTCP(max(sizes))
    if comm is not None:
        from mpi4py import MPI
    rows = []
    try:
        for size in sizes:
            count = size // ELEMENT
            tensor = torch.ones(count, dtype=torch.float32, device=device)
            copy_target = torch.empty_like(tensor)
            seconds = timer.median_seconds(lambda: dist.all_reduce(tensor))
            algbw = size / seconds / 1e9
            row = {"bytes": size, "time_s": seconds, "algbw_GBps": algbw, "busbw_GBps": algbw * bus_factor(world_size),
                   "copy_GBps": size / timer.median_seconds(lambda: copy_target.copy_(tensor)) / 1e9,
                   "tcp_GBps": size / timer.median_seconds(lambda: tcp.transfer(size)) / 1e9}
            if comm is not None:
                send, receive = np.ones(count, dtype=np.float32), np.empty(count, dtype=np.float32)
                mpi_seconds = timer.median_seconds(lambda: comm.Allreduce(send, receive, op=MPI.SUM))
                row.update(mpi_time_s=mpi_seconds, mpi_busbw_GBps=size / mpi_seconds / 1e9 * bus_factor(world_size))
            rows.append(row)
    finally:
        tcp.close()
    return rows


def print_table(rows, world_size):
    headers = ["size", "time/call", "algbw GB/s", "busbw GB/s", "copy GB/s", "tcp GB/s"]
    if "mpi_busbw_GBps" in rows[0]:
        headers += ["mpi time", "mpi busbw GB/s"]
    lines = []
    for row in rows:
        line = [report.human_bytes(row["bytes"]), f"{row['time_s'] * 1e6:.1f} us", f"{row['algbw_GBps']:.3f}",
                f"{row['busbw_GBps']:.3f}", f"{row['copy_GBps']:.2f}", f"{row['tcp_GBps']:.2f}"]
        if "mpi_busbw_GBps" in row:
            line += [f"{row['mpi_time_s'] * 1e6:.1f} us", f"{row['mpi_busbw_GBps']:.3f}"]
        lines.append(line)
    print(report.table(headers, lines))
    best = max(rows, key=lambda r: r["busbw_GBps"])
    print(f"Peak busbw {best['busbw_GBps']:.3f} GB/s at {report.human_bytes(best['bytes'])} "
          f"(busbw = algbw * 2(n-1)/n = algbw * {bus_factor(world_size):.3f}); there the ceilings are "
          f"copy {best['copy_GBps']:.2f} GB/s and loopback TCP {best['tcp_GBps']:.2f} GB/s")


def plot(rows, path, title):
    plt = report.pyplot()
    sizes = [row["bytes"] for row in rows]
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(sizes, [r["busbw_GBps"] for r in rows], "o-", label="all_reduce busbw")
    ax.plot(sizes, [r["algbw_GBps"] for r in rows], ".--", label="all_reduce algbw")
    ax.plot(sizes, [r["copy_GBps"] for r in rows], "s:", label="memory copy (ceiling)")
    ax.plot(sizes, [r["tcp_GBps"] for r in rows], "^:", label="loopback TCP (ceiling)")
    if "mpi_busbw_GBps" in rows[0]:
        ax.plot(sizes, [r["mpi_busbw_GBps"] for r in rows], "d-.", label="MPI_Allreduce busbw")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("GB/s (1e9 bytes/s)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def sizes_between(low, high):
    if low > high:
        raise UsageError(f"--min_size {low} is above --max_size {high}")
    return [low * 2 ** i for i in range(int(math.log2(high // low)) + 1)]


def main(args):
    if args.quick:
        args.max_size, args.repeats, args.warmup, args.seconds = min(args.max_size, 64 * 2 ** 10), 5, 2, 0.05
    sizes = sizes_between(args.min_size, args.max_size)
    comm = None
    if common.launched_by_mpirun():
        launcher = "mpirun"
        comm = common.setup_mpi_environment()
    elif "RANK" in os.environ:
        launcher = "torchrun"
    else:
        raise UsageError("allreduce.py is started by torchrun, which sets RANK, LOCAL_RANK and WORLD_SIZE; run "
                         "`torchrun --standalone --nproc_per_node=2 benchmarks/allreduce.py`")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size, local_world_size = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    accelerator = torch.accelerator.current_accelerator(check_available=True)  # None without a usable GPU
    device = torch.device(accelerator.type, local_rank) if accelerator else torch.device("cpu")
    backend = check_backend(args.backend or dist.get_default_backend_for_device(device), device, local_world_size)
    if accelerator:
        torch.accelerator.set_device_index(device.index)
    dist.init_process_group(backend, store=group_store(rank, world_size, args.timeout), rank=rank,
                            world_size=world_size, timeout=args.timeout, device_id=device if accelerator else None)
    machine = report.machine(backend, world_size)  # the load average before the run loads the machine
    rows = measure(sizes, Timer(device, args.warmup, args.repeats, args.seconds), device, comm)
    if rank == 0:
        report_results(args, rows, machine, backend, world_size, device, launcher)
    dist.destroy_process_group()


def report_results(args, rows, machine, backend, world_size, device, launcher):
    machine["load_average_after"] = report.machine()["load_average_1_5_15min"]
    print(report.machine_line(machine))
    print(f"all_reduce (SUM, float32) | backend {backend} | world size {world_size} | launcher {launcher} | "
          f"device {device} | threads per rank {torch.get_num_threads()}")
    print_table(rows, world_size)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"allreduce-{backend}-n{world_size}"
    result = {"benchmark": "allreduce", "machine": machine, "torch": torch.__version__, "backend": backend,
              "world_size": world_size, "launcher": launcher, "device": str(device), "dtype": "float32",
              "op": "SUM", "threads_per_rank": torch.get_num_threads(), "bus_factor": bus_factor(world_size),
              "quick": args.quick, "results": rows}
    print(f"Wrote {report.write_json(stem.with_suffix('.json'), result)}")
    plot(rows, stem.with_suffix(".png"),
         f"all_reduce, {backend}, {world_size} ranks, {launcher} | {machine['hostname']}: "
         f"{machine['cpu_model']}, {machine['cpu_cores']} cores | torch {torch.__version__}")
    print(f"Wrote {stem.with_suffix('.png')}")


if __name__ == "__main__":
    parser = common.ArgumentParser(description="All-reduce bandwidth (nccl-tests' algbw/busbw) against the "
                                            "memory-copy, loopback-TCP and MPI ceilings of the same machine.")
    parser.add_argument("--min_size", type=byte_size, default=2 ** 10, help="smallest message (default 1K)")
    parser.add_argument("--max_size", type=byte_size, default=2 ** 28,
                        help="largest message; sizes double from --min_size (default 256M)")
    parser.add_argument("--repeats", "--iters", type=common.positive_int, default=20,
                        help="most timed repeats per size; the median is reported (default 20)")
    parser.add_argument("--warmup", type=common.positive_int, default=5, help="untimed calls per size first")
    parser.add_argument("--seconds", type=common.positive_float, default=1.0,
                        help="time budget per measurement; at least 3 iterations are timed (default 1.0)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: sizes up to 64K, few iterations (for tests, not for numbers)")
    parser.add_argument("--out", type=Path, default=report.DEFAULT_OUT, help="folder for the JSON and PNG")
    common.add_distributed_args(parser)
    common.run(main, parser)
