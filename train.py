"""MNIST with the Hugging Face Trainer: one script for every launcher, DDP on CPUs or GPUs.

    python train.py --data_dir data/mnist                                     # one process
    torchrun --standalone --nproc_per_node=2 train.py --data_dir data/mnist   # DDP, 2 processes
    mpirun -np 2 python train.py --data_dir data/mnist                        # DDP, ranks from MPI
    python train.py --data_dir data/mnist --num_train_epochs 5 --resume_from_checkpoint last
    torchrun --standalone --nproc_per_node=2 --max_restarts=3 train.py --data_dir data/mnist
                                     # a restarted group resumes from the newest checkpoint
    python train.py                  # MNIST from the Hugging Face Hub (ylecun/mnist)

--data_dir holds MNIST's IDX files (plain or .gz, directly or under MNIST/raw as torchvision keeps them) or a
DatasetDict written by save_to_disk. The repository's data/mnist is the official test set alone: the script then
trains on 8,000 of its images, evaluates on the other 2,000, and says so. Every field of TrainingArguments is a
flag (`python train.py --help`), with defaults for a small CNN trained from scratch. The run writes checkpoints,
the model and train/eval/all_results.json to --output_dir (trainer_output).
"""
import hashlib
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  imported before any process group: docs/failures.md, clean exits
import torch.nn.functional as F
from transformers import HfArgumentParser, Trainer, TrainerCallback, TrainingArguments, set_seed
from transformers.trainer_utils import get_last_checkpoint

from ddp_common import cli, launchers, mpi, snapshot, teardown
from ddp_common.devices import check_backend, share_cores
from ddp_common.errors import CheckFailed, UsageError, one_line
from ddp_common.mnist import collate, load_mnist_splits
from ddp_common.models import SimpleCNN
from ddp_common.progress import summary_line
from ddp_common.rendezvous import group_store


@dataclass
class DataArguments:
    data_dir: str | None = field(default=None, metadata={
        "help": "folder with the MNIST IDX files (or DIR/MNIST/raw), or a DatasetDict saved with save_to_disk; "
                "default: download ylecun/mnist from the Hugging Face Hub"})
    cache_dir: str | None = field(default=None, metadata={
        "help": "where the Hub download is cached (default: the datasets cache, ~/.cache/huggingface)"})
    max_train_samples: int | None = field(default=None, metadata={
        "help": "train on the first N training images only (quick runs)"})
    max_eval_samples: int | None = field(default=None, metadata={
        "help": "evaluate on the first N evaluation images only"})


# The library's defaults suit fine-tuning a pretrained transformer; these suit a small CNN trained from scratch
# (98% on the 2,000 held-out digits after 3 epochs, alone or as 2 DDP ranks). Each is still a flag.
DEFAULTS = dict(
    output_dir="trainer_output", num_train_epochs=3, learning_rate=3e-3, per_device_train_batch_size=64,
    per_device_eval_batch_size=256, eval_strategy="epoch", save_strategy="epoch", logging_steps=50,
    report_to="none",
    ddp_timeout=300,  # seconds to wait for a missing rank (the library's default is 30 minutes)
    # The Trainer assumes True for models that are not PreTrainedModels: an extra graph walk every step.
    ddp_find_unused_parameters=False,
    # On a machine without a usable GPU, processes that the Trainer does not know to be on the CPU each train
    # alone, without DDP. (is_available: a CUDA build of torch without a GPU says cuda otherwise.)
    use_cpu=not torch.accelerator.is_available(),
)


class ArgumentParser(HfArgumentParser, cli.ArgumentParser):
    """HfArgumentParser with the repository's one-line errors."""


def start_process_group(flags):
    """Start the process group when a launcher started us, before TrainingArguments would: made from flags, it
    sets up the devices at once, and on the CPU it leaves out --ddp_timeout. Returns the backend, None alone."""
    if "WORLD_SIZE" not in os.environ:
        return None
    rank, local_rank, world_size = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    if not flags["use_cpu"] and not torch.accelerator.is_available():
        raise UsageError("--use_cpu False on a machine without a usable GPU: the Trainer would then train each "
                         "process alone instead of with DDP; leave --use_cpu at its default")
    accelerator = None if flags["use_cpu"] else torch.accelerator.current_accelerator(check_available=True)
    device = torch.device(accelerator.type, local_rank) if accelerator else torch.device("cpu")
    backend = check_backend(flags["ddp_backend"] or dist.get_default_backend_for_device(device), device,
                            int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    if accelerator:  # before the process group, so NCCL binds this process to its own GPU
        torch.accelerator.set_device_index(device.index)
    # A store of this group's own: torchrun's outlives a restart with the old group's keys (docs/failures.md).
    dist.init_process_group(backend, store=group_store(rank, world_size, flags["ddp_timeout"]), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=flags["ddp_timeout"]),
                            device_id=device if accelerator else None)
    threads = share_cores(device)  # processes sharing a machine share its cores
    if threads and rank == 0:
        print(threads, flush=True)
    flags["ddp_backend"] = backend
    return backend


