"""Plan a job on a laptop: one rank's memory, bytes and FLOPs in a training step of nd_parallel.py, for any layout
of up to thousands of GPUs, traced in one CPU process without a GPU or a network.

    python plan.py --world_size 8 --dp_shard 2 --tp 2 --pp 2 --rank 7                      # the steps' decoder
    python plan.py --model llama3-8b --world_size 512 --dp_shard 64 --tp 8 --seq_len 8192 --global_batch_size 512
    python plan.py --model llama3-70b --world_size 8192 --dp_shard 128 --tp 8 --pp 8 --microbatches 16 \\
        --seq_len 8192 --global_batch_size 2048
    python plan.py --search --model llama3-8b --gpus 64 --gpu_flops 312e12 --seq_len 8192 --global_batch_size 64

It builds what nd_parallel.py builds for one rank of --world_size (its mesh, stages, apply_tp and apply_fsdp,
imported from it) with a fake process group (torch's "fake" backend: every collective returns at once) and fake
tensors (FakeTensorMode: shapes and dtypes, no data), then runs that rank's part of one step: the forward and
backward of each micro-batch of its stage(s) in the order its pipeline schedule gives it (the schedule's own action
list; the stage's own forward, backward and gradient-reduce methods), settle_grads and AdamW's step. It prints the
rank's parameters, gradients and optimizer state, the peak memory and its parts (FSDPMemTracker, or MemTracker
without FSDP), every collective with its mesh dimension and the bytes it puts on the wire, and the step's FLOPs
(FlopCounterMode). A pipeline's sends are not collectives: they are counted from the stage's output and input
shapes. --search traces each layout of --gpus and ranks those that fit by an estimated step time, its assumptions
printed. docs/plan.md compares the figures with real runs.
"""
import argparse
import contextlib
import sys
import time
from collections import defaultdict
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.distributed.tensor._redistribute import _gen_transform_infos, clear_redistribute_planner_cache
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.testing._internal.distributed.fake_pg import FakeStore  # also registers the "fake" backend
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.flop_counter import flop_registry

from language_model import Decoder, DecoderConfig
from nd_parallel import (LOOPED, SCHEDULES, V_SHAPED, apply_fsdp, apply_tp, build_stage, check_model, positive_int,
                         settle_grads, stage_indices)

# The layouts the planner plans: nd_parallel.py's mesh without cp (context parallelism is not planned yet).
DIMS = ("pp", "dp_replicate", "dp_shard", "tp")

# Llama 3's shapes (Meta's config.json of Llama-3.1-8B and -70B): the decoder of steps 6 to 8 at their sizes.
MODELS = {
    "steps": DecoderConfig(),
    "llama3-8b": DecoderConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, hidden=14336,
                               rope_theta=500000.0),
    "llama3-70b": DecoderConfig(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, hidden=28672,
                                rope_theta=500000.0),
}
GiB = 1024 ** 3
# gloo's framing, as benchmarks/parallel_bytes.py counts it on the sockets (docs/parallel-measured.md): each message
# of a ring's step 288 bytes of headers and notifications beside the data (576 an all-reduce of 2 ranks, 288 an
# all-gather), each pipeline send 144.
GLOO_FRAMING, GLOO_SEND = 288, 144
aten, c10d, functional = torch.ops.aten, torch.ops.c10d, torch.ops._c10d_functional
# Each collective: its kind, the argument whose bytes count (an all-gather's input: this rank's part) and the
# argument that names its group.
COLLECTIVES = {
    functional.all_gather_into_tensor.default: ("all-gather", 0, 2),
    functional.reduce_scatter_tensor.default: ("reduce-scatter", 0, 3),
    functional.all_reduce.default: ("all-reduce", 0, 2),
    c10d._allgather_base_.default: ("all-gather", 1, 2),
    c10d._reduce_scatter_base_.default: ("reduce-scatter", 1, 2),
    c10d.allreduce_.default: ("all-reduce", 0, 1),
}
# FlopCounterMode's formulas, and the CPU's attention kernel (its arguments are those of the GPU's, in order).
FLOPS = {**flop_registry, aten._scaled_dot_product_flash_attention_for_cpu: flop_registry[
    aten._scaled_dot_product_flash_attention], aten._scaled_dot_product_flash_attention_for_cpu_backward:
    flop_registry[aten._scaled_dot_product_flash_attention_backward]}


