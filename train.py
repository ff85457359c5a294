"""MNIST with the Hugging Face Trainer: one script for every launcher, DDP on CPUs or GPUs.

    python train.py --data_dir data/mnist                                     # one process
    torchrun --standalone --nproc_per_node=2 train.py --data_dir data/mnist   # DDP, 2 processes
    mpirun -np 2 python train.py --data_dir data/mnist                        # DDP, ranks from MPI
    python train.py --data_dir data/mnist --num_train_epochs 5 --resume_from_checkpoint last
    torchrun --standalone --nproc_per_node=2 --max_restarts=3 train.py --data_dir data/mnist
                                     # a restarted group resumes from the newest complete checkpoint
    python train.py                  # MNIST from the Hugging Face Hub (ylecun/mnist)

--data_dir: MNIST's IDX files (plain or .gz, there or under MNIST/raw) or a DatasetDict from save_to_disk; data/mnist
is the test set alone, split 8,000 / 2,000. Every field of TrainingArguments is a flag (--help). Checkpoints, the
model and train/eval/all_results.json go to --output_dir (trainer_output).
"""
import gc
import hashlib
import os
import re
import socket
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn  # before any process group: docs/failures.md, clean exits
import torch.nn.functional as F
from datasets import Dataset, DatasetDict, load_dataset, load_from_disk
from torch import nn
from transformers import HfArgumentParser, Trainer, TrainerCallback, TrainingArguments, set_seed
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from models_and_data import mnist_splits

HUB_DATASET = "ylecun/mnist"
GET_THE_DATA = ("give --data_dir DIR with the MNIST IDX files (this repository's data/mnist holds the test set) or a "
                "DatasetDict written by save_to_disk")
MEAN, STD = 0.1307, 0.3081  # of the MNIST training pixels scaled to 0..1
COMPLETE = "complete"  # in a checkpoint-N folder: every rank finished its part of it (CompleteCheckpoints)


