"""Test-only probes, loaded by every Python process the tests launch (tests/conftest.py puts this folder on
PYTHONPATH). They let a test check from outside what a script does inside, without trusting the script's
own report. Nothing here runs for a user.

Always on:
- After destroy_process_group() of the default group, gloo's worker threads must be gone. If anything
  still holds the group (a DDP model not yet freed, a library's default argument), the group is torn down
  later: with the GIL held when the holder goes (a hang, now and then), or during interpreter shutdown (an
  abort, now and then). The probe prints a line the tests fail on (README: clean exits).

On request, through the environment:
- DDP_EXAMPLES_PROBE_COLLECTIVES=1: when the default group is destroyed, each rank prints how many
  collectives it issued (the group's sequence number), e.g. to count DDP's gradient all-reduces.
- DDP_EXAMPLES_PROBE_WEIGHTS=DIR: when a Hugging Face Trainer finishes train(), each rank saves its
  model's weights to DIR/rank<R>.pt, so a test can compare the ranks' weights itself.
- DDP_EXAMPLES_PROBE_FAKE_GPUS=N: torch reports N CUDA GPUs and NCCL, for the checks that run before any
  GPU is touched (more ranks than GPUs).
- DDP_EXAMPLES_PROBE_FAKE_MPS=1: torch reports one mps device, as on Apple silicon, for the scripts' choice of
  device (more processes than devices train on the CPU); the device itself is never touched.
- DDP_EXAMPLES_PROBE_SAMPLES=DIR: each process writes DIR/rank<R>-restart<C>-<pid>.jsonl, a line per event:
  first {"start": time, "rank": R, "world_size": W}, then {"iter": N} when a DataLoader starts its N-th pass (an
  epoch, or what is left of one), {"batch": [indices]}
  for every batch a DataLoader fetches, {"step": N} after every optimizer step (N counted in this process), so
  that a test can count which samples each step trained on, and how many steps a killed process finished.
  With DDP_EXAMPLES_PROBE_STEP_DELAY=S, each optimizer step also sleeps S seconds: the pace of a larger model, so
  that a test can act between two steps of a script that would otherwise finish in a blink.
  With DDP_EXAMPLES_PROBE_STOP_AT=R:C:N[,R:C:N...], the process of rank R in restart round C stops itself
  (SIGSTOP) right after its N-th step, so that a test can kill it at exactly that step: waiting for the step
  count from outside races a small model, which can finish the run between two looks (seen: one rank finished
  78 steps before the test's SIGKILL landed). Each stop happens once in the job: the first process to reach
  it leaves DIR/stopped-R-C-N, and a later process with the same rank and round (an elastic join, a requeued
  job) goes on.
- DDP_EXAMPLES_HOLD=MODULE:DIR[:N]: a worker that torchrun started (LOCAL_RANK set: not torchft_lighthouse, a Python
  program too) waits right after its `import MODULE` until the file DIR/go exists or, with N, until N workers have
  come that far (each leaves DIR/arrived-<pid>); at most 10 minutes. So a test can start a torchft group with the
  others, its imports (seconds on a busy machine) running beside their training, and have it join at the point the
  test chooses (DIR/go), or have groups started together join together (N). Started late instead, a group joins
  after its whole start-up: a race with the others' remaining steps (seen: 16 s of 26).
- DDP_EXAMPLES_PROBE_STALL=HOW:R:N: rank R stalls in language_model's DecoderLayer.forward, the first call after
  its N-th optimizer step (tests/test_diagnose_parallel.py, a hang for torchdiagnose to name): the first layer the
  rank runs of that step (tensor parallelism: layers.0, whose attention all-gathers its input from the other rank
  first; a pipeline stage: its first layer, for the step's first micro-batch), once the layer's input has arrived
  (an input still in flight, as DTensor's AsyncCollectiveTensor, is waited for first: else a stopped rank's stall
  races its last collective, which the other rank may then wait in). HOW=sleep (its Python waits in the forward),
  stop (it SIGSTOPs itself), kill (it SIGKILLs itself), skip (it leaves the layer out, and its collectives),
  backward (it sleeps in the backward of that call: when the gradient of the layer's output has come). It prints
  "rank R: stall HOW" first.
- DDP_EXAMPLES_PROBE_KILL_IN_SAVE=R:FOLDER: rank R, when DCP writes a file into a folder named FOLDER (a
  checkpoint's staging folder, epoch_000004.tmp), writes half a file ("half a shard, written by <thread>") and
  SIGKILLs itself: a real death in the middle of a save, in whichever thread saves.
- DDP_EXAMPLES_PROBE_REPLICAS=DIR: when the default group is destroyed, each rank saves what it trained with to
  DIR/rank<R>.pt: the weights of the model it wrapped in DDP, and the state of its optimizer (under
  ZeroRedundancyOptimizer, the local optimizer of the rank's shard), so that a test can compare the ranks'
  replicas itself. Neither holds the process group, so keeping them until then changes nothing.
"""
import importlib.abc
import importlib.util
import os
import signal
import sys
import time

