"""The README reads in a minute and its commands are the ones that run: under 150 lines;
what LAGA is (the paper named, the host defined) before any command; its opening commands
are CI's main leg (.ci/run) and its CPU-torch line installs the torch CI pins; the plan
commands behind its table parse with the CLI's own parser."""
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
CI = (ROOT / ".ci" / "run").read_text()


def fenced_blocks(text: str):
    return re.findall(r"^```\w*\n(.*?)^```", text, flags=re.M | re.S)


def commands(block: str):
    """The block's command lines, comments cut off."""
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def test_short():
    assert len(README.splitlines()) < 150


def test_what_it_is_comes_before_any_command():
    before = README[:README.index("```")]
    assert "LAGA (Latent All-Gather Attention)" in before
    assert "A Training-Memory Regression in MLA Sequence Parallelism" in before  # the paper
    assert re.search(r"\*\*host\*\*: the training framework", before)
    assert "MindSpeed-LLM" in before and "megatron-core" in before


def test_opening_commands_are_ci_main_leg():
    install, tests = commands(fenced_blocks(README)[0])
    ci_install = re.search(r"pip install -q (torch==\S+) &&\s+\S+ -m pip install -q -e (\S+)", CI)
    torch_pin, extras = ci_install.groups()
    assert install == f"pip install {torch_pin} -e {extras} && mindspeed-laga verify"
    ci_tests = re.search(r"run_tests main python (.*)\)", CI).group(1)
    assert shlex.split(tests) == ["python", "-m", "pytest"] + shlex.split(ci_tests)


def test_cpu_torch_line_is_given_exactly():
    torch_pin = re.search(r"pip install -q (torch==\S+)", CI).group(1)
    lines = [c for b in fenced_blocks(README) for c in commands(b)]
    assert f"pip install {torch_pin} --index-url https://download.pytorch.org/whl/cpu" in lines


@pytest.mark.parametrize("line", [c for b in fenced_blocks(README) for c in commands(b)
                                  if c.startswith("mindspeed-laga plan")])
def test_table_commands_parse(line):
    from mindspeed_laga.tools.cli import build_parser
    args = build_parser().parse_args(shlex.split(line)[1:])
    assert args is not None


def test_supported_pythons_are_what_install_takes():
    """The README's Python range is pyproject's: requires-python refuses the next one at
    install, and the classifiers list each supported version."""
    low, high = re.search(r"Python 3\.(\d+) to 3\.(\d+)", README).groups()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'requires-python = ">=3.{low},<3.{int(high) + 1}"' in pyproject
    listed = re.findall(r'"Programming Language :: Python :: 3\.(\d+)"', pyproject)
    assert listed == [str(v) for v in range(int(low), int(high) + 1)]
