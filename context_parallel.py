"""Context parallelism for the decoder of step 8: the sequence split over the ranks of a cp group, causal attention
still over all of it. nd_parallel.py imports it: copy it beside nd_parallel.py, language_model.py and
fsdp_checkpoint.py. It lives in a file of its own because it is the one part of the step that is attention's
arithmetic rather than its placement on the mesh.

Why not torch's own context_parallel(): on torch 2.13 its ring kernels are registered for CUDA's attention ops
only (on the CPU the causal forward and every backward fail). These two forms are plain torch ops on any device,
and autograd differentiates them:
- ring_attention: each rank keeps its queries and passes its keys and values round the ring, cp - 1 hops; each
  block's partial result is merged with the others' by their log-sum-exp (the online softmax of flash attention).
  A rank never holds more than two ranks' keys at once in the forward.
- allgather_attention: every rank gathers all keys and values (Llama 3's way, small next to the queries under
  grouped-query attention) and masks by the tokens' positions.

Their cost: autograd keeps each block's scores, (seq / cp) x seq a head on every rank, 1/cp of one process's
plain attention, but more than a flash kernel keeps (none; SDPA on one process, torch's own ring on CUDA). A
flash-style version would run each block through SDPA and recompute in an explicit backward from the merged
output and log-sum-exp.

The sequence is laid out as torchtitan's load balancer does: cut into 2 cp chunks, rank i holds chunks i and
2cp-1-i. Under the causal mask an early chunk sees few keys and a late one many: one of each, every rank does the
same work.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F


def shard_sequence(x, rank, cp, dim=1):
    """The chunks i and 2cp-1-i of x's sequence (dim), side by side: rank i's part."""
    chunks = x.chunk(2 * cp, dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim)


def positions(seq_len, rank, cp, device=None):
    """The places in the whole sequence of rank `rank`'s tokens: their rotary angles and causal mask use them."""
    return shard_sequence(torch.arange(seq_len, device=device), rank, cp, dim=0)


def send_round(x, group, step):
    """x to the rank `step` further round the group; what the rank `step` behind sent, back. Contiguous first:
    gloo sends a view's storage, not its elements (pytorch#192920)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    x = x.contiguous()
    received = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x, group=group, group_peer=(rank + step) % size),
           dist.P2POp(dist.irecv, received, group=group, group_peer=(rank - step) % size)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return received


class RingPass(torch.autograd.Function):
    """One hop of the ring, differentiable: forward to the next rank, and the gradient back to the previous one."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return send_round(x, group, 1)

    @staticmethod
    def backward(ctx, grad):
        return send_round(grad, ctx.group, -1), None


class GatherSequence(torch.autograd.Function):
    """x from every rank of the group, stacked in rank order; backward, each rank's slice of the gradients summed
    over the ranks (a reduce-scatter, which gloo lacks: an all-reduce, then this rank's slice)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        gathered = x.new_empty(dist.get_world_size(group) * x.shape[0], *x.shape[1:])  # gloo: along dim 0
        dist.all_gather_single(gathered, x.contiguous(), group=group)
        return gathered.view(-1, *x.shape)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()  # SDPA's gradients are views: gloo would send the wrong elements (pytorch#192920)
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def attend(q, k, v, causal):
    """Softmax attention of q over one block of keys [batch, heads, seq, head_dim]: (output, log-sum-exp of each
    query's scores). The log-sum-exp is what merges the blocks' outputs into attention over all of them."""
    repeats = q.shape[1] // k.shape[1]  # grouped-query attention: a key/value head serves `repeats` query heads
    k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    if causal:  # the block on the diagonal: a query sees the keys up to its own position
        later = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(later, float("-inf"))
    lse = scores.logsumexp(-1, keepdim=True)
    return torch.exp(scores - lse) @ v, lse


def merge(out, lse, block_out, block_lse):
    """Two blocks' attention outputs as one over both blocks' keys: each weighted by its share of the softmax."""
    both = torch.logaddexp(lse, block_lse)
    return out * torch.exp(lse - both) + block_out * torch.exp(block_lse - both), both


def ring_attention(q, k, v, group):
    """Causal attention of this rank's queries over the whole sequence, the keys and values passed round the ring.
    Every rank holds chunks (i, 2cp-1-i), each c tokens. After `step` hops a rank holds rank j = i - step's keys:
    j < i: chunk j comes before both of ours, chunk 2cp-1-j after both: all our queries, j's first chunk;
    j > i: both of j's chunks fall between ours: our second chunk's queries, all of j's keys.
    Either way c x 2c scores: every rank, every hop, the same work (the load balancing's point)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    c = q.shape[2] // 2
    out, lse = attend(q, k, v, causal=True)  # our own two chunks, in order: the causal mask of the whole
    kv = torch.stack([k, v])  # one message a hop
    for step in range(1, cp):
        kv = RingPass.apply(kv, group)  # a GPU version would send the next hop while computing this one
        if (rank - step) % cp < rank:
            out, lse = merge(out, lse, *attend(q, kv[0, :, :, :c], kv[1, :, :, :c], causal=False))
        else:
            late_out, late_lse = merge(out[:, :, c:], lse[:, :, c:], *attend(q[:, :, c:], kv[0], kv[1], causal=False))
            out, lse = torch.cat([out[:, :, :c], late_out], 2), torch.cat([lse[:, :, :c], late_lse], 2)
    return out


def allgather_attention(q, k, v, group):
    """Causal attention of this rank's queries over every rank's keys and values, gathered (Llama 3's way): the
    mask compares the tokens' places in the whole sequence, which the load balancing has reordered."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    seq_len = q.shape[2] * cp
    kv = GatherSequence.apply(torch.stack([k, v]), group)  # [cp, 2, batch, heads, seq / cp, head_dim]
    k, v = (kv[:, i].permute(1, 2, 0, 3, 4).flatten(2, 3) for i in (0, 1))  # rank by rank along the sequence
    keys = torch.cat([positions(seq_len, r, cp, q.device) for r in range(cp)])
    mask = keys[None, :] <= positions(seq_len, rank, cp, q.device)[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


CP_ATTENTION = {"ring": ring_attention, "allgather": allgather_attention}
