"""The rendezvous address of a job, checked before it starts and again in each rank before init_process_group.

A host name that does not resolve is not an error to torch: torchrun's agent, and init_process_group with
MASTER_ADDR, retry it until their timeout (15 and 30 minutes by default), then fail with "lost contact" or a
store timeout. A port that another process holds on this host fails torchrun's agent with a traceback. Both are
known from the command and this host in milliseconds; this module says them in one line.
"""
import os
import socket

from torchdiagnose import lines

TORCHRUN_MODULES = ("torch.distributed.run", "torch.distributed.launch")


def _options(tokens):
    """The launcher's own options, {name: value} with dashes as underscores: the tokens before the script (the
    first that ends in .py), each `--name value` or `--name=value` (a flag followed by another option: True)."""
    found = {}
    for i, token in enumerate(tokens):
        if token.endswith(".py"):
            break
        if not token.startswith("--"):
            continue
        name, has_value, value = token[2:].partition("=")
        if not has_value:
            following = tokens[i + 1] if i + 1 < len(tokens) else ""
            value = following if following and not following.startswith("-") and not following.endswith(".py") \
                else True
        found[name.replace("-", "_")] = value
    return found


def _launcher(command):
    """("torchrun" or "accelerate", the tokens after it), or (None, command)."""
    names = [os.path.basename(token) for token in command]
    if names[:1] == ["torchrun"]:
        return "torchrun", command[1:]
    for module in TORCHRUN_MODULES:
        if module in command and "-m" in command[:command.index(module)]:
            return "torchrun", command[command.index(module) + 1:]
    if names[:2] == ["accelerate", "launch"]:
        return "accelerate", command[2:]
    return None, command


def elastic(command):
    """`--nnodes=MIN:MAX` with MIN < MAX under torchrun (or python -m torch.distributed.run / launch), else None."""
    launcher, rest = _launcher(command)
    nnodes = _options(rest).get("nnodes") if launcher == "torchrun" else None
    if isinstance(nnodes, str) and ":" in nnodes:
        low, _, high = nnodes.partition(":")
        if low != high:
            return nnodes
    return None


def from_command(command, env):
    """(host, port, where, hosts_here): the address the launch command's rendezvous uses, where it was given, and
    whether this node's launcher would listen there (so a port in use here is an error); None if it names none."""
    names = [os.path.basename(token) for token in command]
    launcher, rest = _launcher(command)
    if launcher == "torchrun":
        options = _options(rest)
        if options.get("standalone"):
            return None  # torchrun picks localhost and a free port itself
        endpoint = options.get("rdzv_endpoint")
        if isinstance(endpoint, str) and options.get("rdzv_backend", "static") != "static":
            host, _, port = endpoint.rpartition(":") if ":" in endpoint else (endpoint, "", "29400")
            # The first agent to come listens there; the others connect to it: a port in use is no error.
            return host.strip("[]"), port, "--rdzv_endpoint", False
        host = options.get("master_addr", "127.0.0.1")
        port = options.get("master_port", "29500")
        where = "--master_addr" if "master_addr" in options else "--master_port"
        return host, port, where, str(options.get("node_rank", "0")) == "0"
    if launcher == "accelerate":
        options = _options(rest)
        port = options.get("main_process_port", "29500")
        if str(options.get("num_machines", "1")) == "1":  # one machine: accelerate listens on 127.0.0.1
            return "127.0.0.1", port, "--main_process_port", True
        return (options.get("main_process_ip", "127.0.0.1"), port, "--main_process_ip",
                str(options.get("machine_rank", "0")) == "0")
    for i, token in enumerate(command[:-1]):  # mpirun -x MASTER_ADDR=HOST
        if token == "-x" and command[i + 1].startswith("MASTER_ADDR="):
            return command[i + 1].split("=", 1)[1], env.get("MASTER_PORT", "29500"), "mpirun -x MASTER_ADDR", False
    if env.get("MASTER_ADDR") and names[0] not in ("srun", "sbatch"):
        # the ranks read it here: mp.spawn scripts, mpirun that passes the environment (srun's ranks run on other
        # hosts, which may resolve names this one does not: each rank checks it there)
        return env["MASTER_ADDR"], env.get("MASTER_PORT", "29500"), "MASTER_ADDR", False
    return None


def _local(host):
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    own = {"127.0.0.1", "::1"}
    try:
        own |= {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        pass
    return any(a in own or a.startswith("127.") for a in addresses)


def problem(host, port, where, hosts_here):
    """One line for an address that cannot work, or None."""
    try:
        number = int(port)
    except ValueError:
        number = -1
    if not 0 <= number <= 65535:
        return f"diagnose: the rendezvous port {port!r} is not a port number (0 to 65535)"
    try:
        socket.getaddrinfo(host, number)
    except socket.gaierror as error:
        return (f"diagnose: the rendezvous host {host!r} ({where}) does not resolve on this host ({error.strerror}): "
                "give a name or address of the first node that every node can resolve")
    if hosts_here and number and _local(host):
        try:  # something answers where this node's launcher must listen: a port another process holds
            socket.create_connection(("127.0.0.1", number), timeout=1).close()
        except OSError:
            return None
        if where.startswith("--main"):
            return lines.port_in_use(number, "pass another --main_process_port")
        return lines.port_in_use(number, "pass another --master_port, or --rdzv_endpoint=HOST:0 under torchrun "
                                         "--standalone")
    return None


def check_command(command, env):
    found = from_command(command, env)
    return problem(*found) if found else None


def rank_endpoint(init_method, env):
    """'HOST:PORT' that a rank's init_process_group meets at: a tcp:// init_method's, else MASTER_ADDR:MASTER_PORT
    ('?' for one unset)."""
    if init_method and init_method.startswith("tcp://"):
        return init_method[len("tcp://"):].split("?")[0]
    return f"{env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}"


def check_rank(init_method, env):
    """In a rank, before init_process_group: the host it is about to connect to (tcp:// or MASTER_ADDR)."""
    tcp = bool(init_method and init_method.startswith("tcp://"))
    if not tcp and not (init_method in (None, "env://") and env.get("MASTER_ADDR")):
        return None
    host, _, port = rank_endpoint(init_method, env).rpartition(":")
    return problem(host.strip("[]"), "0" if port == "?" else port, "init_method" if tcp else "MASTER_ADDR", False)
