"""What the example scripts share but none of them is about. Importing it changes nothing in torch.

- ``cli``: the flags the scripts share, and ``cli.run``, the entry point that turns an error into one line.
- ``launchers``: what the launcher told this process (torchrun, mp.spawn, mpirun), elastic jobs.
- ``devices``: checks of the backend against the machine, CPU cores shared between processes.
- ``rendezvous``: free ports, addresses checked before any process starts, a store that survives restarts.
- ``mpi``: from an mpirun launch to the variables torch.distributed reads.
- ``snapshot``: snapshot files written atomically, checked when read, claimed by one run at a time.
- ``checkpoint_dir``: the directories of sharded (DCP) checkpoints: complete ones only, newest first.
- ``teardown``: what must let go of the process group before destroy_process_group, for a clean exit.
- ``memory``: bytes of parameters, gradients and optimizer state that a rank holds.
- ``progress``: the summary line every training script ends with.
- ``sharding``: a sampler that puts every sample on exactly one rank (no padding).
- ``comm_hooks``: DDP communication hooks by name, their bytes per step, PowerSGD's state.
- ``collectives``: the collectives of the run_with_* scripts, each checked exactly on every rank.
- ``models``, ``data``, ``mnist``: the models, synthetic datasets, and MNIST from its IDX files.

What a script teaches (how its launcher starts processes, the device and process group, the DDP or FSDP
wrap, the sampler, what its snapshot holds and who saves it) stays in the script itself.
"""