MARKER = "ddp-examples-probe: the process group outlived destroy_process_group"
COLLECTIVES = "ddp-examples-count:"


def gloo_worker_threads():
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                count += f.read().startswith("pt_gloo_runloop")
        except OSError:  # the thread ended meanwhile
            pass
    return count


def say(line):
    """One line to stderr in one write: the ranks share torchrun's stderr, and print() under PYTHONUNBUFFERED
    writes the text and its newline separately, so two ranks' lines could run into one (seen once)."""
    sys.stderr.flush()
    os.write(2, (line + "\n").encode())


def patch_c10d(module):
    destroy = module.destroy_process_group

    def checked(group=None):
        if group is None and os.environ.get("DDP_EXAMPLES_PROBE_COLLECTIVES") and module.is_initialized():
            issued = module._get_default_group()._get_sequence_number_for_group()
            say(f"{COLLECTIVES} rank {module.get_rank()} issued {issued} collectives")
        if group is None and os.environ.get("DDP_EXAMPLES_PROBE_REPLICAS") and module.is_initialized():
            save_replica(module.get_rank())
        destroy(group)
        left = gloo_worker_threads()
        if group is None and left:
            say(f"{MARKER} ({left} gloo worker threads still run: something holds the group)")

    module.destroy_process_group = checked


_replicas = {}  # "model": the module this rank wrapped in DDP, "optimizer": its (local) optimizer


def patch_ddp(module):
    init = module.DistributedDataParallel.__init__

    def keep_module(self, wrapped, *args, **kwargs):
        init(self, wrapped, *args, **kwargs)
        _replicas["model"] = wrapped

    module.DistributedDataParallel.__init__ = keep_module


