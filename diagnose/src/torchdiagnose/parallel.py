"""What tensor, pipeline and sharded data parallelism add to a rank's answer: the DTensor layer or FSDP module whose
collective waits, and the point-to-point send or recv that a pipeline stage waits for.

DTensor's collectives (ColwiseParallel, RowwiseParallel, any redistribute) go through the functional collectives to
the process group, so torch's flight recorder sees them, with the Python stack that issued them: origin() reads the
parallel style from that stack, and the module it was applied to from the modules the rank's main thread is in.
FSDP2's collectives are named by the module fully_shard was applied to: the FSDPParamGroup whose method (unshard,
post_backward) issued the collective and still waits in it, in the rank's live frames.

Point-to-point ops (dist.isend/irecv, and so send/recv, batch_isend_irecv's P2POp list, torch.distributed.pipelining)
are not in gloo's flight recorder, though they advance the group's count. isend and irecv are wrapped: each op is
noted (kind, peer, shape, when, a weak reference to its Work) in a ring of the last RING ops; blocked() finds the
op whose Work the main thread waits on (a local of its innermost frames). The note costs about half a microsecond
an op and holds no tensor. stages() reads the pipeline's stages from the schedule the main thread runs, so that a
peer is named by its stage.

Only the note runs while the job is healthy; the rest runs when a rank is asked, or when the watchdog has seen the
counts stand still with an op noted. What it reads there is private to torch and may change: the frames' locals,
nn.Module's _call_impl frames and _forward_hooks (the style's function in a hook's closure), a schedule's
_stage/_stages, a stage's stage_index_to_group_rank and _resolve_peer_global_rank, an FSDPParamGroup's _module_fqn
and modules. Where one is missing the line says less (no module, a peer by its rank), and the job is not touched.
"""
import collections
import functools
import time
import weakref

from torchdiagnose import lines

RING = 256  # the last point-to-point ops noted: a stage waits on one of its newest
FRAMES = 3  # how many of the main thread's innermost frames may hold the Work it waits on

# (weakref to Work, kind, peer (global rank), peer in its group, id of the group (None: default), Size, issued at)
_ops = collections.deque(maxlen=RING)
watching = [False]  # set once this rank watches (start.started), cleared as the group goes


SIGNATURES = {"isend": ("tensor", "dst", "group", "tag", "group_dst"),
              "irecv": ("tensor", "src", "group", "tag", "group_src")}  # torch 2.13's


def wrap(c10d):
    """Wrap c10d.isend and c10d.irecv (before torch.distributed copies the names: its own isend is then this one,
    as are P2POp's and batch_isend_irecv's). Only where their signature is torch 2.13's: the wrappers pass the
    arguments on as they are, and read them without a look-up."""
    import inspect
    for name, wrapper in (("isend", _isend), ("irecv", _irecv)):
        original = getattr(c10d, name)
        if tuple(inspect.signature(original).parameters) != SIGNATURES[name]:
            raise RuntimeError(f"{name} has another signature")
        setattr(c10d, name, functools.update_wrapper(wrapper(original), original))


# The note: the group's id, not the group (it must not outlive its end); the tensor's Size, not the tensor.
_ref, _now = weakref.ref, time.monotonic

def _isend(original):
    def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
        work = original(tensor, dst, group, tag, group_dst)
        if work is not None and watching[0]:
            _ops.append((_ref(work), "send", dst, group_dst, group if group is None else id(group), tensor.shape,
                         _now()))
        return work
    return isend


def _irecv(original):
    def irecv(tensor, src=None, group=None, tag=0, group_src=None):
        work = original(tensor, src, group, tag, group_src)
        if work is not None and watching[0]:
            _ops.append((_ref(work), "recv", src, group_src, group if group is None else id(group), tensor.shape,
                         _now()))
        return work
    return irecv


def stop():
    """The group goes: let go of every note."""
    watching[0] = False
    _ops.clear()


def _group(group_id):
    """The live group of that id (None: the default group), or None."""
    from torch.distributed import distributed_c10d as c10d
    if group_id is None:
        return c10d._world.default_pg
    return next((group for group in list(c10d._world.pg_names) if id(group) == group_id), None)


