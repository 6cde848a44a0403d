"""The supported torch range, checked when mindspeed_laga is imported."""
import os
import subprocess
import sys

import pytest

from mindspeed_laga._versions import SKIP_CHECK_ENV, check_torch, parse_version

pytestmark = pytest.mark.ascend  # the leg that runs it (tests/conftest.py)

INSIDE = ["2.7.1", "2.7.1+cu126", "2.8.0", "2.10.0+cpu", "2.13.0", "2.13.0+cpu", "2.13.9",
          "2.13.0a0+git1234abc"]
OUTSIDE = ["2.7.0", "2.6.0+cpu", "2.1.2", "1.13.1", "2.14.0", "2.14.0a0+gitdeadbee", "3.0.0"]


@pytest.mark.parametrize("version", INSIDE)
def test_torch_in_range_imports(version):
    check_torch(version)


@pytest.mark.parametrize("version", OUTSIDE)
def test_torch_out_of_range_is_a_clear_import_error(version, monkeypatch):
    monkeypatch.delenv(SKIP_CHECK_ENV, raising=False)
    with pytest.raises(ImportError, match=rf"supports torch >=2\.7\.1,<2\.14.*found torch "
                                          rf"{version.replace('+', '.')}.*{SKIP_CHECK_ENV}"):
        check_torch(version)


def test_the_check_can_be_skipped(monkeypatch):
    monkeypatch.setenv(SKIP_CHECK_ENV, "1")
    check_torch("2.1.0")


def test_unreadable_version_is_an_error():
    with pytest.raises(ValueError, match="cannot read a torch version"):
        parse_version("nightly")


def test_package_import_refuses_an_untested_torch():
    """The check runs at ``import mindspeed_laga``, before anything else of the package."""
    code = ("import torch; torch.__version__ = '2.6.0'\n"
            "try:\n    import mindspeed_laga\nexcept ImportError as e:\n    print('refused:', e)")
    env = {k: v for k, v in os.environ.items() if k != SKIP_CHECK_ENV}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("refused: mindspeed-laga supports torch"), proc.stdout
