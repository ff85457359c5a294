"""The linter: `ruff check .` from the repository root, with the rules of ruff.toml, finds nothing. RUF100 makes a
`noqa` that names a rule not enforced here an error too, so every `noqa` left names a rule that is checked."""
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.quick


def test_ruff_finds_nothing():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_the_config_is_the_one_in_the_repository():
    shown = subprocess.run([sys.executable, "-m", "ruff", "check", "--show-settings", "models_and_data.py"], cwd=REPO,
                           capture_output=True, text=True, timeout=60).stdout
    assert str(REPO / "ruff.toml") in shown, shown[:2000]
