"""`make lint`'s ruff half: it fails on a planted unused import and passes on the tree.

The same commands `make lint` runs (`ruff check`, `ruff format --check`, from the project
root, settings in pyproject.toml). mypy is left to `make lint`: it takes too long for here.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from support import REPO


def ruff(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_ruff_fails_on_a_planted_unused_import(tmp_path: Path) -> None:
    shutil.copytree(REPO / "mscale", tmp_path / "mscale", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    module = tmp_path / "mscale" / "findings.py"
    assert ruff("check", str(module), cwd=tmp_path).returncode == 0  # clean before the plant
    text = module.read_text()
    assert "\nimport time\n" in text
    module.write_text(text.replace("\nimport time\n", "\nimport os\nimport time\n", 1))  # in isort's order
    out = ruff("check", "--output-format", "concise", cwd=tmp_path)
    assert out.returncode != 0, out.stdout + out.stderr
    assert "mscale/findings.py" in out.stdout and "F401" in out.stdout and "`os`" in out.stdout, out.stdout


def test_ruff_passes_on_the_tree() -> None:
    check = ruff("check", "--output-format", "concise", cwd=REPO)
    assert check.returncode == 0, check.stdout + check.stderr
    fmt = ruff("format", "--check", cwd=REPO)
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr
