"""LAGA in the parallel layouts users train with, through MindSpeed-LLM's own ``pretrain_gpt.py``
(tests/support/loop/real_loop.py): tensor parallelism with sequence parallelism, pipeline and
virtual pipeline parallelism, expert parallelism with the stock alltoall dispatcher, the
distributed optimizer with ``--overlap-grad-reduce`` and gradient accumulation.

Each case trains the scaled-down stock DeepSeek-V3 recipe in one layout with
``--mla-latent-all-gather`` at CP > 1 and must equal the same layout at CP = 1 (where LAGA
is a no-op and the host's own MLA attention runs) iteration by iteration, with the
tolerances of tests/support/loop/compare.py (measured on the pretrain loop; the 1%-softmax-scale mutant
fails each alone). Every rank ran LAGA's attention on every MLA forward it made and the
host's core attention never.

The layouts, scaled to CPU ranks (4 at most, the CP = 1 reference on half as many):

- ``tp2-sp``: TP 2 with the stock ``--sequence-parallel``; ``--expert-tensor-parallel-size 2``
  because at TP 2 with expert TP 1 and EP 1 Megatron's per-expert MLP (the one without
  ``--moe-grouped-gemm``, an NPU kernel) reduce-scatters its uneven token share over the TP
  group and the ranks' collectives disagree, LAGA or not (docs/HOSTS.md); the padded
  vocabulary divisible by TP.
- ``pp2``: PP 2 over 4 layers (the dense one and a MoE one on the first stage, two MoE
  layers and MTP on the last), global batch 4 so the pipeline holds several micro-batches.
  With the recipe's 2 layers the first stage would hold only the dense layer, which
  MindSpeed-LLM refuses (test_layout_refused).
- ``ep2-alltoall``: EP 2 with DP 2, the stock ``--moe-token-dispatcher-type alltoall``.
- ``accumulate-overlap``: the stock ``--use-distributed-optimizer`` (sharded over DP x CP)
  with ``--overlap-grad-reduce`` and global batch 4 at micro-batch 1 and DP 1: four
  accumulated micro-batches per step, LAGA's weight gradients reaching the bucketed grad
  buffers through the hooks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List

import pytest

from support.loop import compare, real_loop
from support.loop.compare import assert_ran, require_loop_modules

pytestmark = [pytest.mark.ascend, pytest.mark.loop, pytest.mark.hosts]


@dataclass(frozen=True)
class Layout:
    set: Dict[str, str] = field(default_factory=dict)  # stock flags' values replaced
    extra: List[str] = field(default_factory=list)     # flags added
    dp: int = 1


LAYOUTS = {
    "tp2-sp": Layout({"--tensor-model-parallel-size": "2", "--expert-tensor-parallel-size": "2",
                      "--padded-vocab-size": "258"}),
    "pp2": Layout({"--pipeline-model-parallel-size": "2", "--num-layers": "4",
                   "--global-batch-size": "4"}),
    "ep2-alltoall": Layout({"--expert-model-parallel-size": "2"}, dp=2),
    "accumulate-overlap": Layout({"--global-batch-size": "4"}, ["--overlap-grad-reduce"]),
}

# case -> (layout, CP, algorithm, recipe keywords)
CASES = {
    "tp2-sp-ulysses": ("tp2-sp", 2, "ulysses_cp_algo", {}),
    "pp2-megatron": ("pp2", 2, "megatron_cp_algo", {}),
    "ep2-alltoall-kvallgather": ("ep2-alltoall", 2, "kvallgather_cp_algo", {}),
    "accumulate-overlap-hybrid-u2": ("accumulate-overlap", 4, "hybrid_cp_algo",
                                     dict(ulysses_degree=2)),
}


@pytest.fixture(scope="module")
def layout_loop(host_sources, tmp_path_factory):
    """run(name, layout, cp, algo, laga, **recipe): one loop in that layout, each name once."""
    require_loop_modules()
    workdir = tmp_path_factory.mktemp("layouts")
    ready = real_loop.prepare(host_sources, workdir, real_loop.default_documents())
    runs = {}

    def run(name, layout, cp, algo="ulysses_cp_algo", laga=True, **recipe):
        if name not in runs:
            argv = real_loop.recipe(Path(ready["sources"]["MINDSPEED_LLM_SRC"]), cp, algo, laga,
                                    ready["data_path"], layout=layout.set,
                                    extra=layout.extra, **recipe)
            runs[name] = real_loop.run_loop(ready["sources"], workdir / name,
                                            real_loop.ranks(argv, layout.dp), argv,
                                            timeout_s=compare.RUN_TIMEOUT_S)
        return runs[name]

    return run


def layout_reference(layout_loop, layout_name):
    ref = layout_loop(f"cp1-{layout_name}", LAYOUTS[layout_name], 1)
    assert_ran(ref, laga=False)
    losses = ref.series("lm loss")
    assert max(losses) - min(losses) > 1e-3, f"the losses do not move: {losses}"
    return ref


@pytest.mark.timeout(3 * compare.RUN_TIMEOUT_S)
@pytest.mark.parametrize("case", list(CASES))
def test_layout_equals_cp1(layout_loop, case):
    layout_name, cp, algo, recipe = CASES[case]
    ref = layout_reference(layout_loop, layout_name)
    run = layout_loop(case, LAYOUTS[layout_name], cp, algo, **recipe)
    assert_ran(run, laga=True)
    compare.assert_same_training(run, ref)


# (layout, the refusal every rank prints): what the host itself stops at start-up
REFUSED = {
    "pp2-dense-stage": (Layout({"--pipeline-model-parallel-size": "2",
                                "--global-batch-size": "4"}),
                        "When using first-k-dense-replace, it is not allowed for all layers "
                        "within a pp stage to be dense layers."),
}


@pytest.mark.timeout(compare.RUN_TIMEOUT_S + 60)
@pytest.mark.parametrize("case", list(REFUSED))
def test_layout_refused(layout_loop, case):
    """MindSpeed-LLM refuses a pipeline stage of dense layers only (2 layers, the first dense,
    over PP 2), LAGA or not, before iteration 1. (How many ranks print it depends on timing:
    torchrun stops the others as soon as the first rank exits.)"""
    layout, refusal = REFUSED[case]
    with pytest.raises(real_loop.LoopFailed) as failed:
        layout_loop(f"refused-{case}", layout, 2, "megatron_cp_algo")
    log = failed.value.log
    assert f"AssertionError: {refusal}" in log, failed.value
    assert not real_loop.parse_log(log), "it trained before refusing"
