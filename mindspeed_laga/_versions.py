"""The torch versions mindspeed-laga is tested with, enforced when it is imported.

One place for the range: pyproject.toml's dependency states the same bounds for
pip; this module refuses an out-of-range torch that got in some other way (a
vendor build, ``--no-deps``) before it fails somewhere obscure.
"""
from __future__ import annotations

import os
import re

TORCH_MIN = (2, 7, 1)     # the torch torch_npu 2.7.1 builds on
TORCH_BELOW = (2, 14, 0)  # newest tested: 2.13.x
TORCH_RANGE = ">=2.7.1,<2.14"
SKIP_CHECK_ENV = "MINDSPEED_LAGA_SKIP_TORCH_CHECK"


def parse_version(version: str) -> tuple:
    """(major, minor, micro) of a torch version string such as ``2.7.1+cu126``."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", str(version))
    if match is None:
        raise ValueError(f"cannot read a torch version from {version!r}")
    return tuple(int(part or 0) for part in match.groups())


def torch_supported(version: str) -> bool:
    return TORCH_MIN <= parse_version(version) < TORCH_BELOW


def installed_torch_version() -> str | None:
    """The version of the torch this process runs: the imported module's when torch is
    already imported, else its installed metadata, without importing it (None when torch
    has no metadata, say a source tree on the path: then :func:`check_torch` imports it)."""
    import importlib.metadata
    import sys
    if "torch" in sys.modules:
        return getattr(sys.modules["torch"], "__version__", None)
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_torch(version: str | None = None) -> None:
    """Raise ImportError naming the supported range unless torch is inside it."""
    if os.environ.get(SKIP_CHECK_ENV):
        return
    if version is None:
        import torch
        version = torch.__version__
    if not torch_supported(version):
        raise ImportError(
            f"mindspeed-laga supports torch {TORCH_RANGE} (tested from 2.7.1 to 2.13.x), "
            f"found torch {version}: install one in range (pip install 'torch{TORCH_RANGE}'), "
            f"or set {SKIP_CHECK_ENV}=1 to import it anyway, untested.")
