"""Our recipe scripts (scripts/*_laga.sh) as the tests read them: dry-run (``DRY_RUN=1``
prints the launch line instead of running it), the arguments after the entry script, and
those arguments parsed and validated the way LAGAFeature does at start-up."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

from mindspeed_laga.features import LAGAFeature
from support.laga_parser import parser_with_laga

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
# the Python the scripts ask for LAGA's kernels (their LAGA_PYTHON): this one, which has
# mindspeed_laga, whatever ``python`` is on PATH
os.environ.setdefault("LAGA_PYTHON", sys.executable)


class LagaScript:
    """``scripts/<name>``, whose launch line runs ``entry`` (pretrain_gpt.py, posttrain_gpt.py)."""

    def __init__(self, name: str, entry: str):
        self.path, self.entry = SCRIPTS / name, entry

    def dry_run(self, **env) -> List[str]:
        """The launch line the script prints with these environment variables."""
        proc = subprocess.run(["bash", str(self.path)], env=dict(os.environ, DRY_RUN="1", **env),
                              capture_output=True, text=True, timeout=60, check=True)
        return shlex.split(proc.stdout.replace("\\\n", " "))  # one flag a line, continued

    def args(self, tokens: List[str]) -> List[str]:
        """The arguments after the entry script."""
        return tokens[tokens.index(self.entry) + 1:]

    def validate(self, tokens: List[str]):
        """The parsed arguments, after LAGAFeature's start-up checks passed."""
        feature = LAGAFeature()
        args, _unknown = parser_with_laga(feature).parse_known_args(self.args(tokens))
        feature.validate_args(args)
        return args

    def assert_toggle_adds_launcher_and_flags_only(self):
        """LAGA=1 against LAGA=0: the launcher and LAGA's flags, nothing else."""
        with_laga, without = self.dry_run(LAGA="1"), self.dry_run(LAGA="0")
        i = with_laga.index(self.entry)
        assert with_laga[i - 2:i] == ["-m", "mindspeed_laga.launch"]
        assert "mindspeed_laga.launch" not in without
        extra = self.args(with_laga)
        for flag in ("--mla-latent-all-gather", "--mla-laga-kernel", "auto"):
            extra.remove(flag)
        assert extra == self.args(without)


def flags(argv: List[str]) -> Dict[str, List[List[str]]]:
    """{flag: [its values, per occurrence]} of an argument list."""
    found, current = {}, None
    for token in argv:
        if token.startswith("--"):
            current = found.setdefault(token, [])
            current.append([])
        else:
            current[-1].append(token)
    return found
