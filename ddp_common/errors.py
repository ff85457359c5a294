"""The errors a user can act on. Library code raises them; only a script's entry point (cli.run) turns
one into a single line on stderr and an exit code."""


class UsageError(Exception):
    """A problem the user can fix: a flag, a file, the launcher. Exit code 2."""


class PeerLostError(Exception):
    """Another rank or node went away, or never came. Exit code 1."""


class CheckFailed(Exception):
    """A result failed its check: a collective's value, the ranks' weights. Exit code 1."""


def one_line(error, limit=300):
    """An exception's message folded onto one line and cut to a readable length, to quote in an error."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= limit else text[:limit] + "..."