class SimpleCNN(nn.Module):
    """Two conv blocks and two fully connected layers for 28x28 digits, in the Hugging Face model style:
    forward(image, labels=None) returns {"loss", "logits"} with labels and {"logits"} without."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(64 * 7 * 7, 128)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, image, labels=None):
        x = F.max_pool2d(F.relu(self.conv1(image)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        logits = self.fc2(x)  # raw logits: a ReLU here (as upstream has) clamps the negative ones and cripples training
        return {"logits": logits} if labels is None else {"loss": F.cross_entropy(logits, labels), "logits": logits}


@dataclass
class DataArguments:
    data_dir: str | None = field(default=None, metadata={
        "help": "folder with the MNIST IDX files (or DIR/MNIST/raw), or a DatasetDict saved with save_to_disk; "
                "default: download ylecun/mnist from the Hugging Face Hub"})
    cache_dir: str | None = field(default=None, metadata={"help": "where the Hub download is cached"})
    max_train_samples: int | None = field(default=None, metadata={"help": "train on the first N images only"})
    max_eval_samples: int | None = field(default=None, metadata={"help": "evaluate on the first N images only"})


# The library's defaults suit fine-tuning a pretrained transformer; these suit a small CNN trained from scratch.
DEFAULTS = dict(
    output_dir="trainer_output", num_train_epochs=3, learning_rate=3e-3, per_device_train_batch_size=64,
    per_device_eval_batch_size=256, eval_strategy="epoch", save_strategy="epoch", logging_steps=50, report_to="none",
    ddp_timeout=300,  # seconds to wait for a missing rank (the library's default is 30 minutes)
    ddp_find_unused_parameters=False,  # the Trainer assumes True for models that are not PreTrainedModels
    # Without a usable GPU, processes the Trainer does not know to be on the CPU each train alone, without DDP.
    use_cpu=not torch.accelerator.is_available(),
)


def load_splits(data_dir, cache_dir=None):
    """(DatasetDict of "train" and "test" with "image" and "label" columns, note): from the Hub, save_to_disk's
    folder or IDX files (the note says how a test-set-only folder was split). Rows as numpy arrays."""
    note = None
    try:
        if data_dir is None:
            splits = load_dataset(HUB_DATASET, cache_dir=cache_dir)
        elif os.path.isfile(os.path.join(data_dir, "dataset_dict.json")):
            splits = load_from_disk(data_dir)
        elif not os.path.isdir(data_dir):
            sys.exit(f"error: --data_dir {data_dir} is not a directory; {GET_THE_DATA}")
        else:
            *pairs, note = mnist_splits(data_dir)  # (images uint8 [N, 28, 28], labels) of each split
            splits = DatasetDict({name: Dataset.from_dict({"image": images.reshape(-1, 28 * 28).numpy(),
                                                           "label": labels.numpy()})
                                  for name, (images, labels) in zip(("train", "test"), pairs)})
    except (OSError, ValueError) as error:  # no network (ConnectionError), a missing or damaged file
        sys.exit(f"error: cannot load {data_dir or HUB_DATASET} ({str(error).splitlines()[0]}); {GET_THE_DATA}")
    for split in ("train", "test"):
        if split not in splits or {"image", "label"} - set(splits[split].column_names):
            sys.exit(f"error: {data_dir or HUB_DATASET} needs 'train' and 'test' splits with 'image' and 'label'")
    return splits.with_format("numpy"), note


def collate(rows):
    """Rows -> {"image": float (B, 1, 28, 28), normalised, "labels": int64 (B)}: what SimpleCNN takes."""
    images = torch.from_numpy(np.stack([row["image"] for row in rows]).astype(np.float32)).reshape(-1, 1, 28, 28)
    return {"image": (images / 255 - MEAN) / STD, "labels": torch.tensor([int(row["label"]) for row in rows])}


def mpi_environment():
    """Under mpirun: RANK, WORLD_SIZE, ... from MPI, as torchrun sets them. mpirun names no rendezvous address:
    rank 0 picks one and a free port, and tells the others over MPI (run_with_mpirun.py shows it step by step)."""
    from mpi4py import MPI  # here, not above: importing it starts MPI, which only an mpirun launch needs

    comm = MPI.COMM_WORLD
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())  # the processes on this machine
    host = "127.0.0.1" if node.Get_size() == comm.Get_size() else socket.gethostbyname(socket.gethostname())
    with socket.socket() as sock:  # a free port of rank 0's machine (the others' pick is not used)
        sock.bind(("", 0))
        mine = (os.environ.get("MASTER_ADDR", host), os.environ.get("MASTER_PORT", str(sock.getsockname()[1])))
    address = comm.bcast(mine, root=0)
    os.environ.update(RANK=str(comm.Get_rank()), WORLD_SIZE=str(comm.Get_size()), LOCAL_RANK=str(node.Get_rank()),
                      LOCAL_WORLD_SIZE=str(node.Get_size()), MASTER_ADDR=address[0], MASTER_PORT=address[1])
    if "OMP_NUM_THREADS" not in os.environ:  # unlike torchrun, mpirun leaves it unset: share this machine's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // node.Get_size()))


def group_store(rank, world_size, timeout):
    """Under torchrun, a store of this group's own: torchrun's outlives a restart with the dead group's keys, and a
    restarted rank can read a dead peer's address and burn the restart (pytorch/pytorch#135712, torch 2.13 too)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    host = os.environ["MASTER_ADDR"]
    torchrun_store = dist.TCPStore(host, int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    if rank == 0:  # a fresh store, listening at the rendezvous address alone; its port posted in torchrun's
        listener = socket.create_server((host, 0), family=socket.getaddrinfo(host, 0)[0][0])
        store = dist.TCPStore(host, listener.getsockname()[1], world_size, is_master=True, timeout=timeout,
                              wait_for_workers=False, master_listen_fd=listener.detach())
        torchrun_store.set("group_store_port", str(store.port))
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while time.monotonic() < deadline:  # where nothing answers at the posted port, the post is the dead group's
        port = int(torchrun_store.get("group_store_port"))
        try:
            socket.create_connection((host, port), timeout=3).close()  # refused at once where rank 0 died
            return dist.TCPStore(host, port, is_master=False, timeout=timeout)
        except OSError:
            time.sleep(0.1)
    sys.exit(f"error: rank 0 opened no store for this group within --timeout {timeout.total_seconds():g}s")


def start_process_group(flags):
    """Under a launcher, before TrainingArguments (which would start it without --ddp_timeout on the CPU)."""
    rank, local_rank, world_size = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    if not flags["use_cpu"] and not torch.accelerator.is_available():
        sys.exit("error: --use_cpu False on a machine without a usable GPU: each process would train alone, not with "
                 "DDP; leave --use_cpu at its default")
    accelerator = None if flags["use_cpu"] else torch.accelerator.current_accelerator(check_available=True)
    if accelerator and int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) > torch.accelerator.device_count():
        accelerator, flags["use_cpu"] = None, True  # more processes than devices (a Mac has one mps device): the CPU
    device = torch.device(accelerator.type, local_rank) if accelerator else torch.device("cpu")
    backend = flags["ddp_backend"] or dist.get_default_backend_for_device(device)
    if backend == "nccl" and device.type != "cuda":
        sys.exit("error: --ddp_backend nccl needs a CUDA GPU for each process; leave it out for gloo on the CPU")
    if accelerator:  # before the process group, so NCCL binds this process to its own GPU
        torch.accelerator.set_device_index(device.index)
    timeout = timedelta(seconds=flags["ddp_timeout"])
    if dist.is_initialized():  # a framework's group (Ray Train's): used, and left to it
        backend = dist.get_backend()
    else:
        dist.init_process_group(backend, store=group_store(rank, world_size, timeout), rank=rank,
                                world_size=world_size, timeout=timeout, device_id=device if accelerator else None)
    flags["ddp_backend"] = backend
    return backend


