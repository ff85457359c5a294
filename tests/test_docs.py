"""The documentation cannot rot: every shell command in README.md and docs/ names scripts that exist and flags
their parsers (or the launcher's) accept; every relative link, and every #anchor in it, resolves; the pages
together stay within 140 KB.

A page's main command runs in the test file that launches it (docs/hangs.md's in tests/test_hangs.py, as the page
writes it), not a second time here: no page has a ```bash run block.
"""
import functools
import re
import shlex
from pathlib import Path

import pytest

from conftest import REPO, help_text, run

PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```", re.M | re.S)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FLAG = re.compile(r"^--[A-Za-z0-9][A-Za-z0-9_-]*")
DIAGNOSE_FLAGS_WITH_VALUES = {"--timeout"}
DIAGNOSE_FLAGS = {"--keep-waiting", "--help", "--version", *DIAGNOSE_FLAGS_WITH_VALUES}
LAUNCHER_FLAGS_WITH_VALUES = {"-np", "-n", "-H", "-x", "--host", "--map-by", "--bind-to", "-N"}


def page_id(path):
    return str(path.relative_to(REPO))


def blocks(path, info=None):
    """(info string, text) of the page's fenced blocks whose info string starts with `info` (all if None)."""
    found = [(match[1].strip(), match[2]) for match in FENCE.finditer(path.read_text())]
    return [(i, text) for i, text in found if info is None or i.split()[:1] == [info]]


def commands(text):
    """The commands of a shell block: comments dropped, continuations joined, split at && ; and |."""
    lines, pending = [], ""
    for raw in text.splitlines():
        line = raw.rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        lines.append(pending + line)
        pending = ""
    found = []
    for line in lines:
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:
            tokens = line.split("#")[0].split()
        current = []
        for token in tokens:
            if token in ("&&", ";", "|", "||"):
                found.append(current)
                current = []
            else:
                current.append(token)
        found.append(current)
    return [c for c in found if c]


def program_and_script(tokens):
    """(program, script, arguments of the script, launcher flags) of a command that runs a repository script;
    None for other commands (pip, cp, kubectl, ...)."""
    tokens = [t for t in tokens if not re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", t)]  # VAR=value prefixes
    while tokens and tokens[0] in ("env", "exec", "time"):
        tokens = tokens[1:]
    # the diagnosis prefix (torchdiagnose, or python -m torchdiagnose): its own options, then the launch command
    prefix = 1 if tokens[:1] == ["torchdiagnose"] else 3 if tokens[1:3] == ["-m", "torchdiagnose"] else 0
    if prefix:
        tokens = tokens[prefix:]
        while tokens and tokens[0].startswith("--"):
            assert tokens[0] in DIAGNOSE_FLAGS, f"torchdiagnose has no flag {tokens[0]}"
            tokens = tokens[2:] if tokens[0] in DIAGNOSE_FLAGS_WITH_VALUES else tokens[1:]
    if not tokens:
        return None
    program = Path(tokens[0]).name
    scripts = [i for i, t in enumerate(tokens) if t.endswith(".py")]
    if program not in ("python", "python3", "torchrun", "mpirun", "srun") or not scripts:
        return None
    i = scripts[0]
    if program in ("python", "python3") and i != 1:
        return None  # python -m something
    return program, tokens[i], tokens[i + 1:], tokens[1:i]


@functools.lru_cache(maxsize=None)
def documented_programs():
    """Every documented script, and torchrun: their --help texts are asked in one process (conftest.help_text)."""
    scripts = {param.values[2] for param in shell_commands() if (REPO / param.values[2]).is_file()}
    return frozenset(scripts | {"torchrun"})


@functools.lru_cache(maxsize=None)
def accepted_flags(program):
    """The flags a script or torchrun accepts, from its own --help."""
    text = help_text(program, documented_programs())
    # Only what argparse lists as options: a script's description (its docstring) shows commands with launcher flags.
    text = text.split("\noptions:\n", 1)[-1]
    return set(re.findall(r"--[A-Za-z0-9][A-Za-z0-9_-]*", text))


def shell_commands():
    found = []
    for page in PAGES:
        for _, text in blocks(page, "bash"):
            for tokens in commands(text):
                parsed = program_and_script(tokens)
                if parsed:
                    found.append(pytest.param(page, *parsed, id=f"{page_id(page)}:{' '.join(tokens)[:60]}"))
    return found


@pytest.mark.quick
@pytest.mark.xdist_group("test_docs_help_texts")  # one worker asks the help texts (one process), not each worker
@pytest.mark.parametrize("page, program, script, arguments, launcher_flags", shell_commands())
def test_every_documented_command_names_a_script_and_flags_that_exist(page, program, script, arguments,
                                                                       launcher_flags):
    assert (REPO / script).is_file(), f"{page_id(page)} names {script}, which does not exist"
    flags = accepted_flags(script)
    if script.startswith("launch/"):  # a scheduler's runner: its own flags, and those of the example it runs
        example = next(argument for argument in arguments if argument.endswith(".py"))
        assert (REPO / example).is_file(), f"{page_id(page)} names {example}, which does not exist"
        flags |= accepted_flags(example)
    for argument in arguments:
        if (match := FLAG.match(argument)) and argument not in ("--help",):
            assert match[0] in flags, f"{page_id(page)}: {script} has no flag {match[0]}"
    if program == "torchrun":
        for argument in launcher_flags:
            if match := FLAG.match(argument):
                assert match[0] in accepted_flags("torchrun"), f"{page_id(page)}: torchrun has no flag {match[0]}"


def test_the_diagnosis_prefix_flags_are_its_own():
    from torchdiagnose.__main__ import parser
    options = {o for action in parser()._actions for o in action.option_strings if o.startswith("--")}
    assert options == DIAGNOSE_FLAGS


def test_every_page_shows_a_command_and_has_no_run_block():
    """A main command is launched by its dedicated test (tests/test_hangs.py runs docs/hangs.md's as written), once:
    a ```bash run block, which test_docs once ran a second time, is a plain ```bash block (its scripts and flags
    still checked above)."""
    for page in PAGES:
        shown = blocks(page, "bash")
        assert all("run" not in info.split()[1:] for info, _ in shown), \
            f"{page_id(page)}: a ```bash run block; its command belongs in the test file that launches it"
        if page.name == "README.md" or "kubernetes" in page.name:
            continue
        assert shown, f"{page_id(page)} shows no command"


