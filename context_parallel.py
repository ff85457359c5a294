"""Context parallelism for the decoder of step 8: the sequence split over the ranks of a cp group, causal attention
still over all of it. nd_parallel.py imports it: copy it beside nd_parallel.py, language_model.py and
fsdp_checkpoint.py. It is the one part of the step that is attention's arithmetic, not placement on the mesh.

Why not torch's own context_parallel(): on torch 2.13 its ring kernels are registered for CUDA's attention ops
only (on the CPU the causal forward and every backward fail). This is flash attention in plain torch ops, any
device: the scores a TILE x TILE tile at a time, each tile's output merged with the rest by the log-sum-exp (the
online softmax); kept for the backward: q, k, v, the output and the log-sum-exp, never the scores. The backward
recomputes each tile's probabilities from them. Each rank keeps its queries and gets the others' keys and values:
- ring_attention passes them round the ring, cp - 1 hops, and their gradients travel back home with them;
- allgather_attention gathers them all (Llama 3's way: small next to the queries under grouped-query attention).
Measured (docs/parallelism.md): in the memory one process's SDPA needs for a sequence, the ring fits one cp times
as long (a rank holds 1/cp of the activations and a few tiles' scores), the all-gather less (every rank's keys and
values, and their gradients); both slower (tiles in Python, no overlap of sending and computing: on a GPU, flash
kernels and torch's own ring do both).

The sequence is laid out as torchtitan's load balancer does: cut into 2 cp chunks, rank i holds chunks i and
2cp-1-i. Under the causal mask an early chunk sees few keys and a late one many: one of each, every rank does the
same work.
"""
import torch
import torch.distributed as dist


def shard_sequence(x, rank, cp, dim=1):
    """The chunks i and 2cp-1-i of x's sequence (dim), side by side: rank i's part."""
    chunks = x.chunk(2 * cp, dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim)


def positions(seq_len, rank, cp, device=None):
    """The places in the whole sequence of rank `rank`'s tokens: their rotary angles use them."""
    return shard_sequence(torch.arange(seq_len, device=device), rank, cp, dim=0)


def send_round(x, group, step=1):
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


TILE = 128  # tokens a side of a tile: a rank holds TILE x TILE scores a head at once, never its queries x keys


def tiles(q, k, causal):
    """(query rows, key columns, on the diagonal) of each TILE x TILE tile of q's scores over k. Causal: q and k
    start at the same place and a query sees the keys up to its own: the tiles above the diagonal are skipped."""
    for i in range(0, q.shape[-2], TILE):
        for j in range(0, i + 1 if causal else k.shape[-2], TILE):
            yield slice(i, i + TILE), slice(j, j + TILE), causal and i == j


def scores(q, k, diagonal):
    """q's scores over the keys k, [batch, kv heads, q heads a kv head, seq, seq]; on the diagonal, causal."""
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    later = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
    return s.masked_fill(later, float("-inf")) if diagonal else s


def attend(q, k, v, out, lse, causal):
    """Adds keys k and values v to q's attention so far (out, and each query's log-sum-exp lse), in place, a tile at
    a time: each tile's output weighted by its share of the softmax."""
    for rows, keys, diagonal in tiles(q, k, causal):
        o, m = out[..., rows, :], lse[..., rows, :]  # views: written in place
        s = scores(q[..., rows, :], k[..., keys, :], diagonal)
        both = torch.logaddexp(m, s.logsumexp(-1, keepdim=True))
        o.copy_(o * torch.exp(m - both) + torch.exp(s - both) @ v[..., keys, :])
        m.copy_(both)


def attend_backward(q, k, v, dout, delta, lse, dq, dk, dv, causal):
    """attend's gradients, added to dq, dk, dv in place, tile by tile: P = exp(scores - lse), dV = P^T dO,
    dS = P (dO V^T - rowsum(dO O)) x scale, dQ = dS K, dK = dS^T Q; a key/value head's summed over its query heads."""
    for rows, keys, diagonal in tiles(q, k, causal):
        p = torch.exp(scores(q[..., rows, :], k[..., keys, :], diagonal) - lse[..., rows, :])
        dv[..., keys, :] += (p.transpose(-2, -1) @ dout[..., rows, :]).sum(2, keepdim=True)
        ds = p * (dout[..., rows, :] @ v[..., keys, :].transpose(-2, -1) - delta[..., rows, :]) * q.shape[-1] ** -0.5
        dq[..., rows, :] += ds @ k[..., keys, :]
        dk[..., keys, :] += (ds.transpose(-2, -1) @ q[..., rows, :]).sum(2, keepdim=True)


