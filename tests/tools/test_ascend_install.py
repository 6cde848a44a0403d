"""README's Ascend line installs into an environment that already has its torch (2.7.1 +
torch_npu on an Ascend node) and leaves that torch in place: run as written (offline) in a
fresh virtual environment holding a stand-in torch of a given version."""
from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support.thirdparty import skip_or_fail

REPO = Path(__file__).resolve().parents[2]
OFFLINE = ["--no-index", "--no-build-isolation"]  # the test's own: no network, base setuptools


def ascend_line() -> str:
    """The README's command for an Ascend node: the line that ends in ``mindspeed-laga doctor``."""
    text = (REPO / "README.md").read_text()
    head = text[:text.index("\n## ")]  # the opening, before the first section
    lines = [ln.split("#")[0].strip() for ln in head.splitlines()
             if re.search(r"mindspeed-laga doctor", ln) and "pip install" in ln]
    assert len(lines) == 1, f"README's opening should have one Ascend install line, found {lines}"
    return lines[0]


def base_python() -> str:
    """The interpreter the test venv is made from: the base one (it has pip and setuptools,
    and no torch of its own to hide the stand-in)."""
    return str(Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}")


def editable_setuptools(into: Path) -> None:
    """Offline, the venv builds the editable wheel with a setuptools found on this test's own
    path that does so without the ``wheel`` package (>= 70.1), linked in through a .pth file
    (the base interpreter's may be older)."""
    for entry in sys.path:
        for dist in importlib.metadata.distributions(path=[entry], name="setuptools"):
            if tuple(int(x) for x in dist.version.split(".")[:2]) >= (70, 1):
                tools = into.parent / "buildtools"
                tools.mkdir()
                for name in ("setuptools", "pkg_resources", "_distutils_hack", dist._path.name):
                    if (Path(entry) / name).exists():
                        (tools / name).symlink_to(Path(entry) / name)
                (into / "buildtools.pth").write_text(f"{tools}\n")
                return
    skip_or_fail("no setuptools >= 70.1 on the test's path to build the editable install offline")


def fake_torch(site: Path, version: str) -> None:
    """A ``torch`` distribution pip sees as installed at ``version``."""
    dist = site / f"torch-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    (dist / "INSTALLER").write_text("pip\n")
    (dist / "RECORD").write_text("")
    (site / "torch").mkdir()
    (site / "torch" / "__init__.py").write_text(f"__version__ = {version!r}\n")


def installed_torch(python: Path) -> str:
    out = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('torch'))"],
                         capture_output=True, text=True, check=True, timeout=60)
    return out.stdout.strip()


def pip_command(line: str, python: Path) -> list:
    """The line's ``pip install ...`` part, run by the venv's python, offline, from the repo."""
    pip_part = line.split("&&")[0].split()
    assert pip_part[:2] == ["pip", "install"], line
    return [str(python), "-m", "pip", "install", *OFFLINE, *pip_part[2:]]


def test_ascend_line_installs_then_runs_doctor():
    line = ascend_line()
    assert line.split("&&")[-1].split() == ["mindspeed-laga", "doctor"], line
    assert "torch" not in line.split("&&")[0], f"the Ascend line must not name torch: {line}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("torch_version", ["2.7.1", "2.6.0"])  # Ascend's, and one outside the range
def test_ascend_line_keeps_the_installed_torch(tmp_path, torch_version):
    venv = tmp_path / "venv"
    subprocess.run([base_python(), "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
                   check=True, timeout=60)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    fake_torch(site, torch_version)
    editable_setuptools(site)
    done = subprocess.run(pip_command(ascend_line(), python), cwd=REPO, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert installed_torch(python) == torch_version
    assert (venv / "bin" / "mindspeed-laga").exists(), "the install gave no mindspeed-laga command"
