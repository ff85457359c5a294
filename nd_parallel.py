"""Step 8: data, tensor, pipeline, context and expert parallelism at once, on one DeviceMesh with named dimensions.

    torchrun --standalone --nproc_per_node=8 nd_parallel.py --dp 2 --tp 2 --pp 2          # 3-D
    torchrun --standalone --nproc_per_node=4 nd_parallel.py --dp 4 --dp_replicate 2        # HSDP 2 x 2
    torchrun --standalone --nproc_per_node=4 nd_parallel.py --dp 2 --cp 2 --seq_len 256    # long sequences
    torchrun --standalone --nproc_per_node=4 nd_parallel.py --n_experts 8 --ep 4          # a mixture of experts

The mesh is pp x dp_replicate x dp_shard x cp x tp, tp innermost (its ranks neighbours, on one machine). Each rank
runs its stages (pipeline_parallel.py), split over tp (tensor_parallel.py), its chunks of each sequence over cp
(context_parallel.py), then sharded by FSDP2 over dp_shard x cp (fsdp.py), with --dp_replicate R copies of the
shards (HSDP). With --n_experts each MLP is a mixture of experts, split over ep ranks of dp_shard x cp
(expert_parallel.py). A size-1 axis is not applied. It prints where each rank sits and what it holds, the loss,
the tokens each expert got, each rank's idle time beside its schedule's bubble, and a sample:

    Mesh pp 1 x dp_replicate 2 x dp_shard 2 x cp 1 x tp 1 | 4 sequences a data-parallel rank in 1 micro-batch | ...
    Epoch 0 | Batchsize 4 | Steps 513 | Loss 2.302626 per token
    Rank 0 | stage 0 | idle 34.0% of a step, measured | bubble (p-1)/(m+p-1) = 0.0%, textbook
    Sample: "The sher should I which king him.\n\nHith alst shall witclan, and wher. O my had some ..."

Checkpoints (DCP, with fsdp_checkpoint.py's complete marker) are keyed by the full model's names: tensor_parallel.py,
pipeline_parallel.py and nd_parallel.py resume from each other's, in any layout, and train on as they would have
with the same --global_batch_size. --init_from_hf DIR starts from a Llama checkpoint in Hugging Face's format, and
hf_checkpoint.py writes one. With --dtype float64 every layout trains one process's numbers but for the order of
additions (tests/test_parallelism.py). docs/parallelism.md walks through it.
"""
import argparse
import copy
import functools
import gc
import json
import os
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.nn  # before any process group: docs/failures.md, clean exits
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe,
                                          ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
                                          ScheduleZBVZeroBubble)
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, loss_parallel, parallelize_module)
from torch.utils.data import DataLoader

from context_parallel import CP_ATTENTION, positions, shard_sequence
from expert_parallel import dispatch
from fsdp_checkpoint import CheckpointDir, GlobalOrderSampler, check_folder, load_whole_model
from language_model import MoE, Decoder, DecoderConfig, hf_name, read_text, sample, text_splits

# Optimizer state flattened (one key per parameter): each stage saves and loads its own part of the model's state.
STATE_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# The schedules torch ships. A rank runs one stage, or two: stage r and r + pp (looped), or r and 2pp - 1 - r (V).
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B,
             "interleaved_zb": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble,
             "dualpipev": ScheduleDualPipeV}
LOOPED, V_SHAPED = {"interleaved_1f1b", "interleaved_zb"}, {"zbv", "dualpipev"}
DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # the mesh's dimensions, outermost first


