"""What every benchmark records and how it reports: the machine, a text table, a JSON file and a plot.

Numbers without the machine they came from cannot be compared, so every JSON file starts with the host,
the CPU model, the core count, the load average while it ran, the torch version, the backend and the
world size.
"""
import json
import os
import platform
import socket
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "benchmarks" / "results"


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(backend=None, world_size=None):
    info = {
        "hostname": socket.gethostname(),
        "cpu_model": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "cpu_cores_usable": len(os.sched_getaffinity(0)),
        "load_average_1_5_15min": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }
    if backend is not None:
        info["backend"] = backend
    if world_size is not None:
        info["world_size"] = world_size
    return info


def machine_line(info):
    load = ", ".join(f"{x:.2f}" for x in info["load_average_1_5_15min"])
    gpus = f" | GPUs {', '.join(info['gpus'])}" if info["gpus"] else ""
    return (f"Machine: {info['hostname']} | {info['cpu_model']} | {info['cpu_cores_usable']} usable of "
            f"{info['cpu_cores']} cores | load average {load} | torch {info['torch']}{gpus}")


def slowest(values, device):
    """Element-wise max over the ranks of a process group: a collective, or a timed loop that all ranks run
    together, is as slow as its slowest rank. Every rank must call it."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def table(headers, rows):
    """Right-aligned columns; rows hold already formatted strings."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    lines = ["  ".join(str(cell).rjust(width) for cell, width in zip(row, widths)) for row in [headers, *rows]]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def write_json(path, data):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)  # a reader never sees half a file
    return path


def pyplot():
    """matplotlib with the file-only Agg backend: benchmarks run on machines without a display."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def human_bytes(size):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:g} {unit}"
        size /= 1024
    return f"{size:g} TiB"
