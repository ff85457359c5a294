"""Launched by tests/test_parallelism.py under torchrun with 4 processes: context_parallel.py's attention against
one process's SDPA, and expert_parallel.py's dispatch of language_model.MoE against the whole MoE in one process,
in float64, forward and backward, at 2 (two groups of 2) and 4 processes. Each rank computes the one-process
reference itself from the same seeded tensors. Prints one line per check, from rank 0, the largest absolute error
over every rank:
    cp 2 ring | forward 1.1e-16 | dq 2.2e-16 | dk 2.2e-16 | dv 1.1e-16
    ep 2 | forward 0.0e+00 | dx 0.0e+00 | drouter 0.0e+00 | dexperts 0.0e+00 | tokens per expert 9 7 ...
With a script after it (and the script's flags), its process group destroyed, it then runs that script as
`python script.py` would, in the same processes: the test's launch of nd_parallel.py carries these checks, rather
than 4 more processes' start-up.

    torchrun --standalone --nproc_per_node=4 tests/support/parallel_layers_check.py
    torchrun --standalone --nproc_per_node=4 tests/support/parallel_layers_check.py nd_parallel.py --cp 4
"""
import os
import runpy
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository
import context_parallel
from context_parallel import CP_ATTENTION, shard_sequence
from expert_parallel import dispatch
from language_model import MoE, DecoderConfig


def worst(error):
    error = torch.tensor(error, dtype=torch.float64)
    dist.all_reduce(error, op=dist.ReduceOp.MAX)
    return error.item()


def check_cp(groups, form):
    """Queries, keys and values of one sequence of 32 tokens (8 heads, 4 key/value heads), the whole on every rank:
    each cp rank's slice through `form`, the whole through SDPA; outputs and gradients compared slice by slice."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, 32, 8, generator=generator, dtype=torch.float64) for heads in (8, 4, 4))
    weights = torch.randn(2, 8, 32, 8, generator=generator, dtype=torch.float64)  # a loss that weighs every output
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*whole, is_causal=True, enable_gqa=True)
    (out * weights).sum().backward()
    group = next(g for ranks, g in groups if dist.get_rank() in ranks)
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    local = [shard_sequence(t, rank, cp, dim=2).detach().requires_grad_() for t in (q, k, v)]
    local_out = CP_ATTENTION[form](*local, group)
    (local_out * shard_sequence(weights, rank, cp, dim=2)).sum().backward()
    errors = [(local_out - shard_sequence(out, rank, cp, dim=2)).abs().max().item()]
    errors += [(mine.grad - shard_sequence(ref.grad, rank, cp, dim=2)).abs().max().item()
               for mine, ref in zip(local, whole)]
    errors = [worst(e) for e in errors]
    if dist.get_rank() == 0:
        print(f"cp {cp} {form} | forward {errors[0]:.1e} | dq {errors[1]:.1e} | dk {errors[2]:.1e} | "
              f"dv {errors[3]:.1e}", flush=True)


def check_ep(groups):
    """A top-2 mixture of 8 experts; each rank its own 2 sequences of 16 tokens, routed by its copy of the router to
    the experts of all the group's ranks (each holds 8 / ep); the reference: one MoE on the group's sequences
    together. Outputs, input gradients, the router's gradient (summed over the ranks) and each rank's experts'."""
    config = DecoderConfig(dim=16, hidden=32, n_experts=8, top_k=2)
    group_ranks, group = next((ranks, g) for ranks, g in groups if dist.get_rank() in ranks)
    ep, rank = len(group_ranks), dist.get_rank(group)
    generator = torch.Generator().manual_seed(1)
    whole = MoE(config).double()
    with torch.no_grad():
        for p in whole.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64) * 0.3)
    x = torch.randn(2 * ep, 16, 16, generator=generator, dtype=torch.float64)
    weights = torch.randn(2 * ep, 16, 16, generator=generator, dtype=torch.float64)
    whole.balance_scale = 1.0  # the balance loss's gradient, large enough to see
    x_whole = x.clone().requires_grad_()
    out = whole(x_whole)
    (out * weights).sum().backward()
    mine = slice(2 * rank, 2 * rank + 2)
    local = MoE(DecoderConfig(dim=16, hidden=32, n_experts=8, top_k=2)).double()
    local.load_state_dict(whole.state_dict())
    local.experts = type(whole.experts)(8 // ep, 16, 32).double()  # this rank's experts alone
    experts = slice(rank * 8 // ep, (rank + 1) * 8 // ep)
    with torch.no_grad():
        for name, p in local.experts.named_parameters():
            p.copy_(getattr(whole.experts, name)[experts])
    local.balance_scale = 1.0
    local.dispatch = lambda experts_, routed, counts: dispatch(experts_, routed, counts, group)
    x_local = x[mine].clone().requires_grad_()
    local_out = local(x_local)
    (local_out * weights[mine]).sum().backward()
    router = local.router.weight.grad.clone()
    dist.all_reduce(router, group=group)
    errors = [(local_out - out[mine]).abs().max().item(), (x_local.grad - x_whole.grad[mine]).abs().max().item(),
              (router - whole.router.weight.grad).abs().max().item(),
              max((p.grad - getattr(whole.experts, name).grad[experts]).abs().max().item()
                  for name, p in local.experts.named_parameters())]
    errors = [worst(e) for e in errors]
    if dist.get_rank() == 0:
        print(f"ep {ep} | forward {errors[0]:.1e} | dx {errors[1]:.1e} | drouter {errors[2]:.1e} | dexperts "
              f"{errors[3]:.1e} | tokens per expert {' '.join(map(str, whole.routed.tolist()))}", flush=True)


def main():
    dist.init_process_group("gloo")
    tile = context_parallel.TILE
    context_parallel.TILE = 3  # the ring's keys in tiles of 3: several a block, the last one short
    torch.set_num_threads(1)
    pairs = [[0, 1], [2, 3]]
    groups = {2: [(ranks, dist.new_group(ranks)) for ranks in pairs], 4: [([0, 1, 2, 3], dist.group.WORLD)]}
    for cp in (2, 4):
        for form in CP_ATTENTION:
            check_cp(groups[cp], form)
    for ep in (2, 4):
        check_ep(groups[ep])
    del groups  # nothing may hold a group past destroy_process_group (the tests' probe checks)
    dist.destroy_process_group()
    context_parallel.TILE = tile  # the script after these checks tiles as it would alone


if __name__ == "__main__":
    main()
    if len(sys.argv) > 1:  # the script to run next, as `python script.py flags` would
        sys.argv = sys.argv[1:]
        sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
        runpy.run_path(sys.argv[0], run_name="__main__")
