"""The words of diagnose: what a rank's frames and torch's flight recorder say, and the one line for the job.

Pure functions of what the ranks reported (dicts that json carries through the store), so that each case is
tested without a job; torch is imported only to write a flight recorder dump.
"""
import importlib.util
import os
import pickle
import re
import signal
import site
import sys
import sysconfig
import time

from torchdiagnose import names

DUMP_ROOT = "fr_traces"
BUSY = 0.5  # the share of samples in which a rank's main thread was running, above which it is busy, not idle
_HERE = os.path.dirname(os.path.abspath(__file__))


def _not_user_folders():
    """Folders whose frames are not the user's: the standard library, installed packages (also those of a
    --system-site-packages venv's base, `pip install --user`, a .pth file), wherever torch is, this tool."""
    paths = sysconfig.get_paths()
    folders = [paths["stdlib"], paths["purelib"], paths["platlib"], _HERE, *site.getsitepackages()]
    folders += [site.getusersitepackages()] if site.ENABLE_USER_SITE else []
    folders += [p for p in sys.path if os.path.basename(p.rstrip(os.sep)) in ("site-packages", "dist-packages")]
    torch = importlib.util.find_spec("torch")
    if torch and torch.origin:
        folders.append(os.path.dirname(os.path.dirname(torch.origin)))
    return tuple({os.path.abspath(p) + os.sep for p in folders if p})


_NOT_USER = _not_user_folders()


def one_line(error, limit=300):
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= limit else text[:limit] + "..."


def short_error(text):
    """A gloo or NCCL message without its source paths and boilerplate."""
    text = re.sub(r"\[[^\]]*\.(cc|cpp|h|hpp):\d+\] ", "", " ".join(text.split()))
    text = re.sub(r"Exception raised from .*$", "", text).strip()
    return one_line(text.split(". This is typically caused")[0], 160)


def lost_peer(error):
    """The exception, `error` or one it was raised from, of a collective that failed because a peer left or did
    not arrive (a pipeline stage raises its own RuntimeError from it); None for another error."""
    import torch.distributed as dist
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = str(error)
        if isinstance(error, getattr(dist, "DistError", ())) or any(marker in text for marker in (
                "gloo/transport", "Connection closed by peer", "Connection reset by peer", "Broken pipe",
                "NCCL communicator was aborted", "ncclRemoteError", "Timed out waiting",
                "failed to pass monitoredBarrier", "Detected mismatch between collectives")):
            return error
        error = error.__cause__ or error.__context__
    return None


_FINGERPRINT = re.compile(r"Rank (\d+) is running collective: CollectiveFingerPrint\((.*?)\)\)")
_OP_NAMES = {"ALLREDUCE": "all_reduce", "ALLGATHER": "all_gather", "_ALLGATHER_BASE": "all_gather_into_tensor",
             "BROADCAST": "broadcast", "REDUCE": "reduce", "REDUCE_SCATTER": "reduce_scatter",
             "_REDUCE_SCATTER_BASE": "reduce_scatter_tensor", "BARRIER": "barrier", "GATHER": "gather",
             "SCATTER": "scatter", "ALLTOALL": "all_to_all", "ALLTOALL_BASE": "all_to_all_single"}


def mismatch(text):
    """TORCH_DISTRIBUTED_DEBUG=DETAIL's 'Detected mismatch between collectives': {rank: 'kind of shape (dtype)'}
    and the aspects they differ in; None for another error."""
    text = " ".join(text.split())
    if "Detected mismatch between collectives" not in text:
        return None
    sides = {}
    for rank, fields in _FINGERPRINT.findall(text):
        found = dict(re.findall(r"(SequenceNumber|OpType|TensorShape|TensorDtypes)=([^,]*(?:\[[^\]]*\])?)", fields))
        op = found.get("OpType", "?")
        sides[rank] = {"seq": found.get("SequenceNumber"), "what": f"{_OP_NAMES.get(op, op.lower())} of "
                       f"{found.get('TensorShape', '?')} ({found.get('TensorDtypes', '?')})"}
    differ = re.search(r"differ in the following aspects: (.*)$", text)
    aspects = differ[1].replace("vs", " vs").replace("Tensor Tensor", "tensor").strip() if differ else None
    return {"sides": sides, "aspects": aspects}