class CompleteCheckpoints(TrainerCallback):
    """Each rank writes its part of a checkpoint on its own (rank 0 the weights, optimizer and trainer_state.json,
    every rank its RNG state), so a rank killed while saving leaves a folder that looks whole and is not. Once all
    ranks have saved, rank 0 marks the folder; a resume takes the newest marked one."""

    def on_save(self, args, state, control, **kwargs):
        if dist.is_initialized():
            dist.barrier()
        if state.is_world_process_zero:
            folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            open(os.path.join(folder, COMPLETE), "w").close()


def newest_complete_checkpoint(output_dir):
    steps = [int(name.rsplit("-", 1)[1]) for name in os.listdir(output_dir)
             if re.fullmatch(rf"{PREFIX_CHECKPOINT_DIR}-\d+", name)
             and os.path.isfile(os.path.join(output_dir, name, COMPLETE))]
    return os.path.join(output_dir, f"{PREFIX_CHECKPOINT_DIR}-{max(steps)}") if steps else None


def checkpoint_to_resume(value, output_dir):
    """--resume_from_checkpoint: a folder, or last/True for the newest complete one in output_dir. Without it, a
    group that torchrun restarted after a failure goes on from the newest complete checkpoint, not from scratch."""
    last = newest_complete_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    if value is None:
        return last if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0 else None
    if value.lower() in ("last", "true"):
        if last is None:
            sys.exit(f"error: --resume_from_checkpoint {value}: {output_dir} holds no complete checkpoint-N folder to "
                     "resume from; leave the flag out to start afresh")
        return last
    if not os.path.isfile(os.path.join(value, "trainer_state.json")):
        sys.exit(f"error: --resume_from_checkpoint {value}: not a Trainer checkpoint (no trainer_state.json); give a "
                 "checkpoint-N folder or 'last'")
    return value


class RunSpan(TrainerCallback):
    """Where this train() call starts (after a resume, not at 0), for the summary line."""

    def on_train_begin(self, args, state, control, **kwargs):
        self.start_step, self.start_epoch = state.global_step, state.epoch or 0.0


def eval_metrics(prediction):
    """Accuracy and loss, each image counted once at any world size: the Trainer hands over all ranks' logits with
    the padding of their shards removed (gather_for_metrics). Its own eval_loss weighs each rank's short last batch
    like a full one: this "loss" replaces it (docs/train.md)."""
    logits, labels = torch.tensor(prediction.predictions), torch.tensor(prediction.label_ids)
    correct = int((logits.argmax(-1) == labels).sum())
    return {"accuracy": correct / len(labels), "loss": F.cross_entropy(logits.double(), labels).item(),
            "correct": correct, "scored": len(labels)}


def check_weights_identical(model, rank_zero):
    """DDP keeps the replicas equal by averaging gradients, so every rank must end with the same bits."""
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().cpu().numpy().tobytes())
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest.hexdigest())
    if len(set(digests)) > 1:
        sys.exit(f"error: the ranks ended with different weights (sha256 {', '.join(d[:12] for d in digests)}); "
                 "they did not train as one DDP model")
    if rank_zero:
        print(f"weights identical on all {len(digests)} ranks (sha256 {digests[0][:12]})", flush=True)


