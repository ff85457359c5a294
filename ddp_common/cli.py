"""The command line: the flags the scripts share (one spelling each), their types, and the entry point that
turns an error into one line.

    parser = cli.training_parser(__doc__, distributed=True)   # --snapshot_path defaults to <script>.pt
    cli.run(main, parser)            # main(args)

    @cli.rank_main                   # each process mp.spawn starts: errors become one line here too
    def main(rank, world_size, args): ...
"""
import argparse
import functools
import os
import sys
import time
import traceback
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp

from ddp_common import hangs, launchers, snapshot
from ddp_common.devices import BACKENDS
from ddp_common.errors import CheckFailed, PeerLostError, UsageError, one_line


class FlagError(UsageError):
    """A flag the parser refused: printed as argparse prints it, `script.py: error: ...`."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag is a FlagError: one line, printed by cli.run once per node, not a usage block
    from every process."""

    def error(self, message):
        raise FlagError(f"{self.prog}: error: {message} (see --help)")


class TrainingParser(ArgumentParser):
    """The flags of a training script. The upstream tutorial's positional form `TOTAL_EPOCHS SAVE_EVERY` is the
    same as --total_epochs and --save_every; --epochs is another name for --total_epochs."""

    def parse_args(self, args=None, namespace=None):
        parsed = super().parse_args(args, namespace)
        for name in ("total_epochs", "save_every"):
            if not hasattr(parsed, name):
                continue
            positional, flag = getattr(parsed, name + "_arg", None), getattr(parsed, name)
            if positional is not None and flag is not None and positional != flag:
                self.error(f"{name} given twice, as {positional} and as --{name} {flag}")
            setattr(parsed, name, flag or positional or self.get_default("default_" + name))
        return parsed


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


def seconds(text):
    """A positive number of seconds, as the timedelta torch.distributed takes."""
    return timedelta(seconds=positive_float(text))


def script_snapshot():
    """The default snapshot of the script being run: its own name with .pt (multinode.py: multinode.pt), so that
    two scripts never resume from each other's snapshot unless asked to."""
    return os.path.splitext(os.path.basename(sys.argv[0]))[0] + ".pt"


def training_parser(description, snapshots=True, snapshot_path=None, total_epochs=50, save_every=10,
                    batch_size=32, positional=True, distributed=False, world_size=False):
    """The parser of a training script: --total_epochs (--epochs), --batch_size, --seed, and with `snapshots`
    --save_every and --snapshot_path (default `snapshot_path`, else <script>.pt); `positional` also takes the
    upstream tutorial's `TOTAL_EPOCHS SAVE_EVERY`; `distributed` adds --backend and --timeout, `world_size`
    --world_size (the processes a script starts itself). `description` is shown as written: the script's
    docstring, with its launch commands, serves."""
    parser = TrainingParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    if snapshots:
        snapshot_path = snapshot_path or script_snapshot()
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
    if world_size:
        add_world_size_arg(parser)
    if distributed:
        add_distributed_args(parser)
    return parser


def add_world_size_arg(parser):
    parser.add_argument("--world_size", type=positive_int, help="processes to start (default: one per GPU, or 2 "
                                                                "without GPUs)")


def add_distributed_args(parser):
    """--backend and --timeout, the flags of every script that starts a process group."""
    parser.add_argument("--backend", choices=BACKENDS, default=None,
                        help="process-group backend (default: the device's, nccl on CUDA GPUs and gloo on the CPU)")
    add_timeout_arg(parser)


def add_timeout_arg(parser, default=300):
    parser.add_argument("--timeout", type=seconds, default=timedelta(seconds=default),
                        help=f"seconds to wait for the other ranks before giving up (default {default:g}; "
                             "the library default is 30 minutes)")


def add_linear_args(parser, input_size=100):
    """The flags of the linear classifier (torchrun_ddp.py, ddp.py, by_feature/) besides the training parser's."""
    parser.add_argument("--input_size", type=positive_int, default=input_size,
                        help=f"features per sample (default {input_size})")
    parser.add_argument("--lr", type=positive_float, default=0.05, help="SGD learning rate, momentum 0.9 (default 0.05)")


# How long a process other than its node's first waits after a usage error before it speaks (see run).
# Measured here: torchrun stops the other workers some 0.1-0.5 s after the first one exits; mp.spawn sooner.
SPEAKER_WAIT_S = 5.0