def _global_rank(peer, group_peer, group):
    if peer is not None or group_peer is None:
        return peer
    from torch.distributed import distributed_c10d as c10d
    try:
        return c10d.get_global_rank(group, group_peer)
    except Exception:  # noqa: BLE001  the group went meanwhile
        return None


def _works(frame):
    """The Work objects held by the locals of `frame`: first those held as they are (the one waited on, as in
    `for w in works: w.wait()`), then those in a list or tuple."""
    from torch.distributed import Work
    direct, listed = [], []
    for value in frame.f_locals.values():
        if isinstance(value, Work):
            direct.append(value)
        elif isinstance(value, (list, tuple)) and len(value) < 64:
            listed += [v for v in value if isinstance(v, Work)]
    return direct, listed


def blocked(frame, failed=False):
    """The noted point-to-point op the thread whose innermost frame is `frame` waits on: (seconds since it was
    issued, {"kind", "peer", "shapes", "group"}), or None. Among several pending ones a frame holds: one held as it is
    before one in a list, the oldest first. `failed`: `frame` is where an error was raised (its op completed, with
    the error)."""
    if frame is None or not _ops:
        return None
    noted = {}
    for ref, *rest in list(_ops):
        work = ref()
        if work is not None:
            noted[id(work)] = (work, rest)
    for _ in range(FRAMES):
        if frame is None:
            break
        for held in _works(frame):
            pending = [noted[id(w)][1] for w in held if id(w) in noted and noted[id(w)][0] is w
                       and (failed or not _completed(w))]
            if pending:
                kind, peer, group_peer, group_id, shape, issued = min(pending, key=lambda rest: rest[-1])
                group = _group(group_id)
                return time.monotonic() - issued, {"kind": kind, "peer": _global_rank(peer, group_peer, group),
                                                   "shapes": "[" + ", ".join(map(str, shape)) + "]",
                                                   "group": getattr(group, "group_name", None)}
        frame = frame.f_back
    return None


def _completed(work):
    try:
        return work.is_completed()
    except Exception:  # noqa: BLE001  a Work that cannot say: taken as pending
        return False


def pending():
    """Whether a noted op's Work still lives and has not completed (gloo completes one only once it is waited on)."""
    return any((work := ref()) is not None and not _completed(work) for ref, *_ in list(_ops))


def stages(frame):
    """The pipeline stages of the schedule the thread runs (torch.distributed.pipelining), from its frames: a list
    of {"index": stage, "ranks": {stage: global rank}}; [] outside a pipeline."""
    while frame is not None:
        if "/torch/distributed/pipelining/" in frame.f_code.co_filename.replace("\\", "/"):
            owner = frame.f_locals.get("self")
            found = getattr(owner, "_stages", None) or ([owner._stage] if hasattr(owner, "_stage") else None)
            if found:
                return [_stage(stage) for stage in found]
        frame = frame.f_back
    return []


def _stage(stage):
    ranks = {}
    for index in getattr(stage, "stage_index_to_group_rank", {}):
        try:
            ranks[index] = stage._resolve_peer_global_rank(index)
        except Exception:  # noqa: BLE001  a stage of another torch: named by rank alone
            pass
    return {"index": stage.stage_index, "ranks": ranks}


def describe_blocked(frame, failed=False):
    """(seconds waited, the p2p op as the line names it) for the op the thread of `frame` waits on, or None."""
    found = blocked(frame, failed)
    if found is None:
        return None
    waited, op = found
    return waited, lines.describe_p2p(op, stages(frame), waited)


# ---- DTensor ----

STYLE_FILE = "/torch/distributed/tensor/parallel/style.py"


