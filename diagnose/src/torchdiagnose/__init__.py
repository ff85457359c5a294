"""torchdiagnose: which rank, which collective, which line, when a PyTorch distributed job hangs or loses a rank.

    torchdiagnose [--timeout SECONDS] [--keep-waiting] LAUNCH COMMAND ...      (or: python -m torchdiagnose ...)
    torchdiagnose --timeout 60 torchrun --standalone --nproc_per_node=2 train.py
    torchdiagnose python train_spawn.py                     # a script that calls mp.spawn
    torchdiagnose mpirun -np 2 python train.py
    torchdiagnose srun -N 2 --ntasks-per-node=1 python train.py

Install it where the job's Python runs (pip install ./diagnose from the repository); the script is not edited.
Every Python process of the job loads the tool at start-up (torchdiagnose-hook.pth, only under this prefix), and
it watches each process group once the script makes it. Once a collective has waited longer than --timeout
(default 300 s), whatever the group's own timeout, the ranks ask each other through the group's store and one line
per host names the rank that did not arrive, the collective (its number, kind and shapes; DTensor's with its
parallel style and module; for a pipeline, the send or recv and the stage it waits on), the line of the script
that called it (for DDP, the backward() line), and what the missing rank is doing: in its own code (its line,
busy or idle), stopped (SIGSTOP, Ctrl-Z, a debugger), gone (its exit code or signal), or in another collective. A
rank that dies is named at once by the ranks it leaves; init_process_group that waits or fails is one line too.
Then the tool ends the job (exit code 1; --keep-waiting: it lets it go on) and says the line again as the last
line of the output, after the launcher's report. Each rank writes its flight recorder dump for torchfrtrace.
"""
__version__ = "0.2.0"
TESTED_TORCH = ("2.13.0",)  # the torch releases the tests ran on (CPU and CUDA builds)
