"""Runs a script (argv[1], its flags after it) with torch.distributed's collectives and point-to-point calls checked:
a tensor that is not contiguous stops the run with a line naming the call and the tensor's shape and strides. gloo
sends a view's storage, not its elements, for some of them (scatter's output, all_to_all's input in the backward of
torch.distributed.nn's all_gather): values scrambled without an error, pytorch#192920. At exit each rank prints
    contiguity checked: rank 0, 1234 calls
DTensor's functional collectives go through C++ and are not seen here; FSDP2's, DCP's, the pipeline's and
context_parallel.py's and expert_parallel.py's calls are.
"""
import atexit
import functools
import os
import runpy
import sys

import torch
import torch.distributed as dist

# isend and irecv stay as they are (P2POp checks that it is given them): batch_isend_irecv checks their tensors.
CALLS = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
         "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "scatter", "gather", "send", "recv",
         "batch_isend_irecv")
checked = [0]


def tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors(item)
    elif isinstance(value, dist.P2POp):
        yield value.tensor


def checking(name, call):
    @functools.wraps(call)
    def run(*args, **kwargs):
        for tensor in tensors([*args, *kwargs.values()]):
            if not tensor.is_contiguous():
                raise AssertionError(f"non-contiguous tensor to torch.distributed.{name}: shape {list(tensor.shape)}, "
                                     f"strides {list(tensor.stride())}")
        checked[0] += 1
        return call(*args, **kwargs)
    return run


if __name__ == "__main__":
    for call_name in CALLS:
        setattr(dist, call_name, checking(call_name, getattr(dist, call_name)))
    atexit.register(lambda: print(f"contiguity checked: rank {os.environ['RANK']}, {checked[0]} calls", flush=True))
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))  # as python script.py would
    runpy.run_path(sys.argv[0], run_name="__main__")
