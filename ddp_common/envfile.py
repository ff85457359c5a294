"""MASTER_ADDR and MASTER_PORT from a .env file (python-dotenv), checked before any process starts."""
import argparse
import os

from dotenv import dotenv_values, load_dotenv

from ddp_common.cli import port_number
from ddp_common.errors import UsageError
from ddp_common.distributed import check_can_listen, free_port

DEFAULT_ADDRESS = "127.0.0.1"


def master_from_env_file(path, must_exist):
    """Load `path` into os.environ and return (address, port, where each came from).

    Variables already set in the environment win over the file (dotenv's override=False). A missing or
    empty value falls back to 127.0.0.1 and a free port; a missing file is an error only if `must_exist`.
    Both values end up in os.environ, where init_process_group's env:// and spawned children read them.
    """
    path = os.path.abspath(path)  # dotenv's own search starts beside the script, not in the current directory
    exists = os.path.isfile(path)
    if not exists and must_exist:
        raise UsageError(f"env file {path} not found; copy .env.example there or leave out --env_file")
    preset = {name for name in ("MASTER_ADDR", "MASTER_PORT") if os.environ.get(name)}
    if exists:
        try:
            file_values = dotenv_values(path)
            load_dotenv(path, override=False)
        except (OSError, UnicodeDecodeError) as error:
            raise UsageError(f"cannot read env file {path} ({error})") from None
    else:
        file_values = {}

    def source(name):
        if name in preset:
            return "from the environment"
        if file_values.get(name):
            return f"from {path}"
        return None

    missing = f"not set in {path}" if exists else f"no env file at {path}"
    address = os.environ.get("MASTER_ADDR") or DEFAULT_ADDRESS
    address_source = source("MASTER_ADDR") or f"default, {missing}"
    port_text, port_source = os.environ.get("MASTER_PORT"), source("MASTER_PORT")
    if port_source:
        try:
            port = port_number(port_text.strip())
        except argparse.ArgumentTypeError as error:
            raise UsageError(f"MASTER_PORT={port_text!r} {port_source}: {error}") from None
    else:
        check_can_listen(address, 0)  # an address of another machine gets a one-line error, not a traceback
        port, port_source = free_port(address), f"a free port, {missing}"
    os.environ.update(MASTER_ADDR=address, MASTER_PORT=str(port))
    return address, port, {"MASTER_ADDR": address_source, "MASTER_PORT": port_source}
