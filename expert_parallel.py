"""Expert parallelism for the mixture of experts of language_model.py (MoE): the experts split over the ranks of an
ep group, each token sent to the rank that holds its expert and its output sent back, by all-to-all. nd_parallel.py
imports it: copy it beside nd_parallel.py and language_model.py. The layer itself (router, experts, balance loss)
is the model's, in language_model.py; this file is only how its tokens travel.

Dropless: a rank takes every token sent to its experts, however many, so the all-to-all's sizes change from step
to step. Each rank first tells every other how many tokens it will send to each of its experts (a small
all-to-all of counts), then sends the tokens themselves (all_to_all_single with those splits).
"""
import torch
import torch.distributed as dist


def all_to_all(x, receive_splits, send_splits, group):
    """x's rows cut by send_splits, piece r to rank r; the pieces received, in rank order. Contiguous first: gloo
    sends a view's storage, not its elements (pytorch#192920)."""
    received = x.new_empty(sum(receive_splits), *x.shape[1:])
    dist.all_to_all_single(received, x.contiguous(), receive_splits, send_splits, group=group)
    return received


class AllToAll(torch.autograd.Function):
    """all_to_all, differentiable: the backward sends each gradient piece back where its row came from."""

    @staticmethod
    def forward(ctx, x, receive_splits, send_splits, group):
        ctx.splits, ctx.group = (receive_splits, send_splits), group
        return all_to_all(x, receive_splits, send_splits, group)

    @staticmethod
    def backward(ctx, grad):
        receive_splits, send_splits = ctx.splits
        return all_to_all(grad, send_splits, receive_splits, ctx.group), None, None, None


def dispatch(experts, routed, counts, group):
    """The experts' outputs for `routed`, this rank's tokens grouped by expert (counts[e] for expert e of all
    of them), computed where the experts live: expert e on rank e // (experts a rank)."""
    ep = dist.get_world_size(group)
    local = len(counts) // ep  # experts a rank
    # 1. The counts: received[r * local + e]: the tokens rank r sends to this rank's expert e.
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    send_splits = counts.view(ep, local).sum(1).tolist()
    receive_splits = received.view(ep, local).sum(1).tolist()
    # 2. The tokens, grouped by rank then expert; regrouped by expert to run each expert once.
    tokens = AllToAll.apply(routed, receive_splits, send_splits, group)
    pieces = tokens.split(received.tolist())
    by_expert = [r * local + e for e in range(local) for r in range(ep)]
    out = experts(torch.cat([pieces[i] for i in by_expert]), received.view(ep, local).sum(0))
    # 3. The outputs back into rank-then-expert order, and home.
    pieces = dict(zip(by_expert, out.split([int(received[i]) for i in by_expert])))
    return AllToAll.apply(torch.cat([pieces[i] for i in range(ep * local)]), send_splits, receive_splits, group)