def wire_bytes(kind, size, n, backend):
    """Bytes one rank of n sends for a collective on a tensor of `size` bytes (an all-gather's: each rank's part),
    by a ring: an all-gather (n-1) parts, an all-reduce 2(n-1)/n of the tensor, a reduce-scatter (n-1)/n of it with
    NCCL, 2(n-1)/n with gloo (which reduces it whole, then keeps a part: benchmarks/parallel_bytes.py measured it)."""
    if kind == "all-gather":
        return (n - 1) * size
    if kind == "all-reduce" or backend == "gloo":
        return 2 * (n - 1) / n * size
    return (n - 1) / n * size


class Step(TorchDispatchMode):
    """What one rank computes and sends: the FLOPs of its matrix products and attention (FlopCounterMode's
    formulas), and every collective with its process group and the bytes of its tensor. Like torch's trackers, it
    lets a DTensor op pass (NotImplemented) and counts the local ops that DTensor turns it into: the rank's own."""

    def __init__(self):
        super().__init__()
        self.flops = defaultdict(int)  # {micro-batch (None: outside them): FLOPs}
        self.calls = []  # (kind, group name, bytes of the tensor, micro-batch)
        self.microbatch = None  # the one whose forward or backward runs now

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if func in COLLECTIVES:
            kind, tensor, group = COLLECTIVES[func]
            tensor = args[tensor][0] if isinstance(args[tensor], list) else args[tensor]
            group = args[group]
            name = group if isinstance(group, str) else dist.ProcessGroup.unbox(group).group_name
            self.calls.append((kind, name, tensor.numel() * tensor.element_size(), self.microbatch))
        elif func._overloadpacket in FLOPS:
            self.flops[self.microbatch] += FLOPS[func._overloadpacket](*args, **(kwargs or {}), out_val=out)
        return out


@contextlib.contextmanager
def local_ops_only():
    """DTensor works out each new op's output shape by running it on fake tensors of the global shapes, under the
    modes active then: the trackers would count those as the rank's work and memory. Run that with them off."""
    propagate = ShardingPropagator._propagate_tensor_meta_non_cached

    def without_trackers(self, op_schema):
        with _disable_current_modes():
            return propagate(self, op_schema)

    ShardingPropagator._propagate_tensor_meta_non_cached = without_trackers
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = propagate


def forget_meshes():
    """DTensor caches its sharding decisions by the mesh's shape, with the mesh in them: a second trace in one
    process (a mesh of the same shape, new process groups) would send to the first one's groups. Cleared first."""
    torch._C._clear_DTensor_sharding_propagator_cache()
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    ShardingPropagator._propagate_tensor_meta_cached.cache_clear()
    _gen_transform_infos.cache_clear()
    clear_redistribute_planner_cache()


def mesh_groups(mesh):
    """{process group name: (the mesh dimension it is, its size)} for this rank's mesh."""
    groups = {}
    for name in mesh.mesh_dim_names:
        if mesh[name].size() > 1:
            groups[mesh[name].get_group().group_name] = (name, mesh[name].size())
    return groups


def build(args, mesh):
    """This rank's parts of the model, on the meta device, as nd_parallel.load_train_objs builds them."""
    with torch.device("meta"):
        model = Decoder(args.config)
    total = sum(p.numel() for p in model.parameters())
    indices = stage_indices(mesh["pp"].get_local_rank(), mesh["pp"].size(), args.schedule)
    parts = []
    for index in indices:
        part = Decoder(args.config).to("meta") if len(indices) > 1 and parts else model
        build_stage(part, index, mesh["pp"].size() * len(indices))
        if mesh["tp"].size() > 1:
            apply_tp(part, mesh["tp"])
        if mesh["dp_replicate"].size() * mesh["dp_shard"].size() > 1:
            hsdp = mesh["dp_replicate"].size() > 1
            apply_fsdp(part, mesh, mesh["dp_replicate", "dp_shard"] if hsdp else mesh["dp_shard"])
        parts.append(part)
    return parts, indices, total


def memory_tracker(parts, optimizers):
    """FSDPMemTracker where the rank holds one FSDP2 part (its categories: sharded and unsharded parameters and
    gradients ...), MemTracker otherwise: for the planner, and for a real step (peak_of_step)."""
    if len(parts) == 1 and isinstance(parts[0], FSDPModule):
        return FSDPMemTracker(parts[0], optimizers[0])
    tracker = MemTracker()
    tracker.track_external(*parts, *optimizers)
    return tracker