def block(rank, step, cp, c):
    """Which of our queries see which keys of rank j = rank - step (held after `step` hops), every rank holding
    chunks (i, 2cp-1-i) of c tokens. Our own: all, in order (causal). j < rank: chunk j comes before both of ours,
    2cp-1-j after both: all our queries, j's first chunk. j > rank: both of j's chunks fall between ours: our second
    chunk's queries, all of j's keys. Either way c x 2c scores: every rank, every hop, the same work."""
    if step == 0:
        return slice(None), slice(None), True
    if (rank - step) % cp < rank:
        return slice(None), slice(0, c), False
    return slice(c, None), slice(None), False


def gather(x, group):
    """x from every rank of the group, [cp, *x.shape] in rank order (gloo gathers along dim 0)."""
    everyone = x.new_empty(dist.get_world_size(group) * x.shape[0], *x.shape[1:])
    dist.all_gather_single(everyone, x.contiguous(), group=group)
    return everyone.view(-1, *x.shape)


def held(x, group, step, gathered):
    """(x, rank (rank - step)'s part): x all the ranks' parts, gathered ([cp, ...]), or passed on a hop."""
    if gathered:
        return x, x[(dist.get_rank(group) - step) % dist.get_world_size(group)]
    x = send_round(x, group) if step else x  # a GPU version would send the next hop while computing this one
    return x, x


class ContextAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over the whole sequence: the others' keys and values passed round
    the ring (cp - 1 hops) or gathered at once. It keeps q, k, v, the output and the log-sum-exp, no scores. The
    backward gets the keys and values again the same way; their gradients go home with them round the ring (one
    more hop at the end), or summed over the ranks (an all-reduce: gloo lacks reduce-scatter)."""

    @staticmethod
    def forward(ctx, q, k, v, group, gathered):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        q5 = q.unflatten(1, (k.shape[1], -1))  # grouped-query attention: the query heads of each key/value head
        out, lse = torch.zeros_like(q5), q5.new_full((*q5.shape[:-1], 1), float("-inf"))
        kv = torch.stack([k, v]).unsqueeze(3)  # one message: [2, batch, kv heads, 1, seq, head_dim]
        kv = gather(kv, group) if gathered else kv
        for step in range(cp):
            kv, part = held(kv, group, step, gathered)
            rows, keys, causal = block(rank, step, cp, q.shape[2] // 2)
            attend(q5[..., rows, :], part[0][..., keys, :], part[1][..., keys, :], out[..., rows, :],
                   lse[..., rows, :], causal)
        ctx.group, ctx.gathered = group, gathered
        ctx.save_for_backward(q, k, v, out, lse)
        return out.flatten(1, 2)

    @staticmethod
    def backward(ctx, dout):
        (q, k, v, out, lse), group = ctx.saved_tensors, ctx.group
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        q5, dout = q.unflatten(1, (k.shape[1], -1)), dout.unflatten(1, (k.shape[1], -1))
        delta, dq = (dout * out).sum(-1, keepdim=True), torch.zeros_like(q5)
        kv = torch.stack([k, v]).unsqueeze(3)
        kv = gather(kv, group) if ctx.gathered else kv
        kv = torch.cat([kv, torch.zeros_like(kv)], -6)  # k, v, and their gradients: dk, dv
        for step in range(cp):
            kv, part = held(kv, group, step, ctx.gathered)
            rows, keys, causal = block(rank, step, cp, q.shape[2] // 2)
            attend_backward(q5[..., rows, :], part[0][..., keys, :], part[1][..., keys, :], dout[..., rows, :],
                            delta[..., rows, :], lse[..., rows, :], dq[..., rows, :], part[2][..., keys, :],
                            part[3][..., keys, :], causal)
        if ctx.gathered:  # every rank's gradients, summed over the ranks: ours kept
            grads = kv[:, 2:].contiguous()
            dist.all_reduce(grads, group=group)
            dk, dv = grads[rank].squeeze(3)
        else:  # home round the ring: one more hop
            dk, dv = (send_round(kv[2:], group) if cp > 1 else kv[2:]).squeeze(3)
        return dq.flatten(1, 2), dk, dv, None, None


def ring_attention(q, k, v, group):
    """Causal attention of this rank's queries over the whole sequence, [batch, heads, seq, dim], the keys and
    values passed round the ring: a rank holds two ranks' at most."""
    return ContextAttention.apply(q, k, v, group, False)


def allgather_attention(q, k, v, group):
    """The same, every rank's keys and values gathered (Llama 3's way: small under grouped-query attention)."""
    return ContextAttention.apply(q, k, v, group, True)


CP_ATTENTION = {"ring": ring_attention, "allgather": allgather_attention}
