"""Bytes of parameters, gradients and optimizer state: what a rank holds, against what DDP's full copies take."""
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def tensor_bytes(tensors):
    """The bytes of `tensors`, each counted whole (unsharded)."""
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def optimizer_state_bytes(optimizer):
    """Bytes of the tensors in the optimizer state this rank holds: its shard under ZeroRedundancyOptimizer."""
    optimizer = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local optimizer
    return tensor_bytes(value for state in optimizer.state.values()
                        for value in state.values() if torch.is_tensor(value))


def optimizer_state_report(optimizer):
    """Every rank calls it (a collective): the line that says how many bytes of optimizer state each rank holds."""
    held = [None] * dist.get_world_size()
    dist.all_gather_object(held, optimizer_state_bytes(optimizer))
    return (f"Optimizer state | {', '.join(map(str, held))} bytes on ranks 0 to {len(held) - 1} ({sum(held)} in all) | "
            f"{type(optimizer).__name__}")


def held_bytes(tensors):
    """The bytes of memory this rank holds for `tensors`, each storage counted once: a DTensor's local shard
    with FSDP's padding, a plain tensor whole."""
    storages = {}
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


def memory_report(model, optimizer):
    """Every rank calls this after a training step; the report, a line per rank: the bytes of parameters,
    gradients and optimizer state the rank holds, measured, beside what a DDP rank holds of each (full copies)."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    states = [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)
              and v.dim() > 0]  # scalar entries (Adam's step) are no model-sized state
    held = [None] * dist.get_world_size()
    dist.all_gather_object(held, (held_bytes(params), held_bytes(grads), held_bytes(states)))
    full = (tensor_bytes(params), tensor_bytes(grads), tensor_bytes(states))  # what a DDP rank holds
    return "\n".join(f"Rank {rank} holds params {p:,} B | grads {g:,} B | optimizer state {o:,} B; DDP would hold "
                     f"{full[0]:,} | {full[1]:,} | {full[2]:,} B" for rank, (p, g, o) in enumerate(held))