def _is_user(filename):
    if filename.startswith("<"):
        return False
    return not os.path.abspath(filename).startswith(_NOT_USER)


def main_script():
    """The path of the script the process runs (mp.spawn's processes and torchrun's workers included), or None."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None) or (sys.argv[0] if sys.argv and sys.argv[0] else None)
    return os.path.abspath(path) if path and path.endswith(".py") else None


def shown(filename):
    """A frame's file as the line shows it: the user's relative to here (or its name), a library's from its
    package's folder (torch/nn/functional.py)."""
    path = os.path.abspath(filename)
    for folder in sorted(_NOT_USER, key=len, reverse=True):
        if path.startswith(folder):
            return path[len(folder):]
    relative = os.path.relpath(path)
    return os.path.basename(path) if relative.startswith("..") else relative


def user_site(frames, script=None):
    """(where, inner) from traceback frames, outermost first. where: 'file:line' of the call in the user's script
    (the innermost frame of the script the process runs; else of any code of the user's); inner: where the frames
    end below it (the innermost frame of the user's own, then the innermost of all: 'model.py:40 in forward, then
    torch/nn/functional.py:2910 in layer_norm'), None when they end there."""
    frames = [f for f in frames if not f.filename.startswith("<")]
    script = script or main_script()
    user = [f for f in frames if _is_user(f.filename)]
    in_script = [f for f in user if script and os.path.abspath(f.filename) == script]
    site = (in_script or user or [None])[-1]
    where = f"{shown(site.filename)}:{site.lineno}" if site else None
    below = []
    for frame in (user[-1] if user else None, frames[-1] if frames else None):
        if frame is not None and frame is not site and frame not in below:
            below.append(frame)
    inner = ", then ".join(f"{shown(f.filename)}:{f.lineno} in {f.name}" for f in below) or None
    return where, inner


def model_site(frames, script=None):
    """'model.py:40 in forward': the innermost frame of the user's own code outside the script the process runs
    (the model's file, where a DTensor or FSDP collective comes from), or None where there is none."""
    script = script or main_script()
    user = [f for f in frames if not f.filename.startswith("<") and _is_user(f.filename)
            and os.path.abspath(f.filename) != script]
    return f"{shown(user[-1].filename)}:{user[-1].lineno} in {user[-1].name}" if user else None


def phase_site(frames, script=None):
    """'evaluate(), called at train.py:90': the function of the script the rank is in, and the script's line that
    called it (the call that names a long phase), or None at the script's top level."""
    script = script or main_script()
    ours = [f for f in frames if script and not f.filename.startswith("<") and os.path.abspath(f.filename) == script]
    if len(ours) < 2 or ours[-1].name == "<module>":
        return None
    return f"{ours[-1].name}(), called at {shown(ours[-2].filename)}:{ours[-2].lineno}"


def in_backward(frames):
    return any(f.name in ("backward", "_engine_run_backward") and "torch" in f.filename for f in frames)


def describe_entry(entry, waited=None):
    """A flight recorder entry as the line needs it."""
    sizes = entry.get("input_sizes") or []
    shapes = ", ".join("[" + ", ".join(map(str, size)) + "]" for size in sizes[:3])
    shapes += ", ..." if len(sizes) > 3 else ""
    group = entry.get("process_group") or ("", "")
    kind = str(entry.get("profiling_name", "")).split(":")[-1] or None
    if kind == "all_reduce" and (issued_by(entry) or "").startswith("reduce_scatter"):
        # gloo runs a reduce-scatter as an all-reduce of the whole input (then keeps its slice), and records that
        kind = "reduce_scatter"
    return {"seq": entry.get("collective_seq_id"), "kind": kind, "shapes": shapes or None,
            "group": str(group[1] or group[0]), "group_name": str(group[0]), "waited": waited}