def origin(entry, frame):
    """Where a flight recorder entry's collective came from, for the line: "DTensor in RowwiseParallel of
    blocks.0.fc2", "DTensor's gradients in backward()", "FSDP of layers.1" (lines.fsdp), or None (a collective the
    script called itself, or DDP's: lines.collective names those). `frame`: the innermost frame of the thread that
    waits (its modules, FSDP's parameter group)."""
    frames = [(str(f.get("filename", "")).replace("\\", "/"), f.get("name"), f.get("line"))
              for f in entry.get("frames") or []]
    backward = any(name in ("backward", "_engine_run_backward") and "/torch/" in file for file, name, _ in frames)
    if any("/torch/distributed/tensor/" in file for file, _, _ in frames):
        if backward:
            return "DTensor's gradients in backward()"
        style = next(((file, name, line) for file, name, line in frames if file.endswith(STYLE_FILE)), None)
        if style is None:
            return "DTensor"
        named, module = _styled_module(style, frame)
        return f"DTensor in {named or 'a parallel style'}" + (f" of {module}" if module else "")
    if any("/torch/distributed/fsdp/" in file for file, _, _ in frames):
        group = _fsdp_group(frames, frame, lines.issued_by(entry))
        fqn = getattr(group, "_module_fqn", None)
        root = _class_name(group.modules[0]) if fqn == "" and getattr(group, "modules", None) else None
        return lines.fsdp(fqn, root, gradients=any(name == "foreach_reduce" for _, name, _ in frames),
                          backward=backward)
    return None


def _class_name(module):
    """A module's class as the user wrote it: fully_shard gives it a class of its own, FSDP<name>."""
    cls = type(module)
    base = cls.__bases__[-1] if cls.__bases__ else cls
    return base.__name__ if cls.__name__ == "FSDP" + base.__name__ else cls.__name__


FSDP_FILE = "/torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py"
C10D_FILE = "/torch/distributed/distributed_c10d.py"


def _fsdp_group(frames, frame, issued_by):
    """The FSDPParamGroup whose collective an entry's stack `frames` issued, from the thread's live frames (its
    `self`): the live frame of the issuing stack's innermost method of FSDPParamGroup (unshard, post_backward), with
    the thread still inside the torch.distributed function that issued it (`issued_by`). On gloo FSDP2 waits in that
    call (unshard_async_op is off); where the thread has gone on (NCCL, an async unshard), the module is not named:
    a later call of the same method would name another module."""
    issuing = next((name for file, name, _ in frames if file.endswith(FSDP_FILE)), None)
    inside = False
    while frame is not None and issuing and issued_by:
        code = frame.f_code
        file = code.co_filename.replace("\\", "/")
        inside = inside or (code.co_name == issued_by and file.endswith(C10D_FILE))
        if inside and code.co_name == issuing and file.endswith(FSDP_FILE):
            owner = frame.f_locals.get("self")
            if isinstance(getattr(owner, "_module_fqn", None), str):
                return owner
        frame = frame.f_back
    return None


def _styled_module(style, frame):
    """(the parallel style's class, the module's name in the model) for a style.py frame of the issuing stack: among
    the modules the thread is in, innermost first, the one submodule whose hooks run that style function."""
    modules = []
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_call_impl" and code.co_filename.replace("\\", "/").endswith("/torch/nn/modules/module.py"):
            modules.append(frame.f_locals.get("self"))
        frame = frame.f_back
    modules = [m for m in modules if m is not None][::-1]  # outermost (the model) first
    for container in reversed(modules):
        found = [(named, sub) for sub in container.modules() if (named := _style_of(sub, style))]
        if len(found) == 1:
            named, sub = found[0]
            name = next((n for n, m in modules[0].named_modules() if m is sub), None)
            return named, name or None
        if found:
            return found[0][0], None
    return None, None


def _style_of(module, style):
    """The class name of the parallel style whose function `style` (file, name, line) runs in `module`'s hooks."""
    file, name, line = style
    hooks = list(getattr(module, "_forward_hooks", {}).values()) + list(getattr(module, "_forward_pre_hooks",
                                                                                {}).values())
    for hook in hooks:
        for cell in getattr(hook, "__closure__", None) or ():
            try:
                content = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            # A functools.partial of the style's method (ColwiseParallel's, RowwiseParallel's hooks), or the style
            # itself in a lambda's closure (PrepareModuleInput's hook calls self._prepare_input_fn).
            partial = getattr(getattr(content, "func", None), "__func__", getattr(content, "func", None))
            for function in (partial, getattr(type(content), name, None)):
                code = getattr(function, "__code__", None)
                if code is not None and code.co_name == name and code.co_filename.replace("\\", "/") == file \
                        and any(line == number for _, _, number in code.co_lines()):
                    return function.__qualname__.split(".")[0]
    return None
