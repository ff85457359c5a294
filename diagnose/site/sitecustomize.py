"""Loaded by every Python process of a job started under `python -m diagnose` (it puts this folder first on
PYTHONPATH). It costs an import of nothing heavy: torch is not imported here. It

- hands on to the next sitecustomize on sys.path (Python imports only the first one it finds, and a job's own,
  or a test's probes, must still run);
- arms diagnose.rank once torch.distributed is imported, so that the process group a script makes is watched.

Outside such a job (DIAGNOSE_TIMEOUT unset) it only hands on.
"""
import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _hand_on():
    for entry in sys.path:
        if os.path.abspath(entry or os.getcwd()) == _HERE:
            continue
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [entry or os.getcwd()])
        if spec is not None and spec.origin and os.path.dirname(os.path.abspath(spec.origin)) != _HERE:
            module = importlib.util.module_from_spec(spec)
            sys.modules["_diagnose_next_sitecustomize"] = module
            spec.loader.exec_module(module)
            return


def _arm():
    # The package sits beside this folder; import it without leaving its parent on sys.path, where it would
    # shadow the job's own modules of the same names.
    parent = os.path.dirname(os.path.dirname(_HERE))
    sys.path.insert(0, parent)
    try:
        import diagnose.rank
    finally:
        sys.path.remove(parent)
    diagnose.rank.arm()


if os.environ.get("DIAGNOSE_TIMEOUT"):
    _arm()
_hand_on()
