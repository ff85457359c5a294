"""DDP communication hooks by name (scaling.py's --comm_hook) and the bytes each hands to all-reduce per step.

none              DDP's own all-reduce of the fp32 gradient buckets.
fp16              torch's fp16_compress_hook: the bucket cast to float16 and divided by the world size (the sum is
                  then the mean, within float16's range), all-reduced, cast back. Half the bytes; float16 keeps
                  11 bits of mantissa.
bf16              the same with bfloat16 (8 bits of mantissa, float32's exponent range). torch's
                  bf16_compress_hook cannot be registered without NCCL 2.10+: DDP refuses it by its name
                  ("requires CUDA 11+ and NCCL 2.10+"), although gloo all-reduces bfloat16 fine. This module's
                  bf16_hook is the same hook under another name.
powersgd          torch's powerSGD_hook: each gradient matrix M (n x m) is sent as two rank-r factors, P = MQ
                  and Q = M^T P, (n + m) r numbers instead of n m; vectors (biases) go uncompressed. Plain
                  all-reduce for the first --powersgd_warmup steps. What compression leaves out of a step
                  (error feedback) is added to the next step's gradient, and Q starts from the previous step's.
batched_powersgd  refused: torch's batched_powerSGD_hook fails on its first compressed step with an
                  AssertionError (it hands one matrix to _orthogonalize, which asserts a batch of them).
"""
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

from benchmarks.common import UsageError, positive_int

HOOKS = ("none", "fp16", "bf16", "powersgd", "batched_powersgd")
BYTES_PER_ELEMENT = {"none": 4, "fp16": 2, "bf16": 2, "powersgd": 4}


def bf16_hook(process_group, bucket):
    """torch's bf16_compress_hook under a name DDP does not refuse: average in bfloat16, cast back in place."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(group.size())

    def decompress(future):
        buffer.copy_(future.value()[0])
        return buffer

    return dist.all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)


def add_args(parser):
    """--comm_hook (a list of hooks to compare) and PowerSGD's settings."""
    parser.add_argument("--comm_hook", choices=HOOKS, nargs="+", default=["none"],
                        help="what DDP sends per step: none (fp32 gradients), fp16 or bf16 (gradients cast to "
                             "16 bits), powersgd (low-rank factors of each gradient matrix); default none")
    parser.add_argument("--powersgd_rank", type=positive_int, default=1,
                        help="powersgd: rank of the factors; higher sends more and keeps more (default 1)")
    parser.add_argument("--powersgd_warmup", type=positive_int, default=10,
                        help="powersgd: plain all-reduce steps before compressing, at least 2 (default 10)")


def check(name, powersgd_warmup):
    """A UsageError for what cannot run, before any process starts."""
    if name == "batched_powersgd":
        raise UsageError("--comm_hook batched_powersgd: torch's batched_powerSGD_hook fails on its first "
                         "compressed step (AssertionError in _orthogonalize, which expects a batch of matrices and is "
                         "handed one); use --comm_hook powersgd, which compresses each gradient matrix on its own")
    if name == "powersgd" and powersgd_warmup < 2:
        raise UsageError(f"--powersgd_warmup {powersgd_warmup}: PowerSGD needs at least 2 plain steps first, because "
                         "DDP rebuilds its gradient buckets after the first step and the hook's state follows them")


class CommHook:
    """The communication hook of one DDP model: prepares it and counts what it hands to all-reduce."""

    def __init__(self, name, powersgd_rank=1, powersgd_warmup=10):
        check(name, powersgd_warmup)
        self.name = name
        self.powersgd = None
        if name == "powersgd":
            # min_compression_rate 1: compress every matrix whose factors are smaller than itself (torch's default,
            # 2, would send the linear classifier's 2 x 100 weight uncompressed).
            self.powersgd = PowerSGDState(None, matrix_approximation_rank=powersgd_rank,
                                          start_powerSGD_iter=powersgd_warmup, min_compression_rate=1)
        self.step_bytes = 0
        self.last_step_bytes = 0
        self.in_flight = None  # PowerSGD: the previous bucket's future (see counted_hook)

    def prepare(self, model):
        """(state, hook) for the DDP `model`'s register_comm_hook, or None for none: DDP's built-in all-reduce,
        which runs in C++, needs no hook."""
        self.full_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        if self.name == "none":
            self.last_step_bytes = self.full_bytes
            return None
        self.hook = {"fp16": fp16_compress_hook, "bf16": bf16_hook, "powersgd": powerSGD_hook}[self.name]
        if self.powersgd is not None:
            # PowerSGD's state (error feedback, factors) is laid out as DDP's gradient buckets are, and DDP lays
            # them out anew after the first step. Fix the layout now, in parameter order, for good (what Join does
            # for a rank that joins; private API): the layout of the results in benchmarks/results.
            model.reducer._push_all_rebuilt_params()
            model.reducer._rebuild_buckets()
        return self.powersgd, self.counted_hook

    def counted_hook(self, state, bucket):
        """The hook, counting the bytes it hands to all-reduce: the bucket in the hook's dtype, or for a
        compressing PowerSGD step the numbers PowerSGD itself counts (factors and uncompressed tensors)."""
        compressing = self.powersgd is not None and self.powersgd.iter >= self.powersgd.start_powerSGD_iter
        before = self.powersgd.total_numel_after_compression if compressing else 0
        if compressing and self.in_flight is not None:
            # torch's powerSGD_hook all-reduces P and .wait()s for it inside a callback, which runs on one of
            # gloo's two worker threads. Two buckets compressing at once block both threads, and the all-reduces
            # they wait for never run (measured: SimpleCNN's two buckets hang on gloo, at 1 rank too). So one
            # bucket at a time: the backward pass waits here until the previous bucket's all-reduces are done.
            self.in_flight.wait()
        future = self.hook(state, bucket)
        self.in_flight = future if compressing and not bucket.is_last() else None
        if compressing:
            elements = self.powersgd.total_numel_after_compression - before
        else:
            elements = bucket.buffer().numel()
        self.step_bytes += elements * BYTES_PER_ELEMENT[self.name]
        if bucket.is_last():
            self.last_step_bytes, self.step_bytes = self.step_bytes, 0
        return future

    def bytes_per_step(self):
        """What this rank handed to all-reduce in its last synchronising step (after warm-up: compressed)."""
        return self.last_step_bytes
