"""The recipe scripts refuse a CP configuration exactly when LAGAFeature would refuse it at
start-up: over a grid of CP sizes, algorithms, Ulysses degrees and packed documents, a
script's dry run passes (LAGA=1) if and only if the same flags pass the feature's checks.
The feature's verdict comes from the flags of a passing dry run with the CP flags set to
the grid's, so a refusal the script lacks, or one it makes up, shows as a mismatch."""
import subprocess
from typing import List, Optional

import pytest

from support.laga_scripts import LagaScript

SCRIPTS = {  # script, its packed-documents switch (None: always packs, general mask)
    "pretrain": (LagaScript("pretrain_deepseek3_laga.sh", "pretrain_gpt.py"), "RESET_MASK"),
    "tune": (LagaScript("tune_deepseek3_laga.sh", "posttrain_gpt.py"), "PACKED"),
    "128k": (LagaScript("pretrain_deepseek3_128k_laga.sh", "pretrain_gpt.py"), None),
}
ALGOS = ("ulysses_cp_algo", "kvallgather_cp_algo", "megatron_cp_algo")
GRID = [(cp, algo, None) for cp in (4, 8) for algo in ALGOS] + [
    (cp, "hybrid_cp_algo", degree) for cp in (4, 8) for degree in (1, 2, 4)]


def set_flag(argv: List[str], flag: str, value: Optional[str]) -> List[str]:
    """``argv`` with ``flag`` given ``value`` (a switch: value ""), or left out (None)."""
    out = list(argv)
    if flag in out:
        i = out.index(flag)
        del out[i:i + (1 if i + 1 == len(out) or out[i + 1].startswith("--") else 2)]
    if value is not None:
        out += [flag] + ([value] if value else [])
    return out


def feature_accepts(script: LagaScript, base: List[str], cp: int, algo: str,
                    degree: Optional[int], packed: bool) -> bool:
    argv = set_flag(script.args(base), "--context-parallel-size", str(cp))
    argv = set_flag(argv, "--context-parallel-algo", algo)
    argv = set_flag(argv, "--ulysses-degree-in-cp", None if degree is None else str(degree))
    if packed is not None:
        argv = set_flag(argv, "--reset-attention-mask", "" if packed else None)
    try:
        script.validate([script.entry] + argv)
    except ValueError:
        return False
    return True


def script_accepts(script: LagaScript, **env) -> bool:
    try:
        script.dry_run(**env)
    except subprocess.CalledProcessError as refused:
        assert refused.returncode == 2 and len(refused.stderr.splitlines()) == 1, refused.stderr
        return False
    return True


@pytest.mark.parametrize("which", SCRIPTS)
def test_script_refuses_what_the_feature_refuses(which):
    script, switch = SCRIPTS[which]
    base = script.dry_run(LAGA="1")
    assert feature_accepts(script, base, 2, "ulysses_cp_algo", None, None)
    mismatches, seen = [], set()
    for packed in ((False, True) if switch else (None,)):
        for cp, algo, degree in GRID:
            env = dict(LAGA="1", CP=str(cp), CP_TYPE=algo)
            if degree is not None:
                env["ULYSSES_DEGREE"] = str(degree)
            if switch:
                env[switch] = "1" if packed else "0"
            ours = script_accepts(script, **env)
            theirs = feature_accepts(script, base, cp, algo, degree, packed)
            seen.add(theirs)
            if ours != theirs:
                mismatches.append(f"{env}: script {'accepts' if ours else 'refuses'}, "
                                  f"feature {'accepts' if theirs else 'refuses'}")
    assert seen == {True, False}, "the grid should hold configurations of both verdicts"
    assert not mismatches, "\n".join(mismatches)
