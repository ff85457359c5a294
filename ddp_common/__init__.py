"""What the example scripts share but none of them is about.

- ``cli``: argument types, one-line errors instead of tracebacks, the flags every training script has.
- ``distributed``: backend and device choice, free ports, launcher detection, the summary line.
- ``snapshot``: atomic snapshots with model, optimizer, epoch counter and RNG states.
- ``models``: the tutorial MLP, the linear classifier and SimpleCNN.
- ``data``: deterministic synthetic datasets and an MNIST IDX reader.
- ``hf_data``: MNIST as a ``datasets`` dataset (Hub, IDX files or save_to_disk) and its collate function.
- ``mpi``: from an mpirun launch to the variables torch.distributed reads.
- ``collectives``: the collectives of the run_with_* scripts, each checked exactly on every rank.
- ``envfile``: MASTER_ADDR and MASTER_PORT from a .env file, validated.

The lesson of each script (how its launcher starts processes, how DDP wraps the model,
how the training loop runs) stays in the script itself.
"""