def issued_by(entry):
    """The torch.distributed function that issued a flight recorder entry (the innermost of its stack's frames in
    distributed_c10d.py), or None: no stack (the recorder read without), or a functional collective's (DTensor's)."""
    for frame in entry.get("frames") or []:  # innermost first
        if str(frame.get("filename", "")).replace("\\", "/").endswith("/torch/distributed/distributed_c10d.py"):
            return frame.get("name")
    return None


def group_text(entry):
    """'tp group [2, 3]' for a collective of a DeviceMesh's group (its dimension, its global ranks), 'group [0, 2]'
    for another group of some ranks, None for the default group (every rank) or where the ranks are unknown."""
    ranks, desc = entry.get("ranks"), str(entry.get("group") or "")
    if not ranks or desc == "default_pg":
        return None
    dimension = desc[len("mesh_"):] + " " if desc.startswith("mesh_") else ""
    return f"{dimension}group [{', '.join(map(str, ranks))}]"


def describe_p2p(op, stages=(), waited=None):
    """A point-to-point op (parallel.blocked's) as the line needs it; `stages`: this rank's pipeline stages
    (parallel.stages), which name the peer by its stage and say what goes between them."""
    peer = op.get("peer")
    peer_text = "any rank" if peer is None else f"rank {peer}"
    purpose = None
    for stage in stages:
        mine = stage["index"]
        near = [index for index, rank in stage.get("ranks", {}).items() if rank == peer and abs(index - mine) == 1]
        if near:
            other = near[0]
            peer_text = f"stage {other} (rank {peer})"
            forward = (other < mine) == (op["kind"] == "recv")  # activations flow up the stages, gradients down
            if op["kind"] == "recv":
                purpose = f"the activations for stage {mine}'s forward" if forward else \
                    f"the gradients for stage {mine}'s backward"
            else:
                purpose = f"stage {mine}'s activations" if forward else f"stage {mine}'s gradients"
            break
    return {"seq": None, "kind": op["kind"], "p2p": True, "peer": ("from " if op["kind"] == "recv" else "to ")
            + peer_text, "peer_rank": peer, "purpose": purpose, "shapes": op.get("shapes"),
            "group": str(op.get("group") or "0"), "group_name": op.get("group"), "waited": waited}


def dump_folder(when):
    return os.path.join(DUMP_ROOT, time.strftime("%Y%m%d-%H%M%S", time.localtime(when)))


def for_torchfrtrace(dump):
    """A flight recorder dump as torchfrtrace reads it. torch 2.13's gloo records its groups' configuration under
    an empty name, and torchfrtrace then fails (KeyError): each group of this process is named as its entries name
    it; entries of groups the process does not know (DETAIL's helper group) are left out."""
    from torch.distributed import distributed_c10d as c10d
    world = c10d._world
    config = {}
    for group, name in world.pg_names.items():
        ranks = world.pg_group_ranks.get(group)
        if ranks is not None:
            desc = "default_pg" if group is world.default_pg else getattr(group, "group_desc", "") or "undefined"
            config[str(name)] = {"name": str(name), "desc": desc, "ranks": str(sorted(ranks))}
    for entry in dump["entries"]:
        name, desc = (list(entry.get("process_group", ())) + ["", ""])[:2]
        if str(name) in config:
            config[str(name)]["desc"] = desc or config[str(name)]["desc"]
    return {**dump, "pg_config": config,
            "entries": [e for e in dump["entries"] if str(e.get("process_group", ("",))[0]) in config]}


