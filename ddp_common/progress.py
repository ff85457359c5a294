"""What a training run tells its user as it goes: progress within a long epoch, and the summary line every
training script ends with."""
import sys
import time

import torch.distributed as dist
from tqdm import tqdm


def summary_line(epochs, steps, final_loss, samples, wall_s, world_size=None, backend=None):
    """The line every training script ends with, so runs can be compared at a glance (and tests can read them).
    The world size and backend default to the process group's (1 and none without one)."""
    if world_size is None:
        world_size, backend = (dist.get_world_size(), dist.get_backend()) if dist.is_initialized() else (1, "none")
    return (f"Summary: epochs {epochs} | steps {steps} | final loss {final_loss:.6f} | "
            f"samples/s {samples / max(wall_s, 1e-9):.1f} | wall {wall_s:.2f}s | "
            f"world size {world_size} | backend {backend}")


class Progress:
    """Rank 0's view of a long epoch. On a terminal, a tqdm bar; when the output goes to a file or a log, a plain
    line every tenth of the epoch and at least every `every_s` seconds: steps done, samples/s, time left. log()
    prints a line (a checkpoint written, say) without breaking the bar. Ranks other than 0 pass enabled=False."""

    def __init__(self, epoch, steps, done=0, enabled=True, every_s=60.0):
        self.epoch, self.steps, self.done, self.enabled, self.every_s = epoch, steps, done, enabled, every_s
        self.start, self.samples, self.initial_done = time.perf_counter(), 0, done
        self.last_line, self.last_step = self.start, done
        self.bar = None
        if enabled and sys.stderr.isatty():
            self.bar = tqdm(total=steps, initial=done, desc=f"Epoch {epoch}", unit="step", dynamic_ncols=True)

    def update(self, samples):
        """One step done, of `samples` samples over all ranks."""
        self.done += 1
        self.samples += samples
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
            return
        now = time.perf_counter()
        if self.done - self.last_step >= max(1, self.steps // 10) or now - self.last_line >= self.every_s:
            rate = self.samples / max(now - self.start, 1e-9)
            left = (self.steps - self.done) * (now - self.start) / max(self.done - self.initial_done, 1)
            print(f"Epoch {self.epoch} | step {self.done}/{self.steps} | {rate:.1f} samples/s | "
                  f"{left:.0f}s left in the epoch", flush=True)
            self.last_line, self.last_step = now, self.done

    def log(self, text):
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()
