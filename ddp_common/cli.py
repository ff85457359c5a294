"""Command-line plumbing: flag types, the tutorial's common flags, and the entry point that turns an error
into one line."""
import argparse
import os
import sys
import time
import traceback
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp

from ddp_common.elastic import after_lost_peers
from ddp_common.errors import CheckFailed, PeerLostError, UsageError, one_line


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag costs one line of output instead of a usage block."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def positive_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def port_number(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number (1-65535), got {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be between 1 and 65535, got {value}")
    return value


def add_training_args(parser, total_epochs=50, save_every=10, batch_size=32, positional=True, snapshots=True,
                      snapshot_path="snapshot.pt"):
    """The flags every training script shares, one spelling each. `positional` also accepts the upstream
    tutorial's form `TOTAL_EPOCHS SAVE_EVERY`; --epochs is another name for --total_epochs."""
    if positional:
        parser.add_argument("total_epochs_arg", nargs="?", type=positive_int, metavar="total_epochs",
                            help="same as --total_epochs (the upstream tutorial's positional form)")
        if snapshots:
            parser.add_argument("save_every_arg", nargs="?", type=positive_int, metavar="save_every",
                                help="same as --save_every")
    parser.add_argument("--total_epochs", "--epochs", type=positive_int,
                        help=f"epochs to train in all (default {total_epochs})")
    parser.add_argument("--batch_size", type=positive_int, default=batch_size,
                        help=f"samples per step and rank (default {batch_size})")
    parser.add_argument("--seed", type=int, default=0, help="seed for the data, the model and the shuffling")
    if snapshots:
        parser.add_argument("--save_every", type=positive_int,
                            help=f"write a snapshot every N epochs; the last epoch is always saved (default {save_every})")
        parser.add_argument("--snapshot_path", default=snapshot_path,
                            help=f"snapshot to resume from and to write to; a missing one means a fresh start "
                                 f"(default {snapshot_path})")
    parser.set_defaults(default_total_epochs=total_epochs, default_save_every=save_every)


def training_args(parser, argv=None):
    """Parse, folding the positional form of add_training_args into the flags and filling the defaults."""
    args = parser.parse_args(argv)
    for name in ("total_epochs", "save_every"):
        if not hasattr(args, name):
            continue
        positional, flag = getattr(args, name + "_arg", None), getattr(args, name)
        if positional is not None and flag is not None and positional != flag:
            parser.error(f"{name} given twice, as {positional} and as --{name} {flag}")
        setattr(args, name, flag or positional or getattr(args, "default_" + name))
    return args


def add_distributed_args(parser):
    """--backend and --timeout, the flags of every script that starts a process group."""
    from ddp_common.distributed import add_backend_arg  # the distributed module imports this one
    add_backend_arg(parser)
    add_timeout_arg(parser)


def seconds(text):
    """A positive number of seconds, as the timedelta torch.distributed takes."""
    return timedelta(seconds=positive_float(text))


def add_timeout_arg(parser, default=300):
    parser.add_argument("--timeout", type=seconds, default=timedelta(seconds=default),
                        help=f"seconds to wait for the other ranks before giving up (default {default:g}; "
                             "the library default is 30 minutes)")


def add_linear_args(parser, input_size=100):
    """The flags of the linear classifier (torchrun_ddp.py, ddp.py) besides add_training_args'."""
    parser.add_argument("--input_size", type=positive_int, default=input_size,
                        help=f"features per sample (default {input_size})")
    parser.add_argument("--lr", type=positive_float, default=0.05, help="SGD learning rate, momentum 0.9 (default 0.05)")


def add_comm_hook_args(parser, several=False):
    """--comm_hook (with several=True, a list of hooks to compare) and PowerSGD's settings."""
    from ddp_common.comm_hooks import HOOKS
    parser.add_argument("--comm_hook", choices=HOOKS, nargs="+" if several else None,
                        default=["none"] if several else "none",
                        help="what DDP sends per step: none (fp32 gradients), fp16 or bf16 (gradients cast to "
                             "16 bits), powersgd (low-rank factors of each gradient matrix); default none")
    parser.add_argument("--powersgd_rank", type=positive_int, default=1,
                        help="powersgd: rank of the factors; higher sends more and keeps more (default 1)")
    parser.add_argument("--powersgd_warmup", type=positive_int, default=10,
                        help="powersgd: plain all-reduce steps before compressing, at least 2 (default 10)")


SPEAKER_WAIT_S = 5.0


def run(main, *args, **kwargs):
    """The entry point of every script: call main(*args, **kwargs) and return what it returns. An error the user can
    act on becomes one line on stderr and an exit code (2: usage, 1: lost peers or a failed check, 130:
    interrupted); anything else is a bug and keeps its traceback.

    After an error the process ends at once (os._exit), without Python's shutdown: a rank that lost its
    peers may still have collectives in flight, and tearing the process group down then can hang or abort
    the process (README: clean exits). Snapshots are written atomically, so nothing finished is lost."""
    try:
        return main(*args, **kwargs)
    except UsageError as error:
        # Flags, files and launchers are the same for every process of a node, so each would print the same
        # line: the node's first process speaks for all of them. The others wait for it to exit, which makes
        # the launcher stop them, and speak only if that does not come (the error was theirs alone).
        if local_rank() != 0:
            time.sleep(SPEAKER_WAIT_S)
        exit_now(2, error)
    except (PeerLostError, CheckFailed) as error:
        exit_now(1, error)
    except mp.ProcessExitedException as error:  # mp.spawn: one of our processes failed
        if error.exit_code is not None and error.exit_code > 0:
            exit_now(error.exit_code)  # it printed its own reason
        # Killed by a signal, it could not say why: say which one it was.
        exit_now(1, f"process {error.error_index} (pid {error.error_pid}) was killed by "
                    f"{error.signal_name or 'a signal'}; mp.spawn stopped the others. Start again to resume from "
                    "the last snapshot")
    except (dist.DistError, RuntimeError) as error:
        if not isinstance(error, dist.DistError) and not is_transport_error(error):
            traceback.print_exc()
            exit_now(1)
        exit_now(1, f"lost contact with the other ranks ({one_line(error)}); {after_lost_peers()}")
    except KeyboardInterrupt:
        exit_now(130, "interrupted")
    except Exception:
        traceback.print_exc()
        exit_now(1)


def is_transport_error(error):
    """gloo reports a dead or unreachable peer as a plain RuntimeError from its TCP transport."""
    text = str(error)
    return "gloo/transport" in text or "Gloo connectFullMesh failed" in text


def run_rank(rank, main, *args):
    """`run` for mp.spawn, which passes the process index first: mp.spawn(cli.run_rank, args=(main, ...))."""
    global _spawn_index
    _spawn_index = rank
    return run(main, rank, *args)


_spawn_index = None


def local_rank():
    """This process's number on its node: the mp.spawn index, LOCAL_RANK under torchrun, the MPI
    implementation's variable under mpirun; 0 for a process that runs alone."""
    from ddp_common.mpi import LOCAL_RANK_VARIABLES
    if _spawn_index is not None:
        return _spawn_index
    for name in ("LOCAL_RANK", *LOCAL_RANK_VARIABLES):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def exit_now(code, message=None):
    sys.stdout.flush()
    sys.stderr.flush()
    if message is not None:
        # One write: ranks share the launcher's stderr, and print() can write text and newline apart.
        os.write(2, f"error: {message}\n".encode(errors="backslashreplace"))
    os._exit(code)