def patch_optimizer(module):
    init = module.Optimizer.__init__

    def keep_optimizer(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if type(self).__name__ != "ZeroRedundancyOptimizer":  # it holds the group; its local optimizer does not
            _replicas["optimizer"] = self

    module.Optimizer.__init__ = keep_optimizer


def save_replica(rank):
    import torch
    state = {"model": _replicas["model"].state_dict(), "optimizer": _replicas["optimizer"].state_dict()}
    torch.save(state, os.path.join(os.environ["DDP_EXAMPLES_PROBE_REPLICAS"], f"rank{rank}.pt"))


_events = None


def event(record):
    global _events
    if _events is None:
        name = (f"rank{os.environ.get('RANK', 0)}-restart{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}-"
                f"{os.getpid()}.jsonl")
        _events = open(os.path.join(os.environ["DDP_EXAMPLES_PROBE_SAMPLES"], name), "a", buffering=1)
        import json
        import time
        _events.write(json.dumps({"start": time.time(), "rank": int(os.environ.get("RANK", 0)),
                                  "world_size": int(os.environ.get("WORLD_SIZE", 1))}) + "\n")
    import json
    _events.write(json.dumps(record) + "\n")


def patch_fetch(module):
    fetch = module._MapDatasetFetcher.fetch

    def logged_fetch(self, possibly_batched_index):
        index = possibly_batched_index
        event({"batch": [int(i) for i in index] if isinstance(index, list) else index})
        return fetch(self, possibly_batched_index)

    module._MapDatasetFetcher.fetch = logged_fetch


def patch_dataloader(module):
    iterate = module.DataLoader.__iter__
    passes = [0]

    def logged_iter(self):
        passes[0] += 1
        event({"iter": passes[0]})
        return iterate(self)

    module.DataLoader.__iter__ = logged_iter


def first_to_stop(step):
    """Whether this process is the job's first to reach this stop (DDP_EXAMPLES_PROBE_STOP_AT)."""
    rank, restart = os.environ.get("RANK", "0"), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    try:
        os.close(os.open(os.path.join(os.environ["DDP_EXAMPLES_PROBE_SAMPLES"], f"stopped-{rank}-{restart}-{step}"),
                         os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def patch_steps(module):
    steps = [0]

    here = (os.environ.get("RANK", "0"), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    stops = {int(n) for r, c, n in (stop.split(":") for stop in os.environ.get("DDP_EXAMPLES_PROBE_STOP_AT", "")
                                    .split(",") if stop) if (r, c) == here}

    def count(optimizer, args, kwargs):
        if type(optimizer).__name__ != "ZeroRedundancyOptimizer":  # its local optimizer's step counts
            steps[0] += 1
            event({"step": steps[0]})
            time.sleep(float(os.environ.get("DDP_EXAMPLES_PROBE_STEP_DELAY", "0")))
            if steps[0] in stops and first_to_stop(steps[0]):
                os.kill(os.getpid(), signal.SIGSTOP)

    module.register_optimizer_step_post_hook(count)


def patch_optim(module):
    if os.environ.get("DDP_EXAMPLES_PROBE_REPLICAS"):
        patch_optimizer(module)
    if os.environ.get("DDP_EXAMPLES_PROBE_SAMPLES"):
        patch_steps(module)


def patch_trainer(module):
    train = module.Trainer.train

    def train_and_keep_weights(self, *args, **kwargs):
        result = train(self, *args, **kwargs)
        import torch
        rank = int(os.environ.get("RANK", 0))
        torch.save(self.model.state_dict(), os.path.join(os.environ["DDP_EXAMPLES_PROBE_WEIGHTS"], f"rank{rank}.pt"))
        return result

    module.Trainer.train = train_and_keep_weights


def patch_torch(module):
    gpus = int(os.environ["DDP_EXAMPLES_PROBE_FAKE_GPUS"])
    module.cuda.is_available = lambda: True
    module.accelerator.device_count = lambda: gpus
    module.accelerator.current_accelerator = lambda *args, **kwargs: module.device("cuda")
    module.distributed.is_nccl_available = lambda: True


def patch_mps(module):
    module.accelerator.current_accelerator = lambda *args, **kwargs: module.device("mps")
    module.accelerator.device_count = lambda: 1
    module.backends.mps.is_available = lambda: True


def patch_stall(module):
    """DDP_EXAMPLES_PROBE_STALL: wrap DecoderLayer.forward so that the chosen rank stalls once, in the first layer
    it runs after its N-th step."""
    from torch.optim.optimizer import register_optimizer_step_post_hook
    how, rank, step = os.environ["DDP_EXAMPLES_PROBE_STALL"].split(":")
    forward = module.DecoderLayer.forward
    steps = [0]

    def count(optimizer, args, kwargs):
        steps[0] += 1

    register_optimizer_step_post_hook(count)  # every optimizer's

    def forward_or_stall(self, x):
        if steps[0] != int(step) or os.environ.get("RANK") != rank:
            return forward(self, x)
        steps[0] = -1  # once
        if hasattr(x, "trigger_wait"):  # the input still in flight (tensor parallelism: the embedding's
            x.trigger_wait()  # reduce-scatter, waited on at its first use): finish it, as the layer's first op would
        say(f"rank {rank}: stall {how}")
        if how in ("stop", "kill"):
            os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)
        if how == "skip":  # the layer left out, and with it its collectives: the rank goes on to the next layer's
            return x
        if how == "backward":
            out = forward(self, x)
            out.register_hook(lambda grad: time.sleep(3600))  # the backward stall
            return out
        time.sleep(3600)  # the forward stall
        return forward(self, x)

    module.DecoderLayer.forward = forward_or_stall


def hold(module):
    """DDP_EXAMPLES_HOLD: wait after the import, until DIR/go exists or N workers have arrived."""
    _, directory, *count = os.environ["DDP_EXAMPLES_HOLD"].split(":")
    open(os.path.join(directory, f"arrived-{os.getpid()}"), "w").close()
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        names = os.listdir(directory)
        if "go" in names or (count and sum(n.startswith("arrived-") for n in names) >= int(count[0])):
            return
        time.sleep(0.05)


def patch_kill_in_save(filesystem):
    rank, folder = os.environ["DDP_EXAMPLES_PROBE_KILL_IN_SAVE"].split(":")
    write_item = filesystem._write_item

    def dying_write(transforms, stream, *args):
        if os.environ.get("RANK") == rank and os.path.basename(os.path.dirname(stream.name)) == folder:
            import threading
            stream.write(f"half a shard, written by {threading.current_thread().name}".encode())
            stream.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return write_item(transforms, stream, *args)

    filesystem._write_item = dying_write


PATCHES = {"torch.distributed.distributed_c10d": patch_c10d}
if os.environ.get("DDP_EXAMPLES_PROBE_WEIGHTS"):
    PATCHES["transformers.trainer"] = patch_trainer
if os.environ.get("DDP_EXAMPLES_PROBE_REPLICAS"):
    PATCHES["torch.nn.parallel.distributed"] = patch_ddp
if os.environ.get("DDP_EXAMPLES_PROBE_REPLICAS") or os.environ.get("DDP_EXAMPLES_PROBE_SAMPLES"):
    PATCHES["torch.optim.optimizer"] = patch_optim
if os.environ.get("DDP_EXAMPLES_PROBE_SAMPLES"):
    PATCHES["torch.utils.data._utils.fetch"] = patch_fetch
    PATCHES["torch.utils.data.dataloader"] = patch_dataloader
if os.environ.get("DDP_EXAMPLES_PROBE_FAKE_GPUS"):
    PATCHES["torch"] = patch_torch
if os.environ.get("DDP_EXAMPLES_PROBE_FAKE_MPS"):
    PATCHES["torch"] = patch_mps
if os.environ.get("DDP_EXAMPLES_PROBE_KILL_IN_SAVE"):
    PATCHES["torch.distributed.checkpoint.filesystem"] = patch_kill_in_save
if os.environ.get("DDP_EXAMPLES_PROBE_STALL"):
    PATCHES["language_model"] = patch_stall
if os.environ.get("DDP_EXAMPLES_HOLD") and "LOCAL_RANK" in os.environ:
    PATCHES[os.environ["DDP_EXAMPLES_HOLD"].split(":")[0]] = hold


class PatchAfterImport(importlib.abc.MetaPathFinder):
    """Runs PATCHES[name](module) right after module `name` has been imported."""

    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        patch = PATCHES.pop(name)
        sys.meta_path.remove(self)  # find the real module, not ourselves
        try:
            spec = importlib.util.find_spec(name)
        finally:
            if PATCHES:
                sys.meta_path.insert(0, self)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            if name == "torch":  # torch.distributed is imported at the end of torch's own import
                import torch.distributed  # noqa: F401
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


if sys.platform.startswith("linux"):
    sys.meta_path.insert(0, PatchAfterImport())
