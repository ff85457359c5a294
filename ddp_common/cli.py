"""Command-line plumbing: flag types, the tutorial's common flags, and one-line errors."""
import argparse
import sys

import torch.distributed as dist


class UsageError(Exception):
    """A problem the user can fix (a flag, a file, the launcher). Printed as one line, exit code 2."""


class PeerLostError(Exception):
    """Another rank (or node) went away. Printed as one line, exit code 1."""


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


def add_training_args(parser, positional=False):
    """The flags of the tutorial scripts. `positional` also accepts the upstream form `50 10`."""
    if positional:
        parser.add_argument("total_epochs_arg", nargs="?", type=positive_int, metavar="total_epochs",
                            help="same as --total_epochs (the upstream tutorial's positional form)")
        parser.add_argument("save_every_arg", nargs="?", type=positive_int, metavar="save_every",
                            help="same as --save_every")
    parser.add_argument("--total_epochs", type=positive_int, help="epochs to train in all (default 50)")
    parser.add_argument("--save_every", type=positive_int,
                        help="write a snapshot every N epochs; the last epoch is always saved (default 10)")
    parser.add_argument("--batch_size", type=positive_int, default=32, help="samples per step and rank")
    parser.add_argument("--snapshot_path", default="snapshot.pt",
                        help="snapshot to resume from and to write to (a missing file means a fresh start)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the data, the model and the shuffling")


def training_args(parser, argv=None):
    """Parse, folding the positional form of `add_training_args(positional=True)` into the flags."""
    args = parser.parse_args(argv)
    for name, default in (("total_epochs", 50), ("save_every", 10)):
        positional = getattr(args, name + "_arg", None)
        flag = getattr(args, name)
        if positional is not None and flag is not None and positional != flag:
            parser.error(f"{name} given twice, as {positional} and as --{name} {flag}")
        setattr(args, name, flag or positional or default)
    return args


def add_timeout_arg(parser, default=300):
    parser.add_argument("--timeout", type=positive_float, default=default,
                        help=f"seconds to wait for the other ranks before giving up (default {default}; "
                             "the library default is 30 minutes)")


def run(main, *args):
    """Call main(*args); turn the errors a user can act on into one line on stderr and an exit code."""
    try:
        return main(*args)
    except UsageError as error:
        fail(error, code=2)
    except PeerLostError as error:
        fail(error, code=1)
    except (dist.DistError, RuntimeError) as error:
        if not isinstance(error, dist.DistError) and not is_transport_error(error):
            raise
        fail(f"lost contact with the other ranks ({one_line(error)}); "
             "check that every rank is alive and reachable, then start again (snapshots resume the run)", code=1)
    except KeyboardInterrupt:
        fail("interrupted", code=130)


def is_transport_error(error):
    """gloo reports a dead or unreachable peer as a plain RuntimeError from its TCP transport."""
    text = str(error)
    return "gloo/transport" in text or "Gloo connectFullMesh failed" in text


def run_rank(rank, main, *args):
    """`run` for mp.spawn, which passes the process index first: mp.spawn(cli.run_rank, args=(main, ...))."""
    return run(main, rank, *args)


def exit_for_spawned_failure(error):
    """Turn mp.spawn's ProcessExitedException into an exit code. A process that exited with a code has
    printed its own reason; one killed by a signal could not, so say which one it was."""
    if error.exit_code is not None and error.exit_code > 0:
        sys.exit(error.exit_code)
    fail(f"process {error.error_index} (pid {error.error_pid}) was killed by {error.signal_name or 'a signal'}; "
         "mp.spawn stopped the others. Start again to resume from the last snapshot", code=1)


def fail(message, code):
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def one_line(error, limit=300):
    """An exception's message folded onto one line and cut to a readable length."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= limit else text[:limit] + "..."