def peak_of_step(trainer, run):
    """(run()'s result, the peak bytes of the real step it runs; None under a zero-bubble schedule): a Trainer of
    steps 6 to 8 (its parts, optimizers and stages) under memory_tracker, its stages' receive buffers counted, as
    the planner counts them. For benchmarks/parallel_bytes.py, which compares them with the planner's."""
    split = tuple(SCHEDULES[name] for name in ("interleaved_zb", "zbv", "dualpipev"))
    if isinstance(getattr(trainer, "schedule", None), split):  # their backward of the inputs alone (autograd.grad)
        return run(), None  # fails under the tracker's module hooks: not measured
    tracker = memory_tracker(trainer.parts, trainer.optimizers)
    stages = getattr(trainer, "stages", [])  # tensor_parallel.py runs no schedule
    for stage in stages:
        def forward(*args, stage=stage, forward=stage.forward_maybe_with_nosync, **kwargs):
            tracker.memory_tracking.pop(stage.submod, None)  # each micro-batch's forward: as in run_actions
            return forward(*args, **kwargs)
        stage.forward_maybe_with_nosync = forward
    infos = [info for stage in stages for table in (stage.args_recv_info, stage.grad_recv_info)
             for chunk in table.values() for info in chunk]
    try:
        with tracker:
            for info in infos:  # the stages' receive buffers, made in the first step: counted, as by the planner
                if isinstance(getattr(info, "buffer", None), torch.Tensor):
                    info.buffer.detach()  # an op's output: the tracker counts its storage from here on
            result = run()
    finally:
        for stage in stages:
            del stage.forward_maybe_with_nosync  # the class's method again
    return result, next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"]