def write_dump(rank, folder):
    """This rank's flight recorder dump, with stacks, where torchfrtrace reads it; whether it was written."""
    import torch
    try:
        dump = pickle.loads(torch._C._distributed_c10d._dump_fr_trace(True, True, False))
    except Exception:  # noqa: BLE001  the recorder is off: no dump, and the job goes on
        return False
    if not dump.get("entries"):
        return False
    prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or os.path.join(folder, "rank_")
    path = f"{prefix}{rank}"
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path + ".tmp", "wb") as f:
            pickle.dump(for_torchfrtrace(dump), f)
        os.replace(path + ".tmp", path)
    except (OSError, pickle.PicklingError):
        return False
    return True


def fsdp(fqn, root=None, gradients=False, backward=False):
    """An FSDP2 collective, by the module fully_shard was applied to: 'FSDP of layers.1', "FSDP's gradients of
    layers.1 in backward()" (a reduce-scatter). `fqn`: the module's name in the model (FSDPParamGroup's: "" for the
    root, then named by its class `root`; "a, b" for fully_shard([a, b])), None where unknown."""
    text = "FSDP's gradients" if gradients else "FSDP"
    if fqn:
        text += " of " + " and ".join(fqn.split(", "))
    elif fqn == "":
        text += f" of the root module ({root})" if root else " of the root module"
    return text + (" in backward()" if backward else "")


def ranks_text(ranks):
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def collective(entry, view=None, number=True):
    """'#37 (all_reduce of [5569], DDP's gradients in backward() at train.py:70)'; a point-to-point op:
    'p2p recv of [64, 16] from stage 0 (rank 0), the activations for stage 1's forward, at train.py:80'."""
    if entry and entry.get("p2p"):
        text = f"p2p {entry['kind']}" + (f" of {entry['shapes']}" if entry.get("shapes") else "") + f" {entry['peer']}"
        text += f", {entry['purpose']}" if entry.get("purpose") else ""
        if view and view.get("where"):
            text += ("," if entry.get("purpose") else "") + f" at {view['where']}"
        return text
    parts = []
    if entry and entry.get("kind"):
        parts.append(entry["kind"] + (f" of {entry['shapes']}" if entry.get("shapes") else ""))
    if entry and entry.get("origin"):  # DTensor's, FSDP's (parallel.origin, fsdp)
        parts.append(entry["origin"])
    elif view and view.get("backward"):
        parts.append("DDP's gradients in backward()")
    described = ", ".join(parts)
    if view and view.get("where"):
        described += (" " if described else "") + f"at {view['where']}"
        if entry and entry.get("origin") and view.get("model"):  # DTensor's, FSDP's: the model's line too
            described += f" via {view['model']}"
    if not number or not entry or entry.get("seq") is None:
        return described or "a collective"
    return f"#{entry['seq']}" + (f" ({described})" if described else "")


def _ended(code):
    if code is None:
        return None
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def process_state(known):
    """What a process is, from node.describe() and who it is: 'stopped by SIGSTOP (pid 7, on vm)', or None."""
    pid = f"pid {known['pid']}" if known.get("pid") else None
    where = ", ".join(filter(None, [pid, f"on {known['host']}" if known.get("host") else None]))
    ended = _ended(known.get("exit"))
    if ended:
        return f"{ended} ({where})"
    if known.get("state") == "T":
        if known.get("stop_signal"):
            return f"stopped by {known['stop_signal']} ({where}): it runs nothing until it gets SIGCONT"
        return f"stopped ({where}; SIGSTOP, or Ctrl-Z's SIGTSTP): it runs nothing until it gets SIGCONT"
    if known.get("state") == "t":
        debugger = f" (pid {known['tracer']})" if known.get("tracer") else ""
        return f"stopped in a debugger{debugger} ({where})"
    if known.get("state") in (None, "Z", "X") and known.get("pid") and known.get("local"):
        return f"its process ended ({where}; the launcher's report says how)"
    return None