DOCS_BUDGET = 143_360  # bytes: README.md and docs/ together, at most 140 KB (120 KB before the decoder of steps 6-8)


def test_the_docs_total_at_most_about_90_kb():
    sizes = sorted(((len(page.read_bytes()), page_id(page)) for page in PAGES), reverse=True)
    total = sum(size for size, _ in sizes)
    largest = ", ".join(f"{name} {size:,}" for size, name in sizes[:5])
    assert total <= DOCS_BUDGET, f"README.md and docs/ hold {total:,} bytes, over {DOCS_BUDGET:,}; largest: {largest}"


def github_anchor(heading):
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(path):
    text = FENCE.sub("", path.read_text())  # a "#" line in a code block is a comment, not a heading
    return {github_anchor(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def links():
    found = []
    for page in PAGES:
        text = FENCE.sub("", page.read_text())  # links inside code blocks are not links
        for match in LINK.finditer(text):
            target = match[1] or match[2]
            if not re.match(r"[a-z]+://|mailto:", target):
                found.append(pytest.param(page, target, id=f"{page_id(page)}:{target}"))
    return found


@pytest.mark.quick
@pytest.mark.parametrize("page, target", links())
def test_every_relative_link_resolves(page, target):
    path, _, anchor = target.partition("#")
    resolved = (page.parent / path).resolve() if path else page
    assert resolved.exists(), f"{page_id(page)} links to {target}, which does not exist"
    if anchor and resolved.suffix == ".md":
        assert anchor in anchors(resolved), f"{page_id(page)} links to #{anchor}, not a heading of {resolved.name}"


def test_the_readme_is_short_and_starts_with_the_quick_start():
    text = (REPO / "README.md").read_text()
    assert len(text.encode()) <= 15_500, "README.md: at most about 15,000 bytes; the rest belongs in docs/"
    first = next(i for i, line in enumerate(text.splitlines()) if "torchrun" in line and "multigpu_torchrun.py" in line)
    assert first < 15, "the first command within the first 15 lines"


def test_no_page_is_longer_than_about_200_lines():
    for page in PAGES[1:]:
        assert len(page.read_text().splitlines()) <= 220, f"{page_id(page)}: one topic, at most about 200 lines"


def test_docs_hold_no_commit_hashes():
    for page in PAGES:
        for match in re.finditer(r"\b[0-9a-f]{7,40}\b", FENCE.sub("", page.read_text())):
            word = match[0]
            assert not (re.search(r"[a-f]", word) and re.search(r"\d", word)), f"{page_id(page)}: {word}"


def diff_lines(a, b):
    """`diff -u a b | wc -l`, the figure the docs print for a step or a feature."""
    result = run(["diff", "-u", a, b], cwd=REPO, check=False, timeout=30)
    assert result.returncode == 1, result.stderr
    return len(result.stdout.splitlines())


def test_the_diff_sizes_the_docs_print_are_the_scripts_own():
    tutorial = (REPO / "docs" / "tutorial.md").read_text()
    steps = re.findall(r"^\| `([\w./]+)` -> `([\w./]+)` \| (\d+) \|$", tutorial, re.M)
    assert len(steps) == 7, steps
    features = re.findall(r"^\| \[`(\w+\.py)`\]\(\.\./by_feature/\w+\.py\) \|.*\| (\d+) \| \[[^]]+\]\([^)]+\) \|$",
                          (REPO / "docs" / "features.md").read_text(), re.M)
    assert sorted(name for name, _ in features) == sorted(p.name for p in (REPO / "by_feature").glob("*.py"))
    for a, b, lines in steps:
        assert diff_lines(a, b) == int(lines), f"docs/tutorial.md: diff -u {a} {b} is {diff_lines(a, b)} lines"
    for name, lines in features:
        found = diff_lines("torchrun_ddp.py", f"by_feature/{name}")
        assert found == int(lines), f"docs/features.md: diff -u torchrun_ddp.py by_feature/{name} is {found} lines"


def test_the_tutorial_walks_through_every_hunk_of_each_diff():
    """docs/tutorial.md: under each `### \\`A\\` -> \\`B\\`` heading, one numbered item a hunk of `diff -u A B`."""
    tutorial = (REPO / "docs" / "tutorial.md").read_text()
    sections = re.findall(r"^### `([\w./]+)` -> `([\w./]+)`.*?\n(.*?)(?=^#{2,3} |\Z)", tutorial, re.M | re.S)
    assert [(a, b) for a, b, _ in sections] == [
        ("singlegpu.py", "multigpu.py"), ("multigpu.py", "multigpu_torchrun.py"),
        ("multigpu_torchrun.py", "multinode.py"), ("multigpu_torchrun.py", "fsdp.py"),
        ("fsdp.py", "tensor_parallel.py"), ("tensor_parallel.py", "pipeline_parallel.py"),
        ("pipeline_parallel.py", "nd_parallel.py")]
    for a, b, text in sections:
        hunks = run(["diff", "-u", a, b], cwd=REPO, check=False, timeout=30).stdout.count("\n@@ ")
        items = [int(n) for n in re.findall(r"^(\d+)\. \*\*", text, re.M)]
        assert items == list(range(1, hunks + 1)), f"docs/tutorial.md: {a} -> {b} has {hunks} hunks, items {items}"