def run(main, parser=None):
    """The entry point of every script: main(args), args parsed by `parser` (main() without one); returns what
    main returns. What it does besides:

    - Under a launcher, it ties this process's life to the launcher's (launchers.die_with_launcher).
    - Under TORCH_DISTRIBUTED_DEBUG=DETAIL only, it has DDP skip its construction logging, which crashes torch
      2.13 with gloo there (hangs.work_around_detail_crash).
    - A lost peer or a timed-out collective becomes one line that names the collective and the rank that did not
      arrive, asked of the other ranks (ddp_common/hangs.py, docs/hangs.md).
    - An error the user can act on becomes one line on stderr and an exit code: 2 for usage (a flag, a file, the
      launcher, a snapshot that does not fit the model), 1 for lost peers or a failed check, 130 when
      interrupted. Anything else is a bug and keeps its traceback.
    - A usage error is the same for every process of a node (same flags, files, launcher), so the node's first
      process speaks for all: the others wait SPEAKER_WAIT_S for the launcher to stop them (it does, once the
      first has exited) and speak only if it does not come (the error was theirs alone). Without the wait, every
      process of a node prints the same line.
    - After an error the process ends at once (os._exit), without Python's shutdown: a rank that lost its peers
      may still have collectives in flight, and tearing the process group down then can hang or abort the
      process (docs/failures.md: clean exits). Snapshots are written atomically, so nothing finished is lost."""
    launchers.die_with_launcher()
    hangs.work_around_detail_crash()
    try:
        return main(parser.parse_args()) if parser is not None else main()
    except UsageError as error:
        if launchers.local_rank() != 0:
            time.sleep(SPEAKER_WAIT_S)
        exit_now(2, error if isinstance(error, FlagError) else f"error: {error}")
    except (PeerLostError, CheckFailed) as error:
        exit_now(1, f"error: {error}")
    except KeyError as error:
        if error.args and error.args[0] in launchers.TORCHRUN_VARIABLES:  # os.environ["RANK"] without torchrun
            exit_now(2, f"error: {launchers.torchrun_hint(sys.argv[0])}")
        bug()
    except mp.ProcessExitedException as error:  # mp.spawn: one of our processes failed
        if error.exit_code is not None and error.exit_code > 0:
            exit_now(error.exit_code)  # it printed its own reason
        # Killed by a signal, it could not say why: say which one it was.
        exit_now(1, f"error: process {error.error_index} (pid {error.error_pid}) was killed by "
                    f"{error.signal_name or 'a signal'}; mp.spawn stopped the others. Start again to resume from "
                    "the last snapshot")
    except (dist.DistError, RuntimeError, ValueError) as error:
        if misfit(error):
            exit_now(2, f"error: a snapshot does not fit this model or optimizer ({one_line(error)}); it belongs to "
                        "another model or other flags: move it away or pass another --snapshot_path")
        if hangs.is_mismatch(error):  # TORCH_DISTRIBUTED_DEBUG=DETAIL: another collective or shape, both sides
            exit_now(1, f"error: {hangs.mismatch_line(error)}")
        if isinstance(error, dist.DistError) or is_transport_error(error) or hangs.recognizes(error):
            # Which rank, which collective, where to look: asked of the other ranks (docs/hangs.md).
            exit_now(1, f"error: {hangs.explain(error)}; {launchers.after_lost_peers()}")
        bug()
    except KeyboardInterrupt:
        exit_now(130, "error: interrupted")
    except Exception:
        bug()


def rank_main(main):
    """Decorate the function each process of mp.spawn runs, main(rank, ...): run's one-line errors in that
    process, which then exits with the code (mp.spawn passes it on to the parent's run, which says nothing
    more). mp.spawn pickles the function by name, and the decorated one is what the module holds under it."""
    @functools.wraps(main)
    def process(index, *args):
        launchers.spawned_as(index)
        return run(functools.partial(main, index, *args))
    return process


def misfit(error):
    """Whether `error` is torch refusing a state dict of another model (load_state_dict) or optimizer."""
    text = str(error)
    return ((isinstance(error, RuntimeError) and text.startswith("Error(s) in loading state_dict"))
            or (isinstance(error, ValueError) and "loaded state dict" in text))


def is_transport_error(error):
    """gloo reports a dead or unreachable peer as a plain RuntimeError from its TCP transport."""
    text = str(error)
    return "gloo/transport" in text or "Gloo connectFullMesh failed" in text


def bug():
    traceback.print_exc()
    exit_now(1)


def exit_now(code, line=None):
    snapshot.unlock_all()  # os._exit skips atexit, which would remove the lock files
    sys.stdout.flush()
    sys.stderr.flush()
    if line is not None:
        # One write: ranks share the launcher's stderr, and print() can write text and newline apart.
        os.write(2, f"{line}\n".encode(errors="backslashreplace"))
    os._exit(code)