def _silent(rank, known):
    """What is known of a rank that did not answer."""
    pid = f"pid {known['pid']}" if known.get("pid") else None
    where = ", ".join(filter(None, [pid, f"on {known['host']}" if known.get("host") else None]))
    if known.get("exit") == -signal.SIGABRT:
        return (f"rank {rank} is gone: {_ended(known['exit'])} ({where}); gloo aborts a process whose peer's "
                "collective does not match its own (another shape or kind): TORCH_DISTRIBUTED_DEBUG=DETAIL names both "
                "sides")
    state = process_state(known)
    if state and state.startswith("stopped"):
        return f"rank {rank} is {state}"
    if state:
        return f"rank {rank} is gone: {state}"
    if known.get("state"):
        return (f"rank {rank} is alive ({where}) but does not answer: its Python does not run (native code that "
                f"holds Python's lock: a C extension, a CUDA call); `py-spy dump --native --pid {known['pid']}` shows "
                "where (pip install py-spy)")
    return f"rank {rank} did not answer ({where or 'never registered'}): gone, or out of reach"


def _elsewhere(rank, view, awaited=None):
    """A rank in its own code; `awaited`: the p2p op a peer waits for from it ('send': the peer's recv waits)."""
    did = {"send": "did not send it", "recv": "did not receive it"}.get(awaited, "did not arrive")
    text = f"rank {rank} {did}: it is alive, in its own code at {view.get('where') or '?'}"
    if view.get("inner"):
        text += f" (innermost: {view['inner']})"
    busy = view.get("busy")
    if busy is not None and busy >= BUSY:
        text += (", busy on the CPU" + (f" in {view['phase']}" if view.get("phase") else "") + ": a long phase on "
                 "one rank (evaluation, a checkpoint) waits like a hang; if it is meant, give --timeout more than it "
                 "takes")
    elif busy is not None:
        text += ", idle: it waits for something of its own (a lock, a queue, a file, a sleep)"
    return text


def _flight_recorder(answers, silent, world_size, folder, p2p=False):
    """The hint at torchfrtrace when every rank writes its dump; else which ranks write none, and why."""
    dumped = sorted(r for r, v in answers.items() if v.get("recorder"))
    if len(dumped) == world_size:
        return f"flight recorder: `torchfrtrace {folder}`"
    if not dumped and p2p:
        return ("no flight recorder dumps: the ranks ran no collective (gloo's recorder holds no send or recv), or the "
                "recorder is off (TORCH_FR_BUFFER_SIZE=0)")
    if not dumped:
        return "no flight recorder dumps: the recorder is off (TORCH_FR_BUFFER_SIZE=0) or recorded nothing"
    missing = sorted(set(range(world_size)) - set(dumped))
    why = "did not answer" if set(missing) <= set(silent) else "did not answer or recorded nothing"
    return (f"no torchfrtrace: {ranks_text(missing)} {why}, so wrote no flight recorder dump, and torchfrtrace "
            f"compares every rank's; {ranks_text(dumped)} wrote {'its' if len(dumped) == 1 else 'theirs'} to {folder}: "
            f"`torchfrtrace --allow-incomplete-ranks {folder}` reads {'it' if len(dumped) == 1 else 'them'}")


