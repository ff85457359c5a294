"""diagnose: which rank, which collective, which line, when a distributed job hangs or loses a rank.

    python -m diagnose [--timeout SECONDS] [--keep-waiting] LAUNCH COMMAND ...
    python -m diagnose --timeout 60 torchrun --standalone --nproc_per_node=2 train.py
    python -m diagnose python train_spawn.py                    # a script that calls mp.spawn
    python -m diagnose mpirun -np 2 python train.py
    python -m diagnose srun -N 2 --ntasks-per-node=1 python train.py

The script is not edited and imports nothing of this repository: every Python process of the job loads
diagnose/site/sitecustomize.py (put first on PYTHONPATH, handing on to any other sitecustomize), which watches
each process group once the script makes it (diagnose/rank.py). Once a collective has waited longer than
--timeout (default 300 s), whatever the group's own timeout, the ranks ask each other through the group's store
and one line per host names the rank that did not arrive, the collective (its number, kind and shapes), the line
of the script that called it (for DDP, the backward() line), and what the missing rank is doing: in its own code
(with its line), gone (with its exit code or signal), or in another collective. Then the job ends, exit code 1,
unless --keep-waiting. A rank that dies is named at once by the ranks it leaves. Each rank writes its flight
recorder dump for torchfrtrace. See docs/hangs.md.
"""
