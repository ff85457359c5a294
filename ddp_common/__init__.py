"""What the example scripts share but none of them is about.

- ``cli``: argument types, one-line errors instead of tracebacks, the flags every training script has.
- ``distributed``: backend and device choice, free ports, launcher detection, the summary line.
- ``snapshot``: atomic snapshots with model, optimizer, epoch counter and RNG states.
- ``models``: the tutorial MLP, the linear classifier and SimpleCNN.
- ``data``: deterministic synthetic datasets and an MNIST IDX reader.

The lesson of each script (how its launcher starts processes, how DDP wraps the model,
how the training loop runs) stays in the script itself.
"""