def compose(question, answers, who, world_size):
    """The one line, from the question (why it was asked), the answers of the ranks that answered, and what is
    known of those that did not (`who`: pid, host, and for this host's: exit code, state)."""
    detail = next((v["mismatch"] for v in answers.values() if v.get("mismatch")), None)
    if detail and len(detail["sides"]) >= 2:
        sides = "; ".join(f"rank {r} {side['what']}" + (f" at {answers[int(r)]['where']}"
                                                          if answers.get(int(r), {}).get("where") else "")
                          for r, side in sorted(detail["sides"].items(), key=lambda item: int(item[0])))
        seq = next(iter(detail["sides"].values()))["seq"]
        return (f"diagnose: the ranks called different collectives at #{seq}: {sides}"
                + (f" (they differ in {detail['aspects']})" if detail.get("aspects") else "")
                + "; TORCH_DISTRIBUTED_DEBUG=DETAIL stopped them before any waited")
    waiting = {r: v["running"][0] for r, v in answers.items() if v.get("running")}
    elsewhere = sorted(r for r, v in answers.items() if not v.get("running") and not v.get("error"))
    failed = {r: v for r, v in answers.items() if v.get("error")}
    silent = sorted(set(range(world_size)) - set(answers))
    stuck = set(elsewhere) | set(silent)  # in no collective: the ranks the others can be waiting for
    parts = []
    # The collectives, each group's apart (ranks of different groups wait in different collectives by design),
    # and the ranks each one waits for: its group's members not in it.
    signatures, missing = {}, {}
    for rank, entry in sorted(waiting.items()):
        signature = (entry.get("group_name"), entry["seq"], entry["kind"], entry.get("peer"), entry["shapes"],
                     answers[rank].get("where"))
        signatures.setdefault(signature, []).append(rank)
    for signature, ranks in signatures.items():
        entry = waiting[ranks[0]]
        peer = [entry["peer_rank"]] if entry.get("peer_rank") is not None else []  # a p2p op's one peer
        missing[signature] = peer or [m for m in entry.get("ranks") or [] if m not in ranks]
    asker = answers.get(question["by"], {})
    main, head_entry, head_view = None, None, asker

    def failed_in(view):  # the collective a rank's error came from: the one still running, else its newest
        return (view.get("running") or [None])[0] or view.get("last") or {}

    def broken_by_the_gone(rank):  # a failed rank whose collective's group holds a rank that is gone
        return bool(stuck & (set(failed_in(failed[rank]).get("ranks") or []) - {rank}))
    if question["reason"] != "timeout" and failed:
        # The collective that failed: the asker's, unless another rank's failed in a group with a rank that is gone
        # (a rank can fail on a peer that failed on the one that died first).
        by = question["by"] if question["by"] in failed else None
        chosen = by if by is not None and broken_by_the_gone(by) else None
        chosen = chosen if chosen is not None else next((r for r in sorted(failed) if broken_by_the_gone(r)), by)
        if chosen is not None:
            asker = answers[chosen]
            head_entry, head_view = failed_in(asker), asker
    if head_entry is None and signatures:
        # The head: a collective that waits for a rank in no collective (the fault) before one whose missing ranks
        # wait elsewhere; then the one most ranks are in.
        main = max(signatures, key=lambda s: (bool(stuck & set(missing[s])), len(signatures[s])))
        first = signatures[main][0]
        head_entry, head_view = waiting[first], answers[first]
    elif head_entry is None:
        head_entry = asker.get("last") or {}
    what = ("" if head_entry.get("p2p") else "collective ") + collective(head_entry, head_view)
    what += f" in {group_text(head_entry)}" if group_text(head_entry) else ""
    if question["reason"] == "timeout":
        head = f"{what} waited more than --timeout {question['timeout']:g}s"
    else:
        head = f"{what} failed ({asker.get('error')})"
    by_group = {}
    for signature in signatures:
        by_group.setdefault(signature[0], []).append(signature)
    for group in by_group.values():
        if len(group) < 2:
            continue
        seqs = {s[1] for s in group}
        sides = "; ".join(f"{ranks_text(signatures[s])} in "
                          f"{collective(waiting[signatures[s][0]], answers[signatures[s][0]], len(seqs) > 1)}"
                          for s in sorted(group, key=lambda s: signatures[s]))
        sizes = sorted(len(signatures[s]) for s in group)
        odd = ""
        if len(sizes) == 2 and sizes[0] < sizes[1]:
            odd = f"; {ranks_text(signatures[min(group, key=lambda s: len(signatures[s]))])} is the odd one out"
        label = group_text(waiting[signatures[group[0]][0]])
        parts.append(f"the ranks{' of ' + label if label else ''} wait in different collectives: {sides}{odd} (a rank "
                     "skipped a collective, or called another or another shape in its place)")
    # A rank that p2p ops wait on (a pipeline's peer stage): it did not send, or did not receive.
    awaited = {}
    for entry in waiting.values():
        if entry.get("p2p") and entry.get("peer_rank") is not None:
            awaited.setdefault(entry["peer_rank"], "send" if entry["kind"] == "recv" else "recv")
    for rank in elsewhere:
        parts.append(_elsewhere(rank, answers[rank], awaited.get(rank)))
    for rank in silent:
        parts.append(_silent(rank, who.get(rank, {})))
    if len(by_group) > 1:  # several groups (a DeviceMesh's): who waits where, and for whom
        if not stuck and not any(len(group) > 1 for group in by_group.values()):
            parts.append("every rank waits in a collective of its groups for ranks that wait in another: the ranks "
                         "call their groups' collectives in different orders")
        waits = []
        for signature, ranks in sorted(signatures.items(), key=lambda item: item[1]):
            entry, on = waiting[ranks[0]], missing[signature]
            which = "the collective above" if signature == main else collective(entry, answers[ranks[0]])
            where = group_text(entry) or ("a pipeline's group" if entry.get("p2p") else "the default group")
            text = f"{ranks_text(ranks)} in {which} of {where}"
            if on:
                text += f", for {ranks_text(on)}" + (", which waits in turn" if not stuck & set(on) else "")
            waits.append(text)
        parts.append("waiting: " + "; ".join(waits))
    if not parts:
        if failed and len(failed) == len(answers) and not silent:
            parts.append("every rank failed there: the link between them broke")
        else:
            parts.append("every rank is in it and it did not complete: the link between the ranks failed or is too "
                         "slow, or a collective of another group holds it")
    dumps = os.path.dirname(os.environ.get("TORCH_FR_DUMP_TEMP_FILE", "")) or question["folder"]
    return f"diagnose: {head}: " + "; ".join(parts) + "; " + _flight_recorder(answers, silent, world_size, dumps,
                                                                              head_entry.get("p2p"))


