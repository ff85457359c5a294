"""The patches, each made as its module is imported (AfterImport): torch.distributed's init_process_group and
destroy_process_group (and isend/irecv, parallel.wrap), and mp.spawn's function in each process. Each wrapper
does what it wraps, hands the rest to start.py, watchdog.py or ask.py, and takes its own frame out of the
tracebacks that pass through it."""
import importlib.abc
import importlib.util
import os
import sys
import threading

from torchdiagnose import address as rendezvous, api, ask, lines, names, node, parallel, start, watchdog
from torchdiagnose.state import STATE, declare, exit_now, hide_frame, say, timeout_s

PATCHES = {}  # module name: the function that patches it once imported


class AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        patch = PATCHES.pop(name)
        sys.meta_path.remove(self)  # find the real module, not ourselves
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            try:
                execute(module)
            except BaseException as error:
                hide_frame(error)
                raise
            try:
                patch(module)
            except Exception as error:  # noqa: BLE001  a torch unlike the one tested: the job must run without us
                say(f"diagnose: not watching this process: patching {name} failed ({lines.one_line(error)})")

        spec.loader.exec_module = exec_module
        return spec


def patch_c10d(c10d):
    try:
        parallel.wrap(c10d)
    except Exception as error:  # noqa: BLE001  a torch unlike the one tested: collectives are still watched
        say(f"diagnose: not watching point-to-point ops ({lines.one_line(error)})")
    init = c10d.init_process_group

    def init_process_group(*args, **kwargs):
        if not STATE.checked:
            STATE.checked = True
            api.check()
        if STATE.off:
            try:
                return init(*args, **kwargs)
            except BaseException as error:
                hide_frame(error)
                raise
        call = start.Call(args, kwargs)
        if call.store is None:  # a name that does not resolve: torch would retry it until the timeout
            line = rendezvous.check_rank(call.init_method, os.environ)
            if line:
                if node.claim("address"):
                    declare(line)
                exit_now()
        check_in = start.CheckIn(call)
        timer = threading.Timer(timeout_s(), start.init_waits_too_long, (call, check_in))
        timer.daemon = True
        timer.start()
        try:
            result = init(*args, **kwargs)
        except BaseException as error:
            timer.cancel()
            check_in.stop()
            start.startup_failed(error, call)
            hide_frame(error)
            raise
        timer.cancel()
        check_in.stop()
        try:
            start.started(c10d)
        except Exception as error:  # noqa: BLE001  the tool must never break the job it watches
            say(f"diagnose: not watching this rank ({lines.one_line(error)})")
        return result

    init_process_group.__wrapped__ = init
    init_process_group.__doc__ = init.__doc__
    c10d.init_process_group = init_process_group
    destroy = c10d.destroy_process_group

    def destroy_process_group(group=None):
        # The watchdog must hold no reference to a group as it goes: a group freed late (at exit, or when a
        # thread lets go) can hang or abort the process. Stop it first; it looks at groups only under the lock.
        if group is None:
            watchdog.leave()
        try:
            return destroy(group)
        except BaseException as error:
            hide_frame(error)
            raise

    destroy_process_group.__wrapped__ = destroy
    destroy_process_group.__doc__ = destroy.__doc__
    c10d.destroy_process_group = destroy_process_group


def patch_spawn(spawn):
    wrap = getattr(spawn, "_wrap", None)
    if wrap is None:  # another torch: said at init_process_group (api.missing_api)
        return

    def _wrap(fn, i, args, *rest):
        node.write(names.STARTED, os.getpid(), str(i), once=True)
        return wrap(_Guarded(fn), i, args, *rest)

    # mp.spawn pickles its target by name: the name must lead to this function in the spawned process too.
    _wrap.__module__, _wrap.__qualname__ = wrap.__module__, wrap.__qualname__
    spawn._wrap = _wrap
    # In the parent, each process as mp.spawn starts it: a child stopped or gone while it still imports the
    # script (before _wrap runs) is then found by its index too, and ended with the job.
    context = getattr(spawn, "ProcessContext", None)
    if context is not None:
        init = context.__init__

        def __init__(self, processes, *args, **kwargs):
            init(self, processes, *args, **kwargs)
            for i, process in enumerate(processes):
                node.write(names.STARTED, process.pid, str(i), once=True)

        context.__init__ = __init__


class _Guarded:
    """mp.spawn's function, with this tool's look at an exception before mp.spawn's wrapper catches it."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        try:
            return self.fn(*args, **kwargs)
        except Exception as error:
            ask.uncaught(error)
            hide_frame(error)
            raise
