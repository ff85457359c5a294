"""What a training run tells its user as it goes: the summary line every training script ends with."""
import torch.distributed as dist


def summary_line(epochs, steps, final_loss, samples, wall_s, world_size=None, backend=None):
    """The line every training script ends with, so runs can be compared at a glance (and tests can read them).
    The world size and backend default to the process group's (1 and none without one)."""
    if world_size is None:
        world_size, backend = (dist.get_world_size(), dist.get_backend()) if dist.is_initialized() else (1, "none")
    return (f"Summary: epochs {epochs} | steps {steps} | final loss {final_loss:.6f} | "
            f"samples/s {samples / max(wall_s, 1e-9):.1f} | wall {wall_s:.2f}s | "
            f"world size {world_size} | backend {backend}")