def store_lost(me, reason):
    what = collective((me.get("running") or [{}])[0], me)
    return (f"diagnose: collective {what} {'failed' if reason == 'failed' else 'waits'} and the group's store "
            "does not answer either: its host (rank 0, or the launcher of its node) is gone or out of reach, so "
            "the other ranks could not be asked")


def port_in_use(port, advice="pass another --master_port / MASTER_PORT, or --rdzv_endpoint=HOST:0 under torchrun "
                             "--standalone"):
    return (f"diagnose: port {port} is already in use on this host (another job, or an earlier run still holding "
            f"it): {advice}")


def port_advice(port, init_method, env, script=None):
    """What to change for a port in use, where the port came from: the script's init_method, a MASTER_PORT the
    script sets itself (its line), torchrun's options, or the environment."""
    if init_method and str(init_method).startswith("tcp://"):
        return "the script's init_method names it: change the port there"
    launched = env.get(names.LAUNCH_MASTER_PORT)
    if "TORCHELASTIC_RUN_ID" in env:
        return "pass torchrun another --master_port, or --rdzv_endpoint=HOST:0 under torchrun --standalone"
    if launched is not None and env.get("MASTER_PORT") != (launched or None):
        line = setting_line(script or main_script(), "MASTER_PORT")
        where = f" at {line}" if line else ""
        return (f"the script sets MASTER_PORT={port} itself{where}: change it there, or take it from the environment "
                "when set (os.environ.setdefault) and run with another MASTER_PORT")
    return "run with another MASTER_PORT (the environment's)"


def setting_line(script, name):
    """'script.py:N', the first line of `script` that sets the environment variable `name`, or None."""
    try:
        with open(script) as f:
            source = f.read().splitlines()
    except (OSError, TypeError):
        return None
    for number, text in enumerate(source, 1):
        code = text.split("#")[0]
        if name in code and re.search(rf"""['"]{name}['"]\s*\]\s*=|setdefault\(\s*['"]{name}|putenv\(\s*['"]{name}""",
                                      code):
            return f"{shown(script)}:{number}"
    return None