def main(argv=None):
    mpi_variables = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")
    if "RANK" not in os.environ and any(name in os.environ for name in mpi_variables):
        mpi_environment()  # mpirun started us: RANK, WORLD_SIZE, MASTER_ADDR, ... from MPI before anything reads them
    parser = HfArgumentParser((DataArguments, TrainingArguments))
    parser.set_defaults(**DEFAULTS)
    flags = vars(parser.parse_args(argv))
    for name in ("max_train_samples", "max_eval_samples", "ddp_timeout"):
        if flags[name] is not None and flags[name] <= 0:
            parser.error(f"--{name} must be positive, got {flags[name]}")
    # Every rank loads the data before waiting for any other, so bad data stops them all at once.
    splits, note = load_splits(flags["data_dir"], flags["cache_dir"])
    if int(os.environ.get("RANK", 0)) == 0:  # the output folder checked now, not at the first checkpoint
        probe = os.path.join(flags["output_dir"], f".probe-{os.getpid()}")
        try:
            os.makedirs(flags["output_dir"], exist_ok=True)
            open(probe, "wb").close()
            os.remove(probe)
        except OSError as error:
            sys.exit(f"error: cannot write in --output_dir {flags['output_dir']}: {error.strerror}")
    owns_group = not dist.is_initialized()
    backend = start_process_group(flags) if "WORLD_SIZE" in os.environ else None
    try:
        data_args, training_args = parser.parse_dict(flags)  # TrainingArguments now finds the process group
    except ValueError as error:  # flags that contradict each other
        sys.exit(f"error: {str(error).strip().splitlines()[0]}")
    checkpoint = checkpoint_to_resume(training_args.resume_from_checkpoint, training_args.output_dir)

    train_set, eval_set = splits["train"], splits["test"]
    if data_args.max_train_samples:
        train_set = train_set.select(range(min(data_args.max_train_samples, len(train_set))))
    if data_args.max_eval_samples:
        eval_set = eval_set.select(range(min(data_args.max_eval_samples, len(eval_set))))
    set_seed(training_args.seed)  # the same initial weights on every rank
    span = RunSpan()
    trainer = Trainer(model=SimpleCNN(), args=training_args, train_dataset=train_set, eval_dataset=eval_set,
                      data_collator=collate, compute_metrics=eval_metrics,
                      callbacks=[span, CompleteCheckpoints()])
    rank_zero = trainer.is_world_process_zero()
    if rank_zero:
        if note:
            print(note, flush=True)
        print(f"Training SimpleCNN on {len(train_set)} images, evaluating on {len(eval_set)} | world size "
              f"{training_args.world_size} | backend {backend or 'none'} | device {training_args.device}"
              + (f" | resuming from {checkpoint}" if checkpoint else ""), flush=True)

    start = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=checkpoint)
    wall = time.perf_counter() - start
    trainer.save_model()
    metrics = {**result.metrics, "train_samples": len(train_set)}
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)  # also merged into all_results.json
    trainer.save_state()
    metrics = {**trainer.evaluate(), "eval_samples": len(eval_set)}
    trainer.log_metrics("eval", metrics)
    trainer.save_metrics("eval", metrics)
    if dist.is_initialized():
        check_weights_identical(trainer.model, rank_zero)

    if rank_zero:
        state = trainer.state
        epochs, steps = round(state.epoch - span.start_epoch, 2), state.global_step - span.start_step
        losses = [entry["loss"] for entry in state.log_history if "loss" in entry and entry["step"] > span.start_step]
        print(f"Summary: epochs {epochs} | steps {steps} | final loss {(losses or [result.training_loss])[-1]:.6f} | "
              f"samples/s {epochs * len(train_set) / wall:.1f} | wall {wall:.2f}s | world size "
              f"{training_args.world_size} | backend {backend or 'none'}", flush=True)
    if dist.is_initialized():
        # The Trainer and accelerate both hold the DDP wrapper, which holds the group: let go of it before
        # destroy_process_group, else the group is torn down later and may hang or abort the exit (docs/failures.md).
        trainer.accelerator.free_memory()
        trainer.model_wrapped = trainer.model
        gc.collect()
        if owns_group:
            dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except (Exception, SystemExit) as error:
        if not dist.is_initialized():  # no process group: Python's own exit is safe
            raise
        # The group lives on: Python's exit can stall or abort in gloo's threads. Say why as Python would; leave now.
        if isinstance(error, SystemExit):  # sys.exit("error: ...")
            print(error.code, file=sys.stderr)
        else:  # the traceback, through any hook a tool installed
            sys.excepthook(*sys.exc_info())
        sys.stdout.flush()
        os._exit(1)