class Trainer:
    def __init__(self, parts, train_data, optimizers, args, mesh):
        self.device, self.dtype = device_of(mesh), getattr(torch, args.dtype)
        self.parts = parts  # this rank's parts of the model (torchtitan's model_parts): all of it, or its stages
        self.optimizers = optimizers  # one a part: get_state_dict names an optimizer's parameters by one module
        self.dp = mesh["dp_replicate"].size() * mesh["dp_shard"].size()
        self.cp, self.cp_rank = mesh["cp"].size(), mesh["cp"].get_local_rank()
        self.shards = self.dp * self.cp  # the ranks whose gradients FSDP averages: each holds its own tokens
        pp = mesh["pp"].size()
        indices = stage_indices(mesh["pp"].get_local_rank(), pp, args.schedule)
        self.stages = [PipelineStage(part, index, pp * len(parts), self.device, group=mesh["pp"].get_group())
                       for part, index in zip(parts, indices)]
        # scale_grads=False: the schedule adds the micro-batches' gradients as they are; the loss says what they mean.
        schedule = SCHEDULES[args.schedule]
        self.schedule = schedule(self.stages if len(parts) > 1 else self.stages[0], n_microbatches=args.microbatches,
                                 loss_fn=self.timed(self.loss), scale_grads=False)
        self.first, self.last = indices[0] == 0, pp * len(parts) - 1 in indices
        self.speaks = self.last and mesh["tp"].get_local_rank() == 0  # one rank of each data-parallel part
        self.train_data = train_data
        self.sampler = train_data.sampler
        self.save_every, self.log_every = args.save_every, args.log_every
        self.position, self.steps_done = 0, 0
        self.snapshot_path, self.config = args.snapshot_path, args.config
        self.layout = args.layout
        self.moe = {name: module for part in parts for name, module in part.named_modules() if isinstance(module, MoE)}
        self.ep = args.ep
        for moe in self.moe.values():  # its balance loss counted as the training loss is (Trainer.loss)
            moe.balance_scale, moe.counting = self.shards / args.global_batch_size, False
        self.epochs_run = 0
        self.rank = dist.get_rank()
        self.busy, self.step_times = [0.0], []  # this rank's compute seconds; (busy, wall) of each step
        self.bubble = bubble(args.schedule, pp, args.microbatches)
        for stage in self.stages:  # what the schedule calls for each micro-batch
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(stage, name, self.timed(getattr(stage, name)))
        for stage in self.stages:  # the routing of the schedule's forwards, not of a stage's shape inference
            stage.forward_one_chunk = self.counted(stage.forward_one_chunk)
        self.checkpoints = CheckpointDir(self.snapshot_path, log=self.log, skip_damaged=args.skip_damaged)
        # Complete checkpoints only, their files checked against their sums, made with this model, data and batch.
        where, path = self.checkpoints.newest(self.where())
        if where:
            state = self.state()  # this rank's pieces: DCP reads them from whichever files hold them
            with self.checkpoints.loading(path, whole_model(state)):  # another model or optimizer layout: one line
                dcp.load(state, checkpoint_id=path, process_group=self.checkpoints.group)
            self.set_state(state)
            self.epochs_run, self.position, self.steps_done = where["epochs_run"], where["position"], where["steps"]
            self.log(f"Resuming from {path} at epoch {self.epochs_run}, saved as {where.get('layout', '?')} on "
                     f"{where['world_size']} process{'es' * (where['world_size'] > 1)}")
        elif args.init_from_hf:  # DCP reads the Hugging Face files straight into this rank's pieces
            # The model's state alone: get_state_dict would give a fresh AdamW a first step (state at step 1).
            weights = [get_model_state_dict(part) for part in self.parts]
            dcp.load({hf_name(key): value for part in weights for key, value in part.items()},
                     storage_reader=HuggingFaceStorageReader(args.init_from_hf), process_group=self.checkpoints.group)
            for part, part_weights in zip(self.parts, weights):
                set_model_state_dict(part, part_weights)
            self.log(f"Starting from {args.init_from_hf} (Hugging Face's format)")

    def log(self, text):
        if self.rank == 0:
            print(text, flush=True)

    def timed(self, work):
        """`work`, its seconds added to this rank's busy time (on a GPU, once its kernels have finished)."""
        def run(*args, **kwargs):
            self.synchronize()
            start = time.perf_counter()
            try:
                return work(*args, **kwargs)
            finally:
                self.synchronize()
                self.busy[0] += time.perf_counter() - start
        return run

    def settle_experts(self):
        """An expert's gradient comes in summed over the tokens of its ep group (the all-to-all brought them), and
        FSDP averaged it over the groups (efsdp): divided by ep, it is the mean over all the shards, as the rest's.
        (FSDP's set_gradient_divide_factor would do it in the reduction, but in float64 on a one-rank efsdp it
        divides twice on torch 2.13.)"""
        if self.ep > 1:
            for moe in self.moe.values():
                for weight in moe.experts.parameters():
                    weight.grad.div_(self.ep)

    def counted(self, forward):
        """forward, with the MoE layers counting the tokens they route (Trainer.routing_line)."""
        def run(*args, **kwargs):
            for moe in self.moe.values():
                moe.counting = True
            try:
                return forward(*args, **kwargs)
            finally:
                for moe in self.moe.values():
                    moe.counting = False
        return run

    def synchronize(self):
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def loss(self, logits, targets):
        """The last stage's loss of one micro-batch: its tokens' cross-entropy over the step's tokens, so that the
        micro-batches' gradients add up to those of the step's mean (scale_grads=False: the schedule adds them as
        they are). FSDP averages the gradients of the dp x cp ranks, each with its own tokens: times dp x cp, that
        is their sum. Under tensor parallelism the logits stay split over the vocabulary (loss_parallel)."""
        tokens = self.sampler.global_batch * self.config.max_seq_len  # the whole sequences, all cp ranks' parts
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") * self.shards / tokens

    def where(self):
        return {"epochs_run": self.epochs_run, "position": self.position, "steps": self.steps_done,
                "dataset_size": self.sampler.size, "seed": self.sampler.seed, "global_batch": self.sampler.global_batch,
                "layout": self.layout, "model": vars(self.config), "architecture": "Decoder"}

    def state(self):
        """This rank's model and optimizer state, keyed by the full model's parameter names."""
        model, optimizer = {}, {}
        for part, part_optimizer in zip(self.parts, self.optimizers):
            part_model, part_optim = get_state_dict(part, part_optimizer, options=STATE_OPTIONS)
            model.update(part_model)
            optimizer.update(part_optim)
        return {"model": model, "optimizer": optimizer}

    def set_state(self, state):
        """Each part takes its own tensors; its optimizer keeps this run's settings (lr, betas), not the saved ones."""
        for part, part_optimizer in zip(self.parts, self.optimizers):
            own_model, own_optim = get_state_dict(part, part_optimizer, options=STATE_OPTIONS)
            settings = [{k: v for k, v in group.items() if k != "params"} for group in part_optimizer.param_groups]
            set_state_dict(part, part_optimizer, model_state_dict={k: state["model"][k] for k in own_model},
                           optim_state_dict={k: state["optimizer"][k] for k in own_optim}, options=STATE_OPTIONS)
            for group, setting in zip(part_optimizer.param_groups, settings):
                group.update(setting)

    def _save(self):
        writer = self.checkpoints.start(self.where())  # into its .tmp directory: every rank writes and sums its files
        self.checkpoints.saving(dcp.save(self.state(), storage_writer=writer, process_group=self.checkpoints.group))

    def _run_batch(self, source, targets):
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        losses = []  # the last stage's, one a micro-batch
        self.synchronize()
        busy, start = self.busy[0], time.perf_counter()
        # The first stage feeds the batch in, the last compares with the targets; the schedule cuts both.
        # return_outputs=False: the last stage keeps no outputs, whose autograd graph would hold the modules (and
        # any hooks on them, and through them the process groups) past destroy_process_group. TP's collectives
        # run inside each stage's layers, FSDP's gathers around them, its reduce-scatters at the end.
        with loss_parallel():  # the cross-entropy of logits split over the vocabulary, forward and backward
            self.schedule.step(*[source] * self.first, target=targets if self.last else None,
                               losses=losses if self.last else None, return_outputs=False)
        self.synchronize()
        self.step_times.append((self.busy[0] - busy, time.perf_counter() - start))
        settle_grads(self.parts)
        self.settle_experts()
        for optimizer in self.optimizers:
            optimizer.step()  # on this rank's pieces: no communication
        loss = sum(losses, torch.zeros((), device=self.device, dtype=self.dtype))
        return (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()

    def _run_epoch(self, epoch):
        self.sampler.set_epoch(epoch, self.position)
        trained = self.sampler.size - self.position
        loss_sum = torch.zeros((), device=self.device, dtype=self.dtype)  # read once per epoch, not every step
        for source, targets in self.train_data:
            step_size = self.sampler.global_batch
            source, targets = source.to(self.device), targets.to(self.device)
            if self.cp > 1:  # this rank's chunks of each sequence, and of its targets (context_parallel.py)
                source, targets = (shard_sequence(t, self.cp_rank, self.cp) for t in (source, targets))
            loss = self._run_batch(source, targets) * step_size / self.shards  # this part's mean loss a token,
            if self.speaks:  # times the sequences: one rank of each data and context-parallel part adds it
                loss_sum += loss
            self.position, self.steps_done = self.position + step_size, self.steps_done + 1
            if self.log_every and self.steps_done % self.log_every == 0:
                said = loss_sum.clone()
                dist.all_reduce(said)
                sequences = trained - (self.sampler.size - self.position)  # this epoch's, so far
                self.log(f"Epoch {epoch} | step {self.steps_done} | Loss {said.item() / sequences:.6f} per token")
        dist.all_reduce(loss_sum)  # the data-parallel parts' sums, to rank 0
        mean_loss = loss_sum.item() / trained
        steps = -(-self.sampler.size // self.sampler.global_batch)
        self.log(f"Epoch {epoch} | Batchsize {self.sampler.global_batch // self.dp} | Steps {steps} | "
                 f"Loss {mean_loss:.6f} per token")
        if self.moe:
            self.log(self.routing_line())
        self.epochs_run, self.position = epoch + 1, 0
        return mean_loss

    def routing_line(self):
        """The tokens each expert got this epoch, layer by layer, summed over the ranks (a collective: every rank).
        A balanced router gives each about tokens x top_k / experts."""
        mine = {name: moe.routed.tolist() for name, moe in self.moe.items()}
        for moe in self.moe.values():
            moe.routed.zero_()
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        layers = {}
        for counts in everyone:
            for name, routed in counts.items():
                layers[name] = [a + b for a, b in zip(layers.get(name, [0] * len(routed)), routed)]
        return "Tokens per expert | " + " | ".join(f"{name.removesuffix('.mlp')} {' '.join(map(str, routed))}"
                                                   for name, routed in sorted(layers.items()))

    def idle_lines(self):
        """Each rank's measured idle fraction of a step, beside the textbook bubble (a collective: every rank)."""
        measured = self.step_times[1:] or self.step_times  # the first step also inferred the shapes
        busy, wall = (sum(column) for column in zip(*measured))
        idle = [None] * dist.get_world_size()
        dist.all_gather_object(idle, (1 - busy / wall, [stage.stage_index for stage in self.stages]))
        return "\n".join(f"Rank {r} | stage{'s' * (len(s) > 1)} {', '.join(map(str, s))} | idle {100 * f:.1f}% of a "
                         f"step, measured | {self.bubble}" for r, (f, s) in enumerate(idle))

    def train(self, max_epochs):
        if self.epochs_run >= max_epochs:
            self.log(f"Nothing to do: {self.snapshot_path} already holds {self.epochs_run} epochs "
                     f"(--total_epochs {max_epochs}); raise --total_epochs to train on")
            return None
        start, first_epoch, first_step = time.perf_counter(), self.epochs_run, self.steps_done
        for epoch in range(self.epochs_run, max_epochs):
            loss = self._run_epoch(epoch)
            if (epoch + 1) % self.save_every == 0 or epoch + 1 == max_epochs:
                self._save()
            self.checkpoints.commit(wait=True)
        wall = time.perf_counter() - start
        self.log(self.idle_lines())
        tokens = (max_epochs - first_epoch) * self.sampler.size * self.config.max_seq_len
        self.log(f"Summary: epochs {max_epochs - first_epoch} | steps {self.steps_done - first_step} | final loss "
                 f"{loss:.6f} | tokens/s {tokens / wall:.1f} | wall {wall:.2f}s | world size "
                 f"{dist.get_world_size()} | backend {dist.get_backend()}")
        return self.checkpoints.path(self.where())  # the last epoch's, saved above


def device_of(mesh):
    """This process's device: its GPU (set before the process group), or the CPU."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.accelerator.current_device_index())


def layout_of(mesh):
    return " x ".join(f"{name} {mesh[name].size()}" for name in mesh.mesh_dim_names)


def stage_indices(pp_rank, pp, schedule):
    """The stages this rank runs, of pp (one a rank) or 2 pp (two a rank, looped or V-shaped)."""
    if schedule in LOOPED:
        return [pp_rank, pp_rank + pp]
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank]


def bubble(schedule, p, m):
    """The textbook idle fraction of a step, every stage's forward and backward taking the same time."""
    if schedule in ("gpipe", "1f1b"):
        return f"bubble (p-1)/(m+p-1) = {100 * (p - 1) / (m + p - 1):.1f}%, textbook"
    if schedule == "interleaved_1f1b":  # v = 2 stages a rank: the fill and drain take half as long
        return f"bubble (p-1)/(2m+p-1) = {100 * (p - 1) / (2 * m + p - 1):.1f}%, textbook"
    return "bubble near 0 once the weight gradients fill it (W split from B), textbook"


def build_stage(model, stage, stages):
    """Drop, in place, what `stage` of `stages` does not own; returns the names of the parts it keeps."""
    depth = len(model.layers)
    first, end = depth * stage // stages, depth * (stage + 1) // stages
    for i in range(depth):
        if not first <= i < end:
            model.layers[i] = None  # the slot stays: the kept layers keep their numbers, layers.2 stays layers.2
    if stage > 0:
        model.embed_tokens = None
    if stage < stages - 1:
        model.norm = model.lm_head = None
    return (["embed_tokens"] * (stage == 0) + [f"layers.{i}" for i in range(first, end)]
            + ["norm", "lm_head"] * (stage == stages - 1))


def apply_tp(model, tp_mesh):
    """Megatron's split with sequence parallelism (torchtitan's plan). In each layer q, k, v and the MLP's gate and
    up projections are split by output columns (each rank: its heads, its hidden units), o_proj and down_proj by
    input rows, their partial sums reduce-scattered over the sequence; the norms run on each rank's slice of the
    sequence, all-gathered before attention and the MLP. The embedding is split over the vocabulary, and so are
    the logits, which the loss takes as they are (loss_parallel)."""
    ends = {"embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}
    parallelize_module(model, tp_mesh, {name: style for name, style in ends.items() if getattr(model, name)})
    for layer in filter(None, model.layers):
        parallelize_module(layer, tp_mesh, {
            "input_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "post_attention_layernorm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        })


def apply_cp(model, cp_mesh, seq_len, form):
    """Context parallelism: each rank holds its chunks of every sequence (context_parallel.shard_sequence); its
    attention turns the queries and keys by their places in the whole sequence, and attends over every rank's keys
    and values, by a ring or an all-gather. The rest of the layer works on each token alone: it needs nothing."""
    attention, group = CP_ATTENTION[form], cp_mesh.get_group()
    places = positions(seq_len, cp_mesh.get_local_rank(), cp_mesh.size(), device_of(cp_mesh))
    for layer in filter(None, model.layers):
        layer.self_attn.positions = places
        layer.self_attn.context_parallel = functools.partial(attention, group=group)
        if isinstance(layer.mlp, MoE):  # its balance loss counts each expert's share of whole sequences
            layer.mlp.sequence_group = group


def apply_ep(model, ep_mesh):
    """Expert parallelism: each rank keeps its n_experts / ep experts of every MoE layer (a DTensor split over the
    experts, so that checkpoints keep the full model's shapes), and its tokens go to their experts' ranks and back
    by all-to-all (expert_parallel.dispatch). The router stays whole on every rank: each routes its own tokens."""
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for layer in filter(None, model.layers):
        experts = layer.mlp.experts
        for name, weight in list(experts.named_parameters()):
            local = weight.detach().chunk(ep)[rank].contiguous()  # every rank holds the same whole: no message
            experts.register_parameter(name, nn.Parameter(DTensor.from_local(local, ep_mesh, [Shard(0)],
                                                                              run_check=False)))
        layer.mlp.dispatch = functools.partial(dispatch, group=ep_mesh.get_group())


def tokens_held(cp_mesh, seq_len):
    """Which tokens of each sequence this rank holds: two chunks, one early and one late."""
    c, i, chunks = seq_len // (2 * cp_mesh.size()), cp_mesh.get_local_rank(), 2 * cp_mesh.size()
    return f"tokens {i * c}-{(i + 1) * c - 1} and {(chunks - 1 - i) * c}-{(chunks - i) * c - 1} of {seq_len}"


def apply_fsdp(part, mesh, fsdp_mesh, expert_mesh=None):
    """FSDP2 over the data-parallel and the context-parallel ranks (torchtitan's dp_shard_cp: both hold the same
    weights and train on tokens of their own): each layer sharded on its own, then the rest; with HSDP, replicated
    over dp_replicate (FSDP all-reduces the shards' gradients over it). Under a pipeline, a layer's weights stay
    gathered from its forward to its backward (torchtitan's choice): resharded after each micro-batch's forward,
    they would be gathered again for every micro-batch. Experts split over ep are sharded over the ranks that hold
    the same ones (efsdp; HSDP: and dp_replicate), a unit of their own, even of one rank: the layer's unit must not
    take them (Trainer.settle_experts)."""
    reshard = mesh["pp"].size() == 1
    for layer in filter(None, part.layers):
        if expert_mesh is not None:
            replicas = mesh["dp_replicate"].size() > 1
            efsdp = expert_mesh["dp_replicate", "efsdp"] if replicas else expert_mesh["efsdp"]
            fully_shard(layer.mlp.experts, mesh=efsdp, reshard_after_forward=reshard)
        fully_shard(layer, mesh=fsdp_mesh, reshard_after_forward=reshard)
    fully_shard(part, mesh=fsdp_mesh, reshard_after_forward=reshard)


def settle_grads(parts):
    """The norms' weight gradients come out of backward as partial sums (each tp rank's slice of the sequence), the
    embedding's whole: each to its parameter's layout once, before the optimizer, which would otherwise all-reduce
    the partial sums at each of its uses (three for AdamW)."""
    for part in parts:
        for p in part.parameters():
            if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                p.grad = p.grad.redistribute(placements=p.placements)


def holdings(part, names, total):
    """What this rank holds of one stage: its parts, its share of the parameters, and its piece of the stage's
    first layer's q_proj.weight (split over tp, then sharded over dp)."""
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in part.parameters())
    layer = next((i for i, layer in enumerate(part.layers) if layer is not None), None)
    weight = part.layers[layer].self_attn.q_proj.weight if layer is not None else None
    piece = (f" | layers.{layer}.self_attn.q_proj.weight {list(weight.to_local().shape)} of {list(weight.shape)}"
             if isinstance(weight, DTensor) else "")
    return f"{', '.join(names)} | {local:,} of {total:,} parameters{piece}"


def whole_model(state):
    """Every rank's entries together under DCP's flat keys: the tensors as meta tensors of their shapes, the
    optimizer's settings (lr, betas) as None: what a checkpoint of this model holds, to compare with one (a
    collective: every rank)."""
    def flat(value, prefix=""):
        if isinstance(value, dict):
            for key, item in value.items():
                yield from flat(item, f"{prefix}.{key}" if prefix else key)
        else:
            yield prefix, tuple(value.shape) if isinstance(value, torch.Tensor) else None

    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, dict(flat(state)))
    return {key: None if shape is None else torch.empty(shape, device="meta")
            for shapes in ranks for key, shape in shapes.items()}


def load_train_objs(args, mesh, fsdp_mesh, expert_mesh):
    train_set = args.train_set
    # The whole decoder on every rank (one seed, the same weights), then each keeps its pieces: fine at this size;
    # a large model would be built on the meta device and each rank's shards initialized (fsdp.py).
    model = Decoder(args.config).init_weights(args.seed).to(device_of(mesh), getattr(torch, args.dtype))
    total = sum(p.numel() for p in model.parameters())
    indices = stage_indices(mesh["pp"].get_local_rank(), mesh["pp"].size(), args.schedule)
    parts, lines = [], []
    for index in indices:
        # 1. Pipeline: the stage, under the full model's names.
        part = copy.deepcopy(model) if len(indices) > 1 else model
        names = build_stage(part, index, mesh["pp"].size() * len(indices))
        # 2. Tensor parallel over the tp group: heads and hidden units split, norms over the sequence.
        if mesh["tp"].size() > 1:
            apply_tp(part, mesh["tp"])
        # 3. Context parallel over the cp group: each rank attends with its slice of the sequence.
        if mesh["cp"].size() > 1:
            apply_cp(part, mesh["cp"], args.config.max_seq_len, args.cp_attention)
        # 4. Expert parallel over the ep group (ranks of dp_shard x cp): each its share of every layer's experts.
        if expert_mesh is not None:
            apply_ep(part, expert_mesh["ep"])
        # 5. FSDP2 over the data-parallel and the context-parallel ranks, the experts a unit of their own.
        if fsdp_mesh.size() > 1:
            apply_fsdp(part, mesh, fsdp_mesh, expert_mesh)
        parts.append(part)
        lines.append(f"stage {index}: {holdings(part, names, total)}")
    optimizers = [torch.optim.AdamW(part.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
                  for part in parts]
    where = " ".join(f"{name} {mesh[name].get_local_rank()}" for name in mesh.mesh_dim_names)
    if mesh["cp"].size() > 1:
        where += f" | {tokens_held(mesh['cp'], args.config.max_seq_len)}"
    if expert_mesh is not None:
        local, ep_rank = args.config.n_experts // args.ep, expert_mesh["ep"].get_local_rank()
        where += f" | ep {ep_rank}: experts {ep_rank * local}-{(ep_rank + 1) * local - 1} of {args.config.n_experts}"
    return train_set, parts, optimizers, " | ".join([where, *lines])


def main(args):
    # torchrun numbers the processes: RANK in the whole job, LOCAL_RANK on this machine (which picks its GPU).
    rank, local_rank, world_size = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])  # the processes on this machine, each with its own GPU
    # check_available=True: without it, a CUDA build of torch (PyPI's default on Linux) says cuda without a GPU.
    accelerator = torch.accelerator.current_accelerator(check_available=True)  # None without a usable GPU
    if accelerator and local_world_size > torch.accelerator.device_count():
        accelerator = None  # more processes than devices (a Mac has one mps device): every process on the CPU
    device = torch.device(accelerator.type, local_rank) if accelerator else torch.device("cpu")
    backend = args.backend or dist.get_default_backend_for_device(device)
    if backend == "nccl" and device.type != "cuda":
        sys.exit("error: --backend nccl needs a CUDA GPU for each process; leave --backend out for gloo on the CPU")
    if rank == 0:  # the snapshot's folder checked now, not after the first epochs; torchrun then stops every rank
        check_folder(args.snapshot_path)
    if accelerator:  # before the process group, so NCCL binds this process to its own GPU
        torch.accelerator.set_device_index(device.index)
    # The mesh's groups are made from this group of world_size processes: one group per row of each dimension.
    # A framework that calls main() (Ray Train, say) may own the group already.
    timeout = timedelta(seconds=args.timeout)
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group(backend, store=group_store(rank, world_size, timeout), rank=rank,
                                world_size=world_size, timeout=timeout, device_id=device if accelerator else None)
    if rank == 0:
        print(f"Training on {world_size} process{'es' * (world_size > 1)} | device {device.type} | backend {backend}")
    # FSDP shards over dp_shard x cp as one dimension: the mesh is made with it whole, then cut into the two (views
    # of one mesh, torchtitan's way; _unflatten is private API).
    dp_shard = args.dp // args.dp_replicate
    root = dist.device_mesh.init_device_mesh(device.type, (args.pp, args.dp_replicate, dp_shard * args.cp, args.tp),
                                             mesh_dim_names=("pp", "dp_replicate", "dp_shard_cp", "tp"))
    mesh = root._unflatten("dp_shard_cp", (dp_shard, args.cp), ("dp_shard", "cp"))
    shards = "dp_shard_cp" if args.cp > 1 else "dp_shard"  # where cp is 1, the same ranks under their own name
    fsdp_mesh = (root if args.cp > 1 else mesh)[("dp_replicate", shards) if args.dp_replicate > 1 else shards]
    # The experts' view: dp_shard x cp cut into efsdp x ep, ep innermost (torchtitan's names).
    expert_mesh = (root._unflatten("dp_shard_cp", (dp_shard * args.cp // args.ep, args.ep), ("efsdp", "ep"))
                   if args.ep > 1 else None)
    dataset, parts, optimizers, holds = load_train_objs(args, mesh, fsdp_mesh, expert_mesh)
    args.layout = layout_of(mesh) + (f" | ep {args.ep}" if args.ep > 1 else "")
    everyone = [None] * world_size
    dist.all_gather_object(everyone, holds)
    m = args.microbatches
    if rank == 0:
        print(f"Text: {args.about} | {len(dataset):,} sequences of {args.config.max_seq_len} bytes to train on")
        print(f"Mesh {args.layout} | {args.global_batch_size // args.dp} sequences a data-parallel rank in {m} "
              f"micro-batch{'es' * (m > 1)} | global batch {args.global_batch_size} | schedule {args.schedule}")
        print("\n".join(f"Rank {r} | {line}" for r, line in enumerate(everyone)))
    # Each step's global batch is cut into dp pieces: the ranks of one data-parallel coordinate (all their stages
    # and tp pieces) take the same piece.
    dp_rank = mesh["dp_replicate", "dp_shard"]._flatten("dp").get_local_rank()  # torchtitan's way (private API)
    size = len(dataset) // args.global_batch_size * args.global_batch_size  # whole steps: batches of one shape
    sampler = GlobalOrderSampler(size, dp_rank, args.dp, args.global_batch_size, seed=args.seed)
    train_data = DataLoader(dataset, sampler=sampler, batch_size=None, generator=torch.Generator())
    trainer = Trainer(parts, train_data, optimizers, args, mesh)
    newest = trainer.train(args.total_epochs)
    del trainer, parts, optimizers  # they hold the process group: free them, so destroy_process_group frees it
    gc.collect()  # FSDP2's modules sit in reference cycles (hooks hold FSDP's state, which holds the module)
    root._pg_registry.clear()  # torch's caches keep the mesh for good, and it its groups (private: no public way)
    if owns_group:
        dist.destroy_process_group()
    if rank == 0 and newest and args.sample:  # the whole decoder, read back from the checkpoint just saved
        model = load_whole_model(Decoder(args.config), newest)
        print(f"Sample: {json.dumps(sample(model, args.prompt, args.sample))}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--total_epochs", "--epochs", type=positive_int, default=1, help="passes over the text")
    parser.add_argument("--save_every", type=positive_int, default=1, help="epochs between checkpoints, and the last")
    parser.add_argument("--log_every", type=int, default=25, help="steps between loss lines; 0: once an epoch")
    parser.add_argument("--dp", type=positive_int, help="data-parallel ranks (default: the processes over tp x pp)")
    parser.add_argument("--dp_replicate", type=positive_int, default=1, help="HSDP: replicas of the shards, of --dp")
    parser.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel ranks: each layer split over them")
    parser.add_argument("--pp", type=positive_int, default=1, help="pipeline ranks")
    parser.add_argument("--cp", type=positive_int, default=1, help="context-parallel ranks: each sequence split over "
                        "them")
    parser.add_argument("--ep", type=positive_int, default=1, help="expert-parallel ranks, of dp x cp: each holds "
                        "its share of the experts (with --n_experts)")
    parser.add_argument("--cp_attention", choices=list(CP_ATTENTION), default="ring", help="how the cp ranks "
                        "attend over each other's tokens: keys and values round a ring, or all-gathered")
    parser.add_argument("--schedule", choices=list(SCHEDULES), default="1f1b", help="default 1f1b")
    parser.add_argument("--microbatches", type=positive_int, help="micro-batches a step (default: the stages)")
    parser.add_argument("--global_batch_size", type=positive_int, default=16, help="sequences per step over all ranks")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate (default 3e-3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model and the shuffle")
    parser.add_argument("--data", help="a UTF-8 text file (default: data/shakespeare/input.txt, four plays)")
    parser.add_argument("--snapshot_path", default="nd_parallel_checkpoints", help="the checkpoints' directory")
    parser.add_argument("--skip_damaged", action="store_true", help="set a damaged checkpoint aside (renamed "
                        ".damaged) and resume from the newest one that checks out")
    parser.add_argument("--init_from_hf", metavar="DIR", help="start from a Llama checkpoint in Hugging Face's format "
                        "(config.json, *.safetensors); its config sets the model's sizes")
    parser.add_argument("--backend", choices=["nccl", "gloo", "mpi"], help="default: nccl on CUDA, gloo on the CPU")
    parser.add_argument("--timeout", type=float, default=300, help="seconds to wait for the other ranks (default 300)")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                        help="of the weights; float64 to compare with one process tightly")
    parser.add_argument("--sample", type=int, default=200, help="bytes to generate at the end (0: none)")
    parser.add_argument("--prompt", default="The ", help="the sample's beginning")
    defaults = DecoderConfig()
    for name, help_ in (("dim", "the model's width"), ("n_layers", "layers"), ("n_heads", "attention heads"),
                        ("n_kv_heads", "key/value heads"), ("hidden", "the MLP's width")):
        parser.add_argument(f"--{name}", type=positive_int, default=getattr(defaults, name), help=f"{help_} (default "
                            f"{getattr(defaults, name)})")
    parser.add_argument("--seq_len", type=positive_int, default=64, help="bytes a sequence (default 64)")
    parser.add_argument("--n_experts", type=int, default=0, help="a mixture of this many experts in place of each "
                        "MLP (default 0: the dense MLP)")
    parser.add_argument("--top_k", type=positive_int, default=2, help="experts a token goes to (default 2)")
    args = parser.parse_args(argv)
    args.config = DecoderConfig(dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads,
                                n_kv_heads=args.n_kv_heads, hidden=args.hidden, max_seq_len=args.seq_len,
                                n_experts=args.n_experts, top_k=args.top_k)
    if args.init_from_hf:
        if args.n_experts:
            parser.error("--init_from_hf starts from a Llama, whose MLPs are dense: leave out --n_experts")
        try:
            with open(os.path.join(args.init_from_hf, "config.json")) as f:
                args.config = DecoderConfig.from_hf(json.load(f))
        except (OSError, ValueError, KeyError) as error:
            parser.error(f"--init_from_hf {args.init_from_hf}: not a Llama checkpoint this decoder loads ({error})")
        args.config.max_seq_len = args.seq_len
    c = args.config
    if args.timeout <= 0 or args.lr < 0:
        parser.error("--timeout must be positive, --lr not negative")
    try:  # the text now, not after the process group: a file that is not one is a line here
        text, args.about = read_text(args.data)
    except (OSError, UnicodeDecodeError) as error:
        parser.error(f"--data {args.data}: not a UTF-8 text file this can read ({error})")
    args.train_set, _ = text_splits(text, c.max_seq_len)  # the last tenth held out
    sequences = len(args.train_set)
    if sequences < args.global_batch_size:
        parser.error(f"{args.about} makes {sequences} sequences of {c.max_seq_len} bytes to train on, fewer than "
                     f"--global_batch_size {args.global_batch_size}: give a longer text or a smaller batch")
    if "RANK" not in os.environ:
        parser.error(f"start it with torchrun: torchrun --standalone --nproc_per_node=2 {sys.argv[0]}")
    world_size = int(os.environ["WORLD_SIZE"])
    if args.dp is None and world_size % (args.cp * args.tp * args.pp) == 0:
        args.dp = world_size // (args.cp * args.tp * args.pp)
    if args.dp is None or args.dp * args.cp * args.tp * args.pp != world_size:
        parser.error(f"--dp {args.dp or '?'} x --cp {args.cp} x --tp {args.tp} x --pp {args.pp} must be the "
                     f"{world_size} processes torchrun started (WORLD_SIZE)")
    if args.dp % args.dp_replicate:
        parser.error(f"--dp_replicate {args.dp_replicate} must divide --dp {args.dp}: dp = dp_replicate x dp_shard")
    check_model(parser, c, args.tp)
    if args.n_experts < 0:
        parser.error(f"--n_experts {args.n_experts}: 0 (the dense MLP) or more experts")
    if args.n_experts and args.top_k > args.n_experts:
        parser.error(f"--top_k {args.top_k} of --n_experts {args.n_experts}: a token goes to top_k of the experts")
    if args.ep > 1 and not args.n_experts:
        parser.error(f"--ep {args.ep} splits the experts, and there are none: give --n_experts")
    if args.n_experts % args.ep:
        parser.error(f"--ep {args.ep} must divide --n_experts {args.n_experts}: each ep rank holds an equal share")
    if (args.dp // args.dp_replicate * args.cp) % args.ep:
        parser.error(f"--ep {args.ep} must divide the {args.dp // args.dp_replicate * args.cp} ranks of dp_shard x "
                     "cp: the experts are split over ranks that train on tokens of their own")
    if args.n_experts and args.tp > 1:
        parser.error("--n_experts with --tp: this step splits the experts over ep, not tp; use --ep")
    if c.max_seq_len % (2 * args.cp) or c.max_seq_len // args.cp % args.tp:
        parser.error(f"--seq_len {c.max_seq_len} must cut into 2 x --cp {args.cp} equal chunks, two a cp rank, and "
                     f"each cp rank's {c.max_seq_len / args.cp:g} tokens into --tp {args.tp} equal slices")
    stages = args.pp * (2 if args.schedule in LOOPED | V_SHAPED else 1)
    args.microbatches = args.microbatches or stages  # default: a micro-batch a stage
    if stages > c.n_layers:
        parser.error(f"{stages} stages (--pp {args.pp}, schedule {args.schedule}) are more than the {c.n_layers} "
                     "layers: each stage needs one")
    if args.global_batch_size % (args.dp * args.microbatches):
        parser.error(f"--dp {args.dp} x --microbatches {args.microbatches} must divide --global_batch_size "
                     f"{args.global_batch_size}: every micro-batch has one shape, which the stages agree on")
    if args.schedule in ("1f1b", "interleaved_1f1b") and args.microbatches < args.pp:
        parser.error(f"{args.schedule} needs at least one micro-batch a rank: --microbatches {args.microbatches} < "
                     f"--pp {args.pp}")
    return args


def check_model(parser, c, tp):
    """The model's sizes against its split: one line for any that does not divide."""
    if c.dim % c.n_heads or c.n_heads % c.n_kv_heads or (c.dim // c.n_heads) % 2:
        parser.error(f"--n_heads {c.n_heads} must divide --dim {c.dim} into heads of an even size, and --n_kv_heads "
                     f"{c.n_kv_heads} must divide --n_heads")
    for name, size in (("--n_heads", c.n_heads), ("--n_kv_heads", c.n_kv_heads), ("--hidden", c.hidden),
                       ("the vocabulary", c.vocab_size), ("--seq_len", c.max_seq_len)):
        if size % tp:
            parser.error(f"tp {tp} does not divide {name} ({size}): each tp rank takes an equal share of the heads, "
                         "the MLP's units and the vocabulary, and an equal slice of the sequence")


def positive_int(text):
    if not text.lstrip("-").isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return int(text)


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


if __name__ == "__main__":
    try:
        main(parse_args())
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
