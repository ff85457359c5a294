"""One form in every copy. Each example copies alone, so the protections it needs (a store for torchrun's
restarts, the clean exit, the choice of device and backend, the atomic save, the checks of its flags) stand in
many files. This test keeps every copy of such a block the same text, as Accelerate's ExampleDifferenceTests keep
its by_feature copies in step with their base: a fix made in one copy and not in the others fails here, with the
diff. A copy that must differ is listed in VARIANTS with the words it changes and why.
"""
import ast
import difflib
import re
import textwrap

import pytest

from conftest import REPO

pytestmark = pytest.mark.quick

EXAMPLES = sorted(p for pattern in ("*.py", "by_feature/*.py", "launch/*.py") for p in REPO.glob(pattern))

# Functions the examples repeat: every definition of the name is one text.
FUNCTIONS = ("group_store", "check_snapshot_path", "positive_int",
             # steps 6 to 8 (tensor_parallel.py, pipeline_parallel.py, nd_parallel.py): what they share
             "device_of", "layout_of", "check_model", "whole_model", "build_stage", "stage_indices", "bubble",
             "apply_tp", "idle_lines", "settle_grads", "holdings", "where", "state", "set_state", "_save",
             "synchronize", "timed",
             # the launchers' checks (run_with_*.py) and hangs.py's
             "check_collectives", "report", "tensor", "say",
             # torchrun_ddp.py and its by_feature copies
             "read_snapshot", "save", "labelled", "classification_splits",
             # the torchft examples
             "indices")

# Blocks inside a function: from the line that matches the first pattern to the one that matches the second, dedented.
BLOCKS = {
    "the device": (r"accelerator = torch\.accelerator\.current_accelerator\(check_available=True\)",
                   r"device = torch\.device\(accelerator\.type, "),
    "the backend": (r"backend = args\.backend or dist\.get_default_backend_for_device\(device\)$",
                    r'sys\.exit\("error: --backend nccl needs'),
    "the import before any process group": (r"^import torch\.distributed\.nn\b", r"^import torch\.distributed\.nn\b"),
    "the clean exit": (r"except \(Exception, SystemExit\) as error:$", r"os\._exit\(1\)$"),
    "a group that a framework may own": (r"owns_group = not dist\.is_initialized\(\)$",
                                         r"world_size=world_size, timeout=timeout"),
    "the atomic save of a snapshot": (r'tmp = self\.snapshot_path \+ "\.tmp"$', r"os\.replace\(tmp, "),
    "the atomic save of a file": (r'with open\(path \+ "\.tmp", "wb"\) as f:', r'os\.replace\(path \+ "\.tmp", path\)'),
}

# (block, file): how that file's copy differs from the common form, and why. A dict renames the common form's words
# to the file's; None: the file has the block in another shape, checked by its own tests.
VARIANTS = {
    ("the device", "multigpu.py"): ({"local_world_size": "world_size", "local_rank": "rank"},
                                    "mp.spawn starts every process on one machine: the rank is the local rank"),
    ("the device", "run_with_python.py"): ({"local_world_size": "world_size", "local_rank": "rank"},
                                           "mp.spawn starts every process on one machine: the rank is the local rank"),
    ("the device", "ddp.py"): ({"local_world_size": "world_size", "local_rank": "rank"},
                               "mp.spawn starts every process on one machine: the rank is the local rank"),
    ("the device", "ddp.py#2"): (None, "the one-process reference run: device 0"),
    ("the device", "singlegpu.py"): (None, "one process: device 0, no processes to count"),
    ("the device", "fault_tolerant.py"): (None, "one process a replica group"),
    ("the device", "run_with_python.py#2"): (None, "the parent, which starts no process group, picks the backend"),
    ("the backend", "ddp.py"): (None, "it checks --backend where it starts the processes (ddp.py's main)"),
    ("the import before any process group", "launch/ray_train.py"): (None, "in Ray's worker, its why above it"),
    ("where", "fsdp.py"): (None, "step 5's marker: another model, no layout (steps 6 to 8 share theirs)"),
    ("state", "fsdp.py"): (None, "step 5's trainer: one model, not a list of stages"),
    ("_save", "fsdp.py"): (None, "step 5 saves asynchronously where it can (--async_save)"),
    ("classification_splits", "models_and_data.py"): (None, "the models module's, its parameters documented"),
    ("a group that a framework may own", "train.py"): (None, "the Trainer joins the group that train.py starts"),
}


def function_text(path, name):
    source = path.read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return "\n".join(source.splitlines()[node.lineno - 1:node.end_lineno])
    return None


def block_texts(path, first, last):
    """Every run of lines from one that matches `first` to the next that matches `last`, dedented."""
    lines, found = path.read_text().splitlines(), []
    for start, line in enumerate(lines):
        if re.search(first, line.strip()):
            for end in range(start, len(lines)):
                if re.search(last, lines[end].strip()):
                    found.append(textwrap.dedent("\n".join(lines[start:end + 1])))
                    break
            else:  # another shape: a copy that differs, unless VARIANTS exempts it
                found.append(f"{line.strip()}\n(line {start + 1}: no line after it matches /{last}/)")
    return found


def copies(name):
    """{where: text} of every copy; where: the file, and #2, #3... for its later copies."""
    found = {}
    for path in EXAMPLES:
        where = str(path.relative_to(REPO))
        texts = [function_text(path, name)] if name in FUNCTIONS else block_texts(path, *BLOCKS[name])
        for number, text in enumerate(filter(None, texts), 1):
            found[where if number == 1 else f"{where}#{number}"] = text
    return found


def as_common(name, where, text):
    """The copy with the file's declared words renamed back to the common form's; None where it is exempt."""
    renames, _ = VARIANTS.get((name, where), ({}, None))
    if renames is None:
        return None
    for common, own in renames.items():
        text = re.sub(rf"\b{own}\b", common, text)
    return text


@pytest.mark.parametrize("name", [*FUNCTIONS, *BLOCKS])
def test_every_copy_is_the_same_text(name):
    found = {where: as_common(name, where, text) for where, text in copies(name).items()}
    found = {where: text for where, text in found.items() if text is not None}
    assert len(found) >= 2, f"{name}: in {sorted(found)} alone; a block of one file needs no test"
    texts = sorted(set(found.values()), key=lambda text: -list(found.values()).count(text))
    common = texts[0]
    differing = []
    for where, text in sorted(found.items()):
        if text != common:
            diff = difflib.unified_diff(common.splitlines(), text.splitlines(), "the common form", where, lineterm="")
            differing.append("\n".join(diff))
    assert not differing, (f"{name}: {len(differing)} of {len(found)} copies differ from the others' "
                           f"({sorted(w for w, t in found.items() if t == common)}):\n" + "\n\n".join(differing))


def test_every_variant_names_a_file_that_has_the_block():
    for (name, where), (_renames, why) in VARIANTS.items():
        assert where in copies(name) and why, (name, where)