def local(tensor):
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def trace(args):
    """One step of rank args.rank, traced: a dict of what it holds, sends and computes."""
    start = time.perf_counter()
    forget_meshes()
    store = FakeStore()
    dist.init_process_group("fake", rank=args.rank, world_size=args.world_size, store=store)
    try:
        sizes = (args.pp, args.dp_replicate, args.dp_shard, args.tp)
        mesh = dist.device_mesh.init_device_mesh("cpu", sizes, mesh_dim_names=DIMS)
        parts, indices, total = build(args, mesh)
        stages = args.pp * len(indices)
        dp = args.dp_replicate * args.dp_shard
        m = args.microbatches
        batch = args.global_batch_size // dp // m  # sequences in one micro-batch of this rank
        seq, dim, tp = args.config.max_seq_len, args.config.dim, args.tp
        dtype = torch.float32
        pipeline = [PipelineStage(part, index, stages, torch.device("cpu"), group=mesh["pp"].get_group())
                    for part, index in zip(parts, indices)]
        schedule = SCHEDULES[args.schedule](pipeline if len(parts) > 1 else pipeline[0], n_microbatches=m,
                                            loss_fn=None, scale_grads=False)
        if isinstance(schedule, PipelineScheduleSingle):
            # 1F1B keeps at most `warmup` micro-batches in flight: after warmup + 1 of them, each further one
            # repeats the last one's work and memory (shapes alike). Traced: warmup + 1; the rest added.
            warmup = min(m, stages - indices[0])
            traced = m if args.schedule == "gpipe" or args.every_microbatch else min(m, warmup + 1)
            actions = single_stage_order(args.schedule, indices[0], stages, traced)
        else:  # the action list the schedule itself runs on this rank
            traced = m
            # DualPipeV pairs a forward with a backward (OVERLAP_F_B): each of the pair's actions, in its order.
            actions = [(sub.stage_index, sub.computation_type.value, sub.microbatch_index)
                       for a in schedule.pipeline_order[mesh["pp"].get_local_rank()] if a is not None
                       for sub in (a.sub_actions or (a,))]
        by_index = dict(zip(indices, pipeline))
        step, groups = Step(), mesh_groups(mesh)
        with FakeTensorMode(allow_non_fake_inputs=True):  # the meta tensors become fake ones here, not before
            for part in parts:
                part.to_empty(device="cpu")
            optimizers = [torch.optim.AdamW(part.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
                          for part in parts]
            # A step's optimizer state exists from the second step on: made now by a step on zero gradients, so
            # that the traced step is a steady one (the first's peak lacks the optimizer's 2 x 4 bytes a parameter).
            for part, optimizer in zip(parts, optimizers):
                for p in part.parameters():
                    p.grad = torch.zeros_like(p)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            tokens = torch.zeros(batch, seq, dtype=torch.long)
            hidden = torch.zeros(batch, seq // tp, dim, dtype=dtype)
            tracker = memory_tracker(parts, optimizers)
            with local_ops_only(), tracker, step:
                # A stage's buffers, one a micro-batch, made in its first step and kept (PipelineStage's
                # _prepare_forward_infra and _prepare_backward_infra): the activations it receives (all but the
                # first stage) and the gradients of its output (all but the last).
                inbox = {(s, i): torch.empty_like(hidden) for s in indices if s > 0 for i in range(m)}
                grad_inbox = {(s, i): torch.empty_like(hidden) for s in indices if s < stages - 1 for i in range(m)}
                sends = run_actions(actions, by_index, stages, tokens, (inbox, grad_inbox), dp, args, tracker, step)
                settle_grads(parts)
                for optimizer in optimizers:
                    optimizer.step()
            peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
            held = {"parameters": sum(local(p).numel() * local(p).element_size() for part in parts
                                      for p in part.parameters()),
                    "gradients": sum(local(p.grad).numel() * local(p.grad).element_size() for part in parts
                                     for p in part.parameters() if p.grad is not None),
                    "optimizer": sum(local(v).numel() * local(v).element_size() for optimizer in optimizers
                                     for state in optimizer.state.values() for v in state.values()
                                     if isinstance(v, torch.Tensor))}
    finally:
        dist.destroy_process_group()
    # The micro-batches not traced: each as the last traced one.
    more, last = m - traced, traced - 1
    calls = step.calls + [call for call in step.calls if call[-1] == last] * more
    sends += [send for send in sends if send[-1] == last] * more
    flops = sum(step.flops.values()) + step.flops[last] * more
    return {"parts": parts, "indices": indices, "total": total, "collectives": calls, "traced": traced,
            "groups": groups, "flops": flops, "peak": peak, "actions": actions, "held": held, "sends": sends,
            "microbatch": (batch, seq, dim, tp), "seconds": time.perf_counter() - start, "stages": stages}


def single_stage_order(schedule, stage, stages, m):
    """[(stage, "F" or "B", micro-batch)] as ScheduleGPipe and Schedule1F1B's _step_microbatches run them: GPipe
    every forward, then every backward; 1F1B stages - stage forwards first, then a backward and a forward in turn."""
    if schedule == "gpipe":
        return [(stage, "F", i) for i in range(m)] + [(stage, "B", i) for i in range(m)]
    warmup = min(m, stages - stage)
    order = [(stage, "F", i) for i in range(warmup)]
    for i in range(m):
        order.append((stage, "B", i))
        if warmup + i < m:
            order.append((stage, "F", warmup + i))
    return order


def run_actions(actions, by_index, stages, tokens, inboxes, dp, args, tracker, step):
    """The rank's actions of one step, each by the stage's own methods: forward of a micro-batch, its backward
    (full, or input then weight), and at the end the reduction of the gradients (FSDP's reduce-scatter)."""
    kept = {}  # (stage, micro-batch): (its inputs, its output)
    sends = []  # (to stage, bytes): what the pipeline sends, where the stage is on another rank
    inbox, grad_inbox = inboxes  # the stages' receive buffers
    for stage_index, action, i in actions:
        stage = by_index[stage_index]
        step.microbatch = i
        if action == "F":
            # The trackers keep figures per module and take a second forward of a root module for a second step:
            # each micro-batch's forward starts the root's figures afresh (the peak, kept apart, stays).
            tracker.memory_tracking.pop(stage.submod, None)
            inputs = tokens if stage_index == 0 else inbox[stage_index, i].detach().requires_grad_()
            output = stage.forward_maybe_with_nosync(inputs)
            kept[stage_index, i] = (inputs, output, output)  # the stage keeps its output to the backward (fwd_cache)
            if stage_index == stages - 1:
                with loss_parallel():
                    total = args.global_batch_size * args.config.max_seq_len
                    loss = F.cross_entropy(output.flatten(0, 1), tokens.flatten(), reduction="sum") * dp / total
                kept[stage_index, i] = (inputs, loss, output)
            if stage_index < stages - 1:  # the activation, to the next stage
                sends.append((stage_index + 1, local(output).numel() * local(output).element_size(), i))
        elif action in ("B", "I"):  # W, the weights' part of a zero-bubble backward, is done here with the rest
            inputs, output, _ = kept.pop((stage_index, i))
            grads = grad_inbox.get((stage_index, i))  # None on the last stage: the loss starts the backward
            with loss_parallel():
                stage.backward_maybe_with_nosync("full", {"stage_output": output, "output_grads": grads,
                                                          "input_values": [inputs] if stage_index else []})
            if stage_index > 0:  # the gradient of its input, to the stage before
                sends.append((stage_index - 1, inputs.numel() * inputs.element_size(), i))
    step.microbatch = None
    for stage in by_index.values():
        stage.perform_reduce_grad(1)
    return [(to, size, i) for to, size, i in sends if to not in by_index]


def traffic(result, backend):
    """[(kind, mesh dimension, ranks, calls, bytes of the tensors, bytes sent)] of one rank's step: collectives by
    the ring's counts, pipeline sends as they are; with gloo, its framing too (GLOO_FRAMING, GLOO_SEND)."""
    rows = defaultdict(lambda: [0, 0, 0.0])
    for kind, name, size, _ in result["collectives"]:
        dim, n = result["groups"].get(name, (name, 1))
        row = rows[kind, dim, n]
        row[0] += 1
        row[1] += size
        steps = (n - 1) * (1 if kind == "all-gather" else 2)  # a ring's steps: each sends one message
        row[2] += wire_bytes(kind, size, n, backend) + (GLOO_FRAMING * steps if backend == "gloo" else 0)
    for _, size, _ in result["sends"]:
        row = rows["send", "pp", 2]
        row[0] += 1
        row[1] += size
        row[2] += size + (GLOO_SEND if backend == "gloo" else 0)
    return [(kind, dim, n, *values) for (kind, dim, n), values in rows.items()]


def gib(size):
    return f"{size / GiB:.3f} GiB" if size >= GiB / 100 else f"{size / 1024 ** 2:.3f} MiB"


def summary(args, result):
    """What the rank holds, its peak memory, what it sends and computes in a step, as lines."""
    c, m = args.config, args.microbatches
    dp = args.dp_replicate * args.dp_shard
    layout = " x ".join(f"{name} {size}" for name, size in zip(DIMS, (args.pp, args.dp_replicate, args.dp_shard,
                                                                       args.tp)))
    held, peak = result["held"], result["peak"]
    stages = ", ".join(map(str, result["indices"]))
    lines = [f"Plan: {args.model} (dim {c.dim}, {c.n_layers} layers, {c.n_heads} heads, {c.n_kv_heads} key/value "
             f"heads, MLP {c.hidden}, vocabulary {c.vocab_size}: {result['total']:,} parameters) | rank "
             f"{args.rank} of {args.world_size} | mesh {layout} | {args.global_batch_size // dp} sequences of "
             f"{c.max_seq_len} a data-parallel rank, in {m} micro-batch{'es' * (m > 1)} | float32, AdamW",
             f"Method: nd_parallel.py's step of this rank traced in {result['seconds']:.1f}s with a fake process "
             f"group and fake tensors: stage{'s' * (len(result['indices']) > 1)} {stages} of {result['stages']}, "
             f"each micro-batch's forward and backward in {args.schedule}'s order on this rank (a zero-bubble "
             "schedule's weight gradients with the rest), then the gradients reduced and AdamW's step; pipeline "
             "sends from the stages' shapes (they are not collectives)" + (
                 f"; {result['traced']} of the {m} micro-batches traced, the other {m - result['traced']} added as "
                 "copies of the last (1F1B holds no more in flight after the first ones: the same work, bytes and "
                 "peak)" if result["traced"] < m else ""),
             f"Holds: parameters {gib(held['parameters'])}, gradients {gib(held['gradients'])}, AdamW state "
             f"{gib(held['optimizer'])} (of the whole model's {gib(4 * result['total'])} of parameters)",
             f"Peak memory: {gib(peak.get('Total', 0))} = " + ", ".join(
                 f"{str(getattr(kind, 'value', kind)).lower()} {gib(size)}" for kind, size in peak.items()
                 if kind != "Total" and size) + " (FSDPMemTracker, or MemTracker without FSDP; no allocator's "
             "rounding or fragmentation, no communication buffers of the backend, no CUDA context)"]
    rows = traffic(result, args.backend)
    lines.append(f"Sent a step, by this rank ({args.backend}: " + (
        "a ring; reduce-scatter sends 2(n-1)/n of its tensor, as an all-reduce, plus gloo's framing)"
        if args.backend == "gloo" else "a ring; all-gather (n-1)/n of the output, reduce-scatter (n-1)/n of the "
        "input, all-reduce 2(n-1)/n)"))
    for kind, dim, n, calls, size, sent in sorted(rows, key=lambda row: -row[-1]):
        lines.append(f"  {kind:<15} over {dim:<12} ({n:>5} ranks) | {calls:>4} calls | tensors {size:>16,} bytes | "
                     f"sent {sent:>16,.0f} bytes")
    lines.append(f"  total sent {sum(row[-1] for row in rows):,.0f} bytes")
    tokens = args.global_batch_size // dp * c.max_seq_len
    lines.append(f"FLOPs: {result['flops']:.4g} a step on this rank ({result['flops'] / tokens:,.0f} a token of its "
                 "data-parallel part; matrix products and attention, causal attention counted whole as "
                 "FlopCounterMode does)")
    return lines


# A published configuration beside the search's rows: torchtitan's Llama 3 8B on 64 A100s of 80 GB, FSDP2 over
# all 64, local batch 1 of 8,192 tokens, bf16 mixed precision, selective activation checkpointing: 2,904 tokens/s a
# GPU, MFU 56.8% (github.com/pytorch/torchtitan, docs/performance.md, "Llama 3 performance numbers").
PUBLISHED = {"llama3-8b": ("torchtitan, docs/performance.md: 64 A100 80GB, FSDP2 64, batch 1 x 8192, bf16, selective "
                           "AC: 2,904 tokens/s a GPU, so 2.82 s a step", 64, (1, 1, 64, 1), 8192, 64, 8192 / 2904)}


def inside_node(dim, layout, per_node):
    """Whether a group of mesh dimension `dim` lies in one node: ranks are numbered node by node, the mesh
    pp x dp_replicate x dp_shard x tp row-major (tp's ranks neighbours)."""
    sizes = dict(zip(DIMS, layout))
    stride = 1
    for name in reversed(DIMS):
        if name == dim:
            return stride * sizes[name] <= per_node
        stride *= sizes[name]
    return False


def estimate(result, args, layout, m):
    """(step seconds, its parts) of a traced rank, by the search's stated model (assumptions())."""
    compute = result["flops"] / (args.gpu_flops * args.utilization)
    exposed = overlapped = 0.0
    for _, dim, _, _, _, sent in traffic(result, "nccl"):
        link = args.intra_node if inside_node(dim, layout, args.gpus_per_node) else args.inter_node
        if dim in ("dp_shard", "dp_replicate"):
            overlapped += sent / link
        else:
            exposed += sent / link
    pp = layout[0]
    busy = compute + exposed
    bubble = busy * (pp - 1) / m
    return max(busy + bubble, overlapped), {"compute": compute, "tp and pp": exposed, "bubble": bubble,
                                           "FSDP": overlapped}


def assumptions(args):
    return [f"Search: {args.model}, {args.gpus:,} GPUs of {args.gpu_memory:g} GiB, {args.gpus_per_node} a node; "
            f"global batch {args.global_batch_size} x {args.seq_len} tokens; float32 weights, AdamW, no activation "
            "checkpointing (what nd_parallel.py runs)",
            "Assumed: a layout fits where the traced peak is at most the GPU's memory less "
            f"{100 * args.reserve:g}% (CUDA context, NCCL's buffers, the allocator's fragmentation); compute at "
            f"{100 * args.utilization:g}% of {args.gpu_flops:.3g} FLOP/s; each collective a ring at "
            f"{args.intra_node:.3g} bytes/s a GPU inside a node, {args.inter_node:.3g} between nodes (a group whose "
            "ranks span nodes at the slower); NCCL's byte counts (reduce-scatter (n-1)/n)",
            "Assumed: FSDP's and HSDP's gathers and reductions overlap the compute (FSDP2 prefetches); TP's and the "
            "pipeline's do not (no async TP); a pipeline idles (p-1)/m of its busy time (1F1B's bubble); step = "
            "max(compute + TP + pipeline + bubble, FSDP)",
            "Method: each layout traced (rank 0, and for a pipeline the last stage's first rank too: the larger "
            "peak and the longer step), one micro-batch a sequence under a pipeline; layouts where tp divides the "
            "heads and the node, pp (up to 8) the layers, in powers of 2; no layout scaled from another's trace"]


def layouts(args):
    """(pp, dp_replicate, dp_shard, tp, micro-batches) to try on args.gpus."""
    c = args.config
    found = []
    tp = 1
    while tp <= min(args.gpus_per_node, args.gpus):
        if not any(size % tp for size in (c.n_heads, c.n_kv_heads, c.hidden, c.vocab_size, args.seq_len)):
            pp = 1
            while pp <= min(c.n_layers, 8) and tp * pp <= args.gpus:  # deeper pipelines: ask for them by hand
                dp = args.gpus // (tp * pp)
                local = args.global_batch_size // dp if args.global_batch_size % dp == 0 else 0
                m = 1 if pp == 1 else local
                if dp * tp * pp == args.gpus and local and local % m == 0 and m >= pp:
                    found.append((pp, 1, dp, tp, m))
                    shard = args.gpus_per_node // tp  # HSDP: sharded inside a node, replicated across nodes
                    if pp == 1 and 1 < shard < dp and dp % shard == 0:
                        found.append((pp, dp // shard, shard, tp, m))
                pp *= 2
        tp *= 2
    return found


def search(args):
    """The layouts that fit, fastest first, with the assumptions and the published configuration."""
    lines = assumptions(args)
    rows = []
    published = PUBLISHED.get(args.model)
    if published and (published[1:2] + published[3:5] != (args.gpus, args.seq_len, args.global_batch_size) or
                      replace(args.config, max_seq_len=MODELS[args.model].max_seq_len) != MODELS[args.model]):
        published = None  # another job or model than the published one
    tried = layouts(args)
    if published:
        tried.append((*published[2], 1))
    for layout in dict.fromkeys(tried):
        pp, replicate, shard, tp, m = layout
        ranks = [0] + ([args.gpus - args.gpus // pp] if pp > 1 else [])
        peak, step, parts = 0, 0, None
        for rank in ranks:
            one = argparse.Namespace(**{**vars(args), "world_size": args.gpus, "pp": pp, "dp_replicate": replicate,
                                        "dp_shard": shard, "tp": tp, "microbatches": m, "rank": rank,
                                        "schedule": "1f1b", "every_microbatch": False})
            result = trace(one)
            seconds, split = estimate(result, args, layout[:4], m)
            peak = max(peak, result["peak"]["Total"])
            if seconds > step:
                step, parts = seconds, split
        print(f"traced pp {pp} x dp_replicate {replicate} x dp_shard {shard} x tp {tp}: peak {gib(peak)}, "
              f"step {step:.3g} s", file=sys.stderr, flush=True)
        rows.append((layout, peak, step, parts))
    fits = args.gpu_memory * GiB * (1 - args.reserve)
    tokens = args.global_batch_size * args.seq_len
    lines.append(f"{'rank':>4} | {'pp x dp_replicate x dp_shard x tp':>33} | {'m':>3} | {'peak GiB':>9} | "
                 f"{'step s':>8} | {'tokens/s a GPU':>14} | compute, TP + pp, bubble, FSDP (s)")
    ranked = sorted((row for row in rows if row[1] <= fits), key=lambda row: row[2])
    for place, (layout, peak, step, parts) in enumerate(ranked, 1):
        lines.append(f"{place:>4} | {' x '.join(map(str, layout[:4])):>33} | {layout[4]:>3} | {peak / GiB:>9.3g} | "
                     f"{step:>8.3g} | {tokens / step / args.gpus:>14,.0f} | "
                     + ", ".join(f"{value:.3g}" for value in parts.values()))
    lines.append(f"Do not fit in {fits / GiB:.3g} GiB: " + (", ".join(
        f"{' x '.join(map(str, layout[:4]))} ({peak / GiB:.3g} GiB)" for layout, peak, _, _ in rows
        if peak > fits) or "none"))
    if published:
        layout, peak, step, _ = next(row for row in rows if row[0][:4] == published[2])
        lines.append(f"Published: {published[0]}. This search's estimate of that layout: {step:.3g} s a step "
                     f"(published: {published[5]:.3g} s), peak {peak / GiB:.3g} GiB in float32 without activation "
                     "checkpointing (the published run: bf16 weights, activations recomputed)")
    return lines


def check(parser, args):
    """The layout against the world, the model and the batch: one line for the first that does not fit."""
    if args.world_size < 1 or args.world_size > 1 << 17:
        parser.error(f"--world_size {args.world_size}: give 1 to 131,072")
    split = args.dp_replicate * args.tp * args.pp
    if args.world_size % split:
        parser.error(f"--dp_replicate {args.dp_replicate} x --tp {args.tp} x --pp {args.pp} = {split} does not "
                     f"divide --world_size {args.world_size}")
    args.dp_shard = args.dp_shard or args.world_size // split
    if args.dp_shard * split != args.world_size:
        parser.error(f"--pp {args.pp} x --dp_replicate {args.dp_replicate} x --dp_shard {args.dp_shard} x --tp "
                     f"{args.tp} = {args.dp_shard * split}, not --world_size {args.world_size}")
    if not 0 <= args.rank < args.world_size:
        parser.error(f"--rank {args.rank}: not a rank of --world_size {args.world_size}")
    check_model(parser, args.config, args.tp)
    stages = args.pp * (2 if args.schedule in LOOPED | V_SHAPED else 1)
    args.microbatches = args.microbatches or stages
    if stages > args.config.n_layers:
        parser.error(f"{stages} stages (--pp {args.pp}, schedule {args.schedule}) are more than the "
                     f"{args.config.n_layers} layers: each stage needs one")
    dp = args.dp_replicate * args.dp_shard
    if args.global_batch_size % (dp * args.microbatches):
        parser.error(f"dp {dp} x --microbatches {args.microbatches} must divide --global_batch_size "
                     f"{args.global_batch_size}: every micro-batch has one shape")
    if args.schedule in ("1f1b", "interleaved_1f1b") and args.microbatches < args.pp:
        parser.error(f"{args.schedule} needs at least one micro-batch a rank: --microbatches {args.microbatches} < "
                     f"--pp {args.pp}")


class Parser(argparse.ArgumentParser):
    def error(self, message):
        """A bad flag or layout: one line, exit 2, before any work."""
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def parse_args(argv=None):
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(MODELS), default="steps",
                        help="steps: language_model.DecoderConfig's defaults (the --dim ... flags change them)")
    parser.add_argument("--world_size", type=positive_int, default=8, help="ranks (GPUs) of the job")
    parser.add_argument("--dp_replicate", type=positive_int, default=1, help="HSDP: replicas of the shards")
    parser.add_argument("--dp_shard", type=positive_int, help="FSDP2 ranks (default: what the others leave)")
    parser.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel ranks")
    parser.add_argument("--pp", type=positive_int, default=1, help="pipeline ranks")
    parser.add_argument("--schedule", choices=list(SCHEDULES), default="1f1b", help="default 1f1b")
    parser.add_argument("--microbatches", type=positive_int, help="micro-batches a step (default: the stages)")
    parser.add_argument("--global_batch_size", type=positive_int, default=16, help="sequences a step, all ranks")
    parser.add_argument("--seq_len", type=positive_int, default=64, help="tokens a sequence (default 64)")
    parser.add_argument("--rank", type=int, default=0, help="the rank to trace (default 0)")
    parser.add_argument("--every_microbatch", action="store_true",
                        help="trace every micro-batch (1F1B: by default those after the first warmup + 1 are added "
                        "as copies of the last traced one, which they equal)")
    parser.add_argument("--backend", choices=["nccl", "gloo"], default="nccl",
                        help="whose reduce-scatter and framing the bytes sent count (default nccl)")
    for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "hidden"):
        parser.add_argument(f"--{name}", type=positive_int, help=f"the model's {name}, instead of --model's")
    search = parser.add_argument_group("search: the layouts of --gpus that fit, fastest first")
    search.add_argument("--search", action="store_true", help="search instead of one layout")
    search.add_argument("--gpus", type=positive_int, default=64, help="GPUs of the job (default 64)")
    search.add_argument("--gpus_per_node", type=positive_int, default=8, help="GPUs a node (default 8)")
    search.add_argument("--gpu_memory", type=float, default=80, help="GiB a GPU (default 80)")
    search.add_argument("--gpu_flops", type=float, default=989e12,
                        help="a GPU's peak FLOP/s at the matmuls' precision (default 989e12: an H100 SXM's dense "
                        "bf16; its TF32, float32's fast path, is half that)")
    search.add_argument("--utilization", type=float, default=0.4, help="the share of --gpu_flops the step's "
                        "matrix products reach (default 0.4)")
    search.add_argument("--intra_node", type=float, default=450e9,
                        help="bytes/s a GPU sends inside a node (default 450e9: NVLink 4, one way)")
    search.add_argument("--inter_node", type=float, default=50e9,
                        help="bytes/s a GPU sends to other nodes (default 50e9: one 400 Gb/s NIC a GPU)")
    search.add_argument("--reserve", type=float, default=0.1, help="share of a GPU's memory kept free (default 0.1)")
    args = parser.parse_args(argv)
    sizes = {name: getattr(args, name) for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "hidden")
             if getattr(args, name)}
    args.config = replace(MODELS[args.model], **sizes, max_seq_len=args.seq_len)
    if args.search:
        if min(args.gpu_memory, args.gpu_flops, args.intra_node, args.inter_node, args.utilization) <= 0 or \
                args.utilization > 1 or not 0 <= args.reserve < 1:
            parser.error("--gpu_memory, --gpu_flops and the link speeds must be positive, --utilization in (0, 1], "
                         "--reserve in [0, 1)")
        check_model(parser, args.config, 1)
        if not layouts(args):
            parser.error(f"no layout of {args.gpus} GPUs divides the model, the node ({args.gpus_per_node}) and "
                         f"--global_batch_size {args.global_batch_size}")
    else:
        check(parser, args)
    return args


if __name__ == "__main__":
    arguments = parse_args()
    print("\n".join(search(arguments) if arguments.search else summary(arguments, trace(arguments))))
