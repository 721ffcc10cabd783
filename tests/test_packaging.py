"""The package's metadata leaves the user's torch alone; the exact versions live in constraints.txt.

The wheel is built offline (`python -m build --no-isolation`, from a copy of the sources so the
tree gets no build/ or egg-info) and its METADATA read back: torch, numpy and transformers carry
lower bounds only. Then the wheel with `[hook]` is installed, with no index, into a fresh venv
that already holds a torch of another version (a stub distribution: no second real torch wheel
can be had here); that torch must be left as it was.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from support import REPO

UNPINNED = ("torch", "numpy", "transformers")
STUB_TORCH = "2.7.0"  # not what constraints.txt holds, above the hook extra's floor


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "mscale", src / "mscale", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("dist")
    cmd = [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(src)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (whl,) = out.glob("megascale_omni-*.whl")
    return whl


def _requirements(whl: Path) -> list[Requirement]:
    with zipfile.ZipFile(whl) as z:
        (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        headers = Parser().parsestr(z.read(meta).decode())
    return [Requirement(r) for r in headers.get_all("Requires-Dist") or []]


def test_wheel_metadata_has_no_exact_pin_on_torch_numpy_transformers(wheel: Path) -> None:
    reqs = _requirements(wheel)
    for name in UNPINNED:
        found = [r for r in reqs if r.name.lower() == name]
        assert found, f"{name} is not in the wheel's Requires-Dist"
        for r in found:
            ops = {s.operator for s in r.specifier}
            assert ops and ops <= {">=", ">", "!="}, f"{r} in the wheel's metadata: only lower bounds belong there"
    # the versions CI runs with satisfy the metadata's floors
    import numpy
    import torch
    import transformers

    installed = {"torch": torch.__version__, "numpy": numpy.__version__, "transformers": transformers.__version__}
    for r in reqs:
        if r.name.lower() in installed:
            assert r.specifier.contains(installed[r.name.lower()], prereleases=True), (r, installed)


def test_constraints_file_pins_what_ci_runs() -> None:
    """The Makefile installs through constraints.txt, and it holds torch at the CPU wheel's version."""
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            r = Requirement(line)
            pins[r.name.lower()] = r
    import torch

    assert str(pins["torch"].specifier) == "==2.13.0"
    assert pins["torch"].specifier.contains(torch.__version__)
    assert "-c constraints.txt -e '.[hook,dev]'" in (REPO / "Makefile").read_text()


def _env_with_stub_torch(root: Path) -> Path:
    """A venv whose own site-packages holds torch STUB_TORCH (metadata and a module), and which
    sees every other package of this venv through a .pth to a folder of links (outside its
    prefix, so pip there never uninstalls them), torch and this project left out."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True, timeout=60)
    py = root / "venv" / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout.strip()
    )
    dist = site / f"torch-{STUB_TORCH}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {STUB_TORCH}\n")
    (dist / "INSTALLER").write_text("stub\n")
    (site / "torch").mkdir()
    (site / "torch" / "__init__.py").write_text(f"__version__ = {STUB_TORCH!r}\n")
    (dist / "RECORD").write_text(f"torch/__init__.py,,\ntorch-{STUB_TORCH}.dist-info/METADATA,,\n")
    ours = Path(sysconfig.get_paths()["purelib"])
    others = root / "others"
    others.mkdir()
    skip = ("torch", "functorch", "megascale", "__editable__", "_mscale")
    for entry in ours.iterdir():
        if entry.name.lower().startswith(skip) or entry.suffix == ".pth":
            continue
        (others / entry.name).symlink_to(entry)
    (site / "others.pth").write_text(f"{others}\n")
    return py


def _torch_version(py: Path) -> str:
    code = "import importlib.metadata as m; print(m.version('torch'))"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([str(py), "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_installing_the_wheel_with_hook_keeps_another_torch(wheel: Path, tmp_path: Path) -> None:
    py = _env_with_stub_torch(tmp_path)
    assert _torch_version(py) == STUB_TORCH
    # no index, no configuration (this machine's pip.conf adds local indexes and a constraint):
    # the wheel's requirements must be met by what the env holds, torch included
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PYTHONPATH"}
    env["PIP_CONFIG_FILE"] = os.devnull
    cmd = [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-index", "--no-cache-dir"]
    done = subprocess.run(
        [*cmd, "--find-links", str(wheel.parent), f"{wheel}[hook]"],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Successfully installed megascale-omni" in done.stdout
    assert _torch_version(py) == STUB_TORCH, done.stdout
    # the control: a requirement that does pin another torch is refused here, not met by the stub
    pinned = subprocess.run([*cmd, "--dry-run", "torch==2.13.0"], capture_output=True, text=True, env=env, timeout=240)
    assert pinned.returncode != 0 and _torch_version(py) == STUB_TORCH


def test_readme_names_the_versions_ci_tests() -> None:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            r = Requirement(line)
            pins[r.name.lower()] = str(r.specifier).removeprefix("==")
    readme = (REPO / "README.md").read_text()
    tested = readme[readme.index("CI tests one set:") :][:300]
    for name in ("torch", "transformers", "accelerate", "lightning", "numpy"):
        assert f"{name} {pins[name]}" in tested, f"README's tested versions disagree with constraints.txt on {name}"