def checkpoint_to_resume(value, output_dir):
    """--resume_from_checkpoint: a checkpoint folder, or last/True for the newest one in output_dir. Without it,
    a group that torchrun restarted after a failure goes on from the newest checkpoint, not from scratch."""
    last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    if value is None:
        return last if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0 else None
    if value.lower() in ("last", "true"):
        if last is None:
            raise UsageError(f"--resume_from_checkpoint {value}: {output_dir} holds no checkpoint-N folder to "
                             "resume from; leave the flag out to start afresh")
        return last
    if not os.path.isfile(os.path.join(value, "trainer_state.json")):
        raise UsageError(f"--resume_from_checkpoint {value}: not a Trainer checkpoint (no trainer_state.json); "
                         "give a checkpoint-N folder or 'last'")
    return value


class RunSpan(TrainerCallback):
    """Where this train() call starts (after a resume, not at 0), for the summary line."""

    def on_train_begin(self, args, state, control, **kwargs):
        self.start_step, self.start_epoch = state.global_step, state.epoch or 0.0


def eval_metrics(prediction):
    """Accuracy and loss over the evaluation set, each image counted once at any world size (docs/train.md).
    The Trainer hands over the logits and labels of all ranks with the padding that evened out the ranks'
    shards already removed (accelerate's gather_for_metrics), so the counts are exact. Its own eval_loss is not:
    it averages per-batch means and weighs each rank's short last batch like a full one. The "loss" returned
    here takes its place (the Trainer prefixes it to eval_loss after setting its own)."""
    logits, labels = torch.tensor(prediction.predictions), torch.tensor(prediction.label_ids)
    correct = int((logits.argmax(-1) == labels).sum())
    return {"accuracy": correct / len(labels), "loss": F.cross_entropy(logits.double(), labels).item(),
            "correct": correct, "scored": len(labels)}


def check_weights_identical(model, is_rank_zero):
    """DDP keeps the replicas equal by averaging gradients, so every rank must end with the same bits."""
    if not dist.is_initialized():
        return
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().cpu().numpy().tobytes())
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest.hexdigest())
    if len(set(digests)) > 1:
        raise CheckFailed(f"the ranks ended with different weights (sha256 {', '.join(d[:12] for d in digests)}); "
                          "they did not train as one DDP model")
    if is_rank_zero:
        print(f"weights identical on all {len(digests)} ranks (sha256 {digests[0][:12]})", flush=True)


def main():
    if launchers.launched_by_mpirun():
        mpi.setup_environment()  # RANK, WORLD_SIZE, MASTER_ADDR, ... from MPI, before anything reads them
    parser = ArgumentParser((DataArguments, TrainingArguments))
    parser.set_defaults(**DEFAULTS)
    flags = vars(parser.parse_args())
    for name in ("max_train_samples", "max_eval_samples", "ddp_timeout"):
        if flags[name] is not None and flags[name] <= 0:
            parser.error(f"--{name} must be positive, got {flags[name]}")
    # Every rank loads the data before waiting for any other, so bad data stops them all at once.
    splits, note = load_mnist_splits(flags["data_dir"], flags["cache_dir"])
    backend = start_process_group(flags)
    try:
        data_args, training_args = parser.parse_dict(flags)  # TrainingArguments now finds the process group
    except ValueError as error:  # flags that contradict each other
        raise UsageError(one_line(error)) from None
    checkpoint = checkpoint_to_resume(training_args.resume_from_checkpoint, training_args.output_dir)
    # Rank 0 saves the checkpoints: now, not at the first save, it checks that it can, and that no other run does.
    snapshot.claim_directory(training_args.output_dir, saves=training_args.process_index == 0)

    train_set, eval_set = splits["train"], splits["test"]
    if data_args.max_train_samples:
        train_set = train_set.select(range(min(data_args.max_train_samples, len(train_set))))
    if data_args.max_eval_samples:
        eval_set = eval_set.select(range(min(data_args.max_eval_samples, len(eval_set))))
    set_seed(training_args.seed)  # the same initial weights on every rank
    span = RunSpan()
    trainer = Trainer(model=SimpleCNN(), args=training_args, train_dataset=train_set, eval_dataset=eval_set,
                      data_collator=collate, compute_metrics=eval_metrics, callbacks=[span])
    rank_zero = trainer.is_world_process_zero()
    if rank_zero:
        if note:
            print(note, flush=True)
        print(f"Training SimpleCNN on {len(train_set)} images, evaluating on {len(eval_set)} | "
              f"world size {training_args.world_size} | backend {backend or 'none'} | "
              f"device {training_args.device}" + (f" | resuming from {checkpoint}" if checkpoint else ""),
              flush=True)

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
    check_weights_identical(trainer.model, rank_zero)

    if rank_zero:
        state = trainer.state
        epochs = state.epoch - span.start_epoch
        losses = [entry["loss"] for entry in state.log_history if "loss" in entry and entry["step"] > span.start_step]
        print(summary_line(round(epochs, 2), state.global_step - span.start_step,
                           losses[-1] if losses else result.training_loss, round(epochs * len(train_set)),
                           wall, training_args.world_size, backend or "none"), flush=True)
    if dist.is_initialized():
        teardown.release_trainer(trainer)  # the DDP wrapper the Trainer and accelerate hold (see there)
        dist.destroy_process_group()


if __name__ == "__main__":
    cli.run(main)
