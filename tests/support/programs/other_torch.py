"""A torch without one of the private APIs the tool reads: here, the flight recorder's reader, taken away."""
import torch
import torch.distributed as dist

del torch._C._distributed_c10d._dump_fr_trace
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:12355", rank=0, world_size=1)
dist.all_reduce(torch.ones(3))
dist.destroy_process_group()
print("done", flush=True)
