"""What the example scripts share but none of them is about.

- ``cli``: argument types, one-line errors instead of tracebacks, the flags every training script has.
- ``distributed``: backend and device choice, free ports, launcher detection, the summary line.
- ``snapshot``: atomic snapshots with model, optimizer, epoch counter and RNG states.
- ``sharding``: a sampler that puts every sample on exactly one rank; what uneven shards need around Join.
- ``models``: the tutorial MLP, the linear classifier and SimpleCNN.
- ``data``: deterministic synthetic datasets and an MNIST IDX reader.
- ``hf_data``: MNIST as a ``datasets`` dataset (Hub, IDX files or save_to_disk) and its collate function.
- ``mpi``: from an mpirun launch to the variables torch.distributed reads.
- ``collectives``: the collectives of the run_with_* scripts, each checked exactly on every rank.
- ``envfile``: MASTER_ADDR and MASTER_PORT from a .env file, validated.

The lesson of each script (how its launcher starts processes, how DDP wraps the model,
how the training loop runs) stays in the script itself.
"""

# Imported here, before any script creates its process group: torch.distributed.nn gives its functions
# `group=group.WORLD` as default arguments. DDP's constructor imports it lazily, and imported then those
# defaults hold the live group for good: destroy_process_group() can no longer free it, gloo's worker
# threads run on into interpreter shutdown, and one of them finishing a collective there takes the GIL,
# is ended by Python with pthread_exit and aborts the process ("terminate called without an active
# exception", SIGABRT) after the run has finished. Imported first, the defaults are None.
# (Found with a core dump: README, "Clean exits"; benchmarks/clean_exit.py counts them.)
import torch.distributed.nn  # noqa: E402,F401
