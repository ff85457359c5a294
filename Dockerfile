# The examples with CUDA, torch, mpi4py and Open MPI: one image for docker, SLURM (via enroot/apptainer)
# and the Kubernetes jobs in k8s/.
#
#     docker build -t ddp-examples:latest .
#     docker run --rm --gpus all --shm-size=2g ddp-examples:latest              # quick start, 2 GPUs
#     docker run --rm -e NPROC_PER_NODE=1 --gpus all ddp-examples:latest        # a single GPU
#     docker run --rm ddp-examples:latest                                        # no GPU: 2 CPU processes, gloo
#     docker run --rm ddp-examples:latest mpirun -np 2 python run_with_mpirun.py --train
#     docker run --rm ddp-examples:latest torchdiagnose --timeout 10 torchrun --standalone --nproc_per_node=2 \
#         hangs.py --fault stall                                                 # docs/hangs.md: who hangs, where
#
# The image's torch is the base's CUDA build (2.13.0+cuXYZ, with its CUDA libraries), GPUs or not.
# With GPUs (--gpus all, a driver that supports the base's CUDA): NCCL, one process per GPU, on
# NPROC_PER_NODE of them. Without GPUs (no --gpus, or a machine that has none) the same image trains on
# the CPU with gloo, NPROC_PER_NODE processes: the scripts ask
# torch.accelerator.current_accelerator(check_available=True), which finds no GPU there, whereas
# current_accelerator() alone names cuda in a CUDA build even without one. tests/test_container.py runs
# the default command this way, without GPUs, with the CUDA build when pytest runs in a venv that has it.
#
# Assumption: the official image of the pinned torch (requirements.txt: torch==2.13.0) follows the
# pytorch/pytorch tag scheme <torch>-cuda<X.Y>-cudnn<N>-runtime; pick the CUDA variant your driver
# supports from https://hub.docker.com/r/pytorch/pytorch/tags and pass it as --build-arg BASE_IMAGE=...
# Its torch (2.13.0+cuXYZ) satisfies the pin torch==2.13.0, so pip keeps it instead of downloading torch again.
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

# Open MPI refuses to start as root unless told twice; containers run as root.
ENV OMPI_ALLOW_RUN_AS_ROOT=1 \
    OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NPROC_PER_NODE=2

WORKDIR /workspace/ddp-examples

# Requirements first: code edits then reuse the cached dependency layer.
COPY requirements.txt .
RUN pip install -r requirements.txt \
    && python -c "import torch, mpi4py; assert torch.__version__.split('+')[0] == '2.13.0', torch.__version__"

COPY . .
# torchdiagnose (diagnose/, docs/hangs.md), installed as users install it; pip builds it with hatchling.
RUN pip install ./diagnose && torchdiagnose --version

# The quick start: torchrun, NPROC_PER_NODE processes (NCCL with GPUs, gloo without), 20 epochs.
CMD ["sh", "-c", "exec torchrun --standalone --nproc_per_node=\"$NPROC_PER_NODE\" multigpu_torchrun.py --total_epochs 20 --save_every 5"]
