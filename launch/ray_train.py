"""Ray Train: an example's own main(args) in each of --num_workers Ray workers, in the process group Ray starts.

    python launch/ray_train.py multinode.py --num_workers 2 -- --total_epochs 4 --snapshot_path /abs/multinode.pt

Joins the Ray cluster of RAY_ADDRESS (or `ray start`'s), else starts one on this machine. The workers run in Ray's
session folder, not here: give the example absolute paths (the snapshot too), on a filesystem every node shares.
On one machine, `--local` keeps Ray on 127.0.0.1 (so does a RAY_ADDRESS of 127.0.0.1): Ray takes the host's
network address otherwise.
"""
import argparse
import importlib.util
import os
import sys


def before_any_group():
    # The examples import it before they start a process group: DDP imports it lazily, and imported while a group
    # exists, it holds that group for good (docs/failures.md). Ray starts the group before the example runs.
    import torch.distributed.nn  # noqa: F401


def train_loop_per_worker(config):
    # Ray Train (2.60, its default V2 API) sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT.
    print(f"Ray Train worker: rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} | master "
          f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", flush=True)
    sys.path.insert(0, os.path.dirname(config["script"]))  # what the example imports beside it (models_and_data.py)
    spec = importlib.util.spec_from_file_location("example", config["script"])
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    if hasattr(example, "parse_args"):  # the torchrun examples: main(args)
        example.main(example.parse_args(config["argv"]))
    else:  # train.py parses its own
        example.main(config["argv"])


def main(argv):
    cut = argv.index("--") if "--" in argv else len(argv)  # the example's own arguments follow "--"
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("script", help="the example, say multinode.py: a main(args) and a parse_args(argv)")
    parser.add_argument("--num_workers", type=int, default=2, help="processes in the group (default 2)")
    parser.add_argument("--use_gpu", action="store_true", help="a GPU for each worker (NCCL); default: CPUs, gloo")
    parser.add_argument("--local", action="store_true", help="start a Ray of this machine alone, on 127.0.0.1 only")
    args = parser.parse_args(argv[:cut])
    script = os.path.abspath(args.script)
    if not os.path.isfile(script) or not script.endswith(".py"):
        parser.error(f"{args.script} is not a Python file")
    if args.num_workers < 1:
        parser.error(f"--num_workers must be at least 1, got {args.num_workers}")
    # Read when ray is imported; without it Ray swaps a node address of 127.0.0.1 for the host's own, and a driver
    # that joins a Ray on 127.0.0.1 (RAY_ADDRESS) waits for ever for a node of its own address.
    if args.local or os.environ.get("RAY_ADDRESS", "").startswith(("127.", "localhost:")):
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray
    from ray.train import ScalingConfig, TrainingFailedError
    from ray.train.torch import TorchTrainer

    # Ray Train 2.60 prints a worker's every print twice (to its log, and to stdout): once is enough.
    runtime_env = {"env_vars": {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}, "worker_process_setup_hook": before_any_group}
    if args.local:
        ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, runtime_env=runtime_env)
    else:
        ray.init(runtime_env=runtime_env)
    print(f"Ray nodes: {', '.join(node['NodeManagerAddress'] for node in ray.nodes())}", flush=True)
    resource = "GPU" if args.use_gpu else "CPU"
    have = ray.cluster_resources().get(resource, 0)
    if args.local and have < args.num_workers:  # Ray would wait for more forever
        ray.shutdown()
        sys.exit(f"error: --num_workers {args.num_workers}, but this machine has {have:g} {resource}s")
    trainer = TorchTrainer(train_loop_per_worker, train_loop_config={"script": script, "argv": argv[cut + 1:]},
                           scaling_config=ScalingConfig(num_workers=args.num_workers, use_gpu=args.use_gpu))
    try:
        trainer.fit()
    except TrainingFailedError as error:  # each worker's traceback is above; the first rank's error in one line here
        rank, failure = min(getattr(error, "worker_failures", {}).items(), default=("?", error))
        lines = str(failure).strip().splitlines() or [type(failure).__name__]
        sys.exit(f"error: {args.script} failed on rank {rank} under Ray Train: {lines[-1].removeprefix('error: ')}")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
