"""Submit an example to SLURM with submitit (pip install submitit): one task per process, each calling the
example's own main() with torchrun's variables made from SLURM's.

    python launch/submitit_job.py --nodes 2 --tasks_per_node 2 multinode.py 50 10 --snapshot_path $HOME/mn.pt

It waits for the job; each task's output is in submitit_logs/<job id>_<task>_log.out (and .err). Submit again
to resume from the snapshot. The repository, this Python and the snapshot path must be the same on every node.
"""
import argparse
import importlib
import os
import subprocess
import sys
import time

import submitit


def train(script, argv):
    """In every task: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT, then the example."""
    env = submitit.helpers.TorchDistributedEnvironment()
    # submitit names the first node as SLURM does, a name that need not resolve on the nodes: ask SLURM its address.
    env.master_addr = subprocess.run(["sinfo", "--noheader", "--Node", f"--nodes={env.master_addr}", "--format=%o"],
                                     capture_output=True, text=True, check=True).stdout.split()[0]
    if "MASTER_PORT" not in os.environ:
        # submitit draws it from 20000-60000 (seeded by the job id), where Linux also hands out ports to outgoing
        # connections and to srun's own listeners: a draw that lands on one fails EADDRINUSE. Below that range,
        # and the same in every task:
        env.master_port = 15000 + int(os.environ["SLURM_JOB_ID"]) % 10000
    # overwrite: a MASTER_PORT that sbatch passed on from the submitting shell is used, not refused.
    # CUDA_VISIBLE_DEVICES left alone: the examples pick their GPU by LOCAL_RANK.
    env.export(set_cuda_visible_devices=False, overwrite=True)
    sys.path.insert(0, os.path.dirname(script))
    example = importlib.import_module(os.path.basename(script).removesuffix(".py"))
    try:
        if hasattr(example, "parse_args"):  # the torchrun examples: main(args)
            example.main(example.parse_args(argv))
        else:  # train.py parses its own
            example.main(argv)
    except SystemExit as stop:  # submitit records exceptions only: job.results() then says why
        if stop.code:  # sys.exit("error: ...") gives its line; argparse's exit 2 printed it to the task's .err
            raise RuntimeError(stop.code if isinstance(stop.code, str) else f"{script} exited {stop.code}") from None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--tasks_per_node", type=int, default=1, help="processes per node: one per GPU")
    parser.add_argument("--gpus_per_node", type=int, default=0)
    parser.add_argument("--cpus_per_task", type=int, default=1)
    parser.add_argument("--minutes", type=int, default=60, help="the job's time limit")
    parser.add_argument("--folder", default="submitit_logs", help="where submitit keeps the job's files and logs")
    parser.add_argument("script", help="the example, e.g. multinode.py")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the example's arguments")
    args = parser.parse_args()
    if not os.path.isfile(args.script):
        parser.error(f"no such script: {args.script}")
    if min(args.nodes, args.tasks_per_node, args.cpus_per_task, args.minutes) <= 0 or args.gpus_per_node < 0:
        parser.error("--nodes, --tasks_per_node, --cpus_per_task and --minutes must be positive")
    executor = submitit.SlurmExecutor(folder=args.folder)
    # --kill-on-bad-exit: a task that fails ends the others (as torchrun does), not their --timeout later.
    executor.update_parameters(nodes=args.nodes, ntasks_per_node=args.tasks_per_node, cpus_per_task=args.cpus_per_task,
                               time=args.minutes, srun_args=["--kill-on-bad-exit=1"],
                               **({"gpus_per_node": args.gpus_per_node} if args.gpus_per_node else {}))
    job = executor.submit(train, os.path.abspath(args.script), args.args)
    print(f"Submitted job {job.job_id}: logs in {os.path.abspath(args.folder)}", flush=True)
    # submitit learns that a job ended from sacct alone, and waits for ever for a killed task's result where SLURM
    # keeps no accounting: squeue tells too.
    while not job.done():
        queue = subprocess.run(["squeue", "--noheader", f"--jobs={job.job_id}"], capture_output=True, text=True)
        if (queue.returncode == 0 and not queue.stdout.strip()) or "Invalid job id" in queue.stderr:
            break
        time.sleep(2)
    tasks = [job.task(i) for i in range(job.num_tasks)]
    missing = [i for i, task in enumerate(tasks) if not task.paths.result_pickle.exists()]
    failed = next((error for i, task in enumerate(tasks) if i not in missing and (error := task.exception())), None)
    if failed:  # a FailedJobError holds the task's traceback between two rules: its last line says why
        parts = str(failed).split("-" * 22 + "\n")
        reason = parts[1].strip().splitlines()[-1] if len(parts) > 2 else str(failed).splitlines()[0]
        sys.exit(f"error: job {job.job_id} failed: {reason}; logs in {os.path.abspath(args.folder)}")
    if missing:
        sys.exit(f"error: job {job.job_id}: task {missing[0]} ended without a result (killed? the time limit?); "
                 f"logs in {os.path.abspath(args.folder)}")


if __name__ == "__main__":
    main()
