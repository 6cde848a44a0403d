"""MindSpeed-LLM's stock DeepSeek-V3 pretrain recipes, read as their own bash expands them.

The script runs under bash with its launcher (``python`` or ``torchrun``) replaced by a
function that prints its arguments, so the script's own variables are expanded exactly as
on a real node; the arguments after ``pretrain_gpt.py`` are what it trains with.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import List, Optional, Tuple

RECIPES = ("pretrain_deepseek3_671b_4k_ptd.sh", "pretrain_deepseek3_671b_4k_A3_ptd.sh")
RECIPE_DIR = Path("examples") / "mcore" / "deepseek3"
LAUNCHERS = ("python", "torchrun")  # what the stock scripts start pretrain_gpt.py with


def recipe_argv(script: Path, cp_algo: Optional[str] = None, cp_size: Optional[int] = None,
                dummies: Path = Path("/dummy"), entry: str = "pretrain_gpt.py"
                ) -> Tuple[List[str], int]:
    """The arguments the stock script hands to ``entry`` (pretrain_gpt.py; the tune
    recipes: posttrain_gpt.py), and its world size.

    ``cp_algo``/``cp_size`` replace the script's ``CP_TYPE``/``CP`` (None: as shipped).
    Placeholders such as CKPT_SAVE_DIR="your model save ckpt path" become
    ``dummies/CKPT_SAVE_DIR``."""
    text = Path(script).read_text()
    text = re.sub(r'^(\w+)="your [^"]*"', rf'\1="{dummies}/\1"', text, flags=re.M)
    if cp_size is not None:
        text = re.sub(r"^CP=\S+", f"CP={cp_size}", text, flags=re.M)
    if cp_algo is not None:
        text = re.sub(r"^CP_TYPE=\S+", f"CP_TYPE='{cp_algo}'", text, flags=re.M)
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "logs").mkdir()  # the script tees its log there
        out = Path(tmp, "argv")
        # the launcher line becomes: print every argument, NUL-separated
        printer = "".join(f"{launcher}() {{ printf '%s\\0' \"$@\" > \"$ARGV_OUT\"; }}; "
                          for launcher in LAUNCHERS)
        printer += "tee() { cat > /dev/null; }; "  # some scripts log into folders of their own
        subprocess.run(["bash", "-c", printer + "source /dev/stdin"], input=text, cwd=tmp,
                       env=dict(os.environ, ARGV_OUT=str(out)), text=True,
                       capture_output=True, timeout=60, check=True)
        argv = out.read_text().split("\0")[:-1]
    world = _assignment(text, "NPUS_PER_NODE") * _assignment(text, "NNODES")
    return argv[argv.index(entry) + 1:], world


def _assignment(text: str, name: str) -> int:
    return int(re.search(rf"^{name}=(\d+)", text, flags=re.M).group(1))