def startup_cause(error, port_hint=None):
    """One line for the start-up failures people ask about most, or None. port_hint(port): the advice for a port
    in use."""
    text = " ".join(str(error).split())
    port = re.search(r"port: (\d+)", text)
    if "EADDRINUSE" in text or "address already in use" in text.lower():
        number = port[1] if port else "(MASTER_PORT)"
        return port_in_use(number, port_hint(number)) if port_hint else port_in_use(number)
    loopback = re.search(r"remote=\[(127\.\d+\.\d+\.\d+)\]", text)
    if loopback and ("connectFullMesh" in text or "failed to connect" in text):
        return (f"diagnose: another node advertised {loopback[1]}, a loopback address, so this one cannot reach it: "
                "its host name resolves to loopback (the `127.0.1.1 HOSTNAME` line of /etc/hosts); on every node "
                "set GLOO_SOCKET_IFNAME to the interface that joins the nodes (a name, e.g. eth0, or a "
                "comma-separated list) and for NCCL NCCL_SOCKET_IFNAME (a prefix: eth; ^lo excludes, =eth0 is "
                "exact), or make the host name resolve to that interface's address")
    if "NCCL" in text and ("no GPUs found" in text or "doesn't have NCCL" in text or "not available" in text):
        return ("diagnose: NCCL needs CUDA GPUs, and this process sees none: use backend='gloo' on the CPU, or "
                "dist.get_default_backend_for_device(torch.accelerator.current_accelerator(check_available=True))")
    return None


def init_incomplete(waited, address, size, missing):
    """init_process_group waited: its store answers, the group is not complete. `missing`: {rank: what is known of
    its process on this host (node.describe() and pid), or None}; None when not known."""
    head = (f"diagnose: init_process_group has waited {waited:g}s: the store at {address} answers, but the group "
            f"of {size if size else '?'} ranks is not complete")
    if not missing:
        return (head + ": a rank has not started (check world_size and each rank's rank), or the ranks cannot reach "
                "the addresses they advertise to each other")
    parts = []
    for rank, known in sorted(missing.items()):
        if not known:
            parts.append(f"rank {rank} has not called init_process_group, and no process of this host was started "
                         "as it (another node's? check world_size and each rank's rank)")
            continue
        state = process_state(known)
        if state and state.startswith("stopped"):
            parts.append(f"rank {rank} has not called init_process_group: it is {state}")
        elif state:
            parts.append(f"rank {rank} is gone before init_process_group: {state}")
        else:
            parts.append(f"rank {rank} has not called init_process_group: it is alive (pid {known['pid']}), in its own "
                         "code before it")
    return head + ": " + "; ".join(parts)


def init_unanswered(waited, address, host=None):
    """`host`: what is known of this host's process started as rank 0, which opens the store at the address."""
    state = process_state(host) if host else None
    if state:
        return (f"diagnose: init_process_group has waited {waited:g}s: nothing answers at {address}, where rank 0 "
                f"opens the group's store: rank 0 has not called init_process_group: it is {state}"
                if state.startswith("stopped") else
                f"diagnose: init_process_group has waited {waited:g}s: nothing answers at {address}, where rank 0 "
                f"opens the group's store: rank 0 is gone before init_process_group: {state}")
    return (f"diagnose: init_process_group has waited {waited:g}s: nothing answers at {address} (the rendezvous "
            "address: MASTER_ADDR and MASTER_PORT, or init_method): start rank 0 (or the first node) there, or give "
            "the address of the machine it runs on; a firewall can drop the connection")


def missing_api(name, torch_version, tested):
    return (f"diagnose: torch {torch_version} has no {name}, a private API this tool reads (tested with torch "
            f"{', '.join(tested)}): not watching this job, which runs as without the tool")
