"""LAGA through MindSpeed-LLM 26.1.0's FSDP2 backend: the unmodified ``train_fsdp2.py``
under ``torchrun ... -m mindspeed_laga.launch train_fsdp2.py CONFIG.yaml`` on gloo CPU
ranks, FSDP2 sharding over the ranks (tests/support/fsdp2/loop.py).

The model is a shrunk HF DeepSeek-V3 (``deepseek_v3``: q-lora MLA, one dense and one MoE
layer), the YAML the host's own GLM-5.2 system test's pointed at it, fp32. Each case
turns LAGA on with ``--parallel.mla_latent_all_gather true`` at CP 2 and must train as
the host's own CP 1 run (one rank, the host's attention) does, step by step: the loss
(the sum of the two micro-batches', at full precision) and the grad norm the trainer
clips with. The host's ``clip_grad_norm`` multiplies its norm by the CP size, so a CP P
run's norm is compared divided by P.

Tolerances, measured here (docs/FSDP2.md): LAGA at CP 2 against CP 1 differs by at most
2.4e-7 (losses), 0 (step 1's grad norm) and 1.3e-5 (the grad norms of steps 2 and 3)
relative; the host's own ulysses CP 2 against its CP 1 by as much (2.4e-7, 7.1e-8,
1.3e-5): fp32 sums in another order, grown by Adam's first steps. Two plausible bugs fail
the cases, each on step 1's loss already: the key's rope one position off (``cos``/``sin``
rolled by one: 9.4e-6, ulysses) and ring's chunks read as contiguous slices (layout
``contiguous`` for ``zigzag``: 1.4e-3).

Every rank counts its calls: LAGA ran on every attention forward and the host's fused
attention never. After the first step, every later layer call does 1 latent all-gather
(ring; ulysses adds the all-to-alls of Q and O), its backward 1 reduce-scatter (and
their adjoints), and no host read (tests/support/loop/steady_state.py). The gather carries
d_c + d_r values per token and layer (40 here, 576 at DeepSeek-V3's dims); ulysses' all-to-alls
carry the queries (n x (d_n + d_r)) out and the outputs (n x d_v) back.
"""
from __future__ import annotations

import pytest

from support.fsdp2 import loop
from support.fsdp2.compare import MICRO_BATCHES, assert_ran, assert_same_training
from support.loop.compare import RUN_TIMEOUT_S, require_loop_modules
from support.loop.steady_state import assert_steady_state
from support.thirdparty import fsdp2_sources

pytestmark = [pytest.mark.ascend, pytest.mark.loop, pytest.mark.hosts]


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory):
    """run(name, cp, cp_type, laga, ...): each case run once on the shared model and text."""
    require_loop_modules()
    return loop.runner(fsdp2_sources(), tmp_path_factory.mktemp("fsdp2"), RUN_TIMEOUT_S)


@pytest.mark.parametrize("cp_type, data, recompute", [("ulysses", "heads", False),
                                                       ("ring", "allgather", True)])
def test_laga_cp2_equals_host_cp1(fsdp2, cp_type, data, recompute):
    """ring runs with the system test's own ``parallel.recompute: true`` (each layer's
    forward again in backward: no exchange and no host read there either)."""
    ref = fsdp2("host-cp1")
    overrides = ["--parallel.recompute", "true"] if recompute else []
    run = fsdp2(f"laga-cp2-{cp_type}", cp=2, cp_type=cp_type, laga=True, overrides=overrides)
    assert_ran(run, laga=True, recompute=recompute)
    assert_same_training(run, ref, cp=2)
    assert_steady_state(run, MICRO_BATCHES, loop.STEPS, data=data)
    # what crosses the wire per token and layer: the latent and rope key (d_c + d_r; 576 at
    # DeepSeek-V3's dims), and under ulysses the queries out and the outputs back
    dims = loop.DEEPSEEK_V3
    latent = dims["kv_lora_rank"] + dims["qk_rope_head_dim"]
    n = dims["num_attention_heads"]
    query_and_output = {n * (dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"]),
                        n * dims["v_head_dim"]}
    local = loop.SEQ_LENGTH // 2
    assert run.values_per_token("all_gather", local) == {latent}
    assert run.values_per_token("all_to_all", local) == \
        (query_and_output if data == "heads" else set())
    # and ``mindspeed-laga plan --backend fsdp2`` at these dims plans what was counted
    planned = plan_laga_widths(dims, cp_type, loop.SEQ_LENGTH)
    for kind in ("all_gather", "all_to_all"):
        assert run.values_per_token(kind, local) == planned.get(kind, set())


@pytest.mark.parametrize("cp_type", ["ulysses", "ring"])
def test_laga_cp4_equals_host_cp1(fsdp2, cp_type):
    """CP 4 on 4 ranks (ulysses: one head a rank): the same training as the host's CP 1."""
    ref = fsdp2("host-cp1")
    run = fsdp2(f"laga-cp4-{cp_type}", cp=4, cp_type=cp_type, laga=True)
    assert_ran(run, laga=True)
    assert_same_training(run, ref, cp=4)
    dims = loop.DEEPSEEK_V3
    latent = dims["kv_lora_rank"] + dims["qk_rope_head_dim"]
    assert run.values_per_token("all_gather", loop.SEQ_LENGTH // 4) == {latent}


def plan_laga_widths(dims, cp_type, seq_len):
    """{collective kind: the widths} of LAGA's row in ``plan --backend fsdp2 --json`` at
    ``dims`` (a config.json's keys), CP 2."""
    from mindspeed_laga.tools.commands import plan_fsdp2
    from mindspeed_laga.tools.cli import build_parser
    flags = {"--heads": "num_attention_heads", "--qk-head-dim": "qk_nope_head_dim",
             "--qk-pos-emb-head-dim": "qk_rope_head_dim", "--v-head-dim": "v_head_dim",
             "--kv-lora-rank": "kv_lora_rank", "--hidden-size": "hidden_size",
             "--q-lora-rank": "q_lora_rank"}
    argv = ["plan", "--backend", "fsdp2", "--cp", "2", "--cp-type", cp_type, "--seq-len", str(seq_len)]
    for flag, key in flags.items():
        argv += [flag, str(dims[key])]
    table = plan_fsdp2.table_from_args(build_parser().parse_args(argv))
    laga = next(row for name, row in table["paths"].items() if name.startswith("laga"))
    widths = {}
    for t in laga["transfers"]:
        widths.setdefault(t["kind"], set()).add(t["width"])
    return widths


def test_host_ulysses_cp2_equals_its_cp1(fsdp2):
    """The host's own CP 2 (ulysses: its all-to-all of per-head Q/K/V and fused attention)
    trains as its CP 1 does within the same bounds, and LAGA's ulysses run as it does.
    The host's ring CP calls MindSpeed's built kernels (``fusion_attention_v2``,
    ``npu_ring_attention_update``), which have no CPU stand-ins here: it is not compared."""
    ref, host = fsdp2("host-cp1"), fsdp2("host-cp2-ulysses", cp=2)
    assert_ran(host, laga=False)
    assert_same_training(host, ref, cp=2)
    laga = fsdp2("laga-cp2-ulysses", cp=2, cp_type="ulysses", laga=True)
    assert_same_training(laga, host, cp=1)


@pytest.mark.parametrize("override, message", [
    (["--data.cutoff_len", "30"], "data.cutoff_len 30 does not split into 4 equal pieces"),
    (["--parallel.cp_type", "ring", "--model.model_name_or_path", "{qwen}"],
     "model_type 'qwen3' has no MLA (kv_lora_rank)"),
])
def test_refused_on_every_rank(fsdp2, override, message):
    """With the key on, what LAGA does not cover stops every rank at launch, before the
    process group (so before any collective), naming the key and the fix."""
    qwen = fsdp2.workdir / "qwen"
    qwen.mkdir(exist_ok=True)
    (qwen / "config.json").write_text('{"model_type": "qwen3", "num_attention_heads": 4}')
    override = [a.format(qwen=qwen) for a in override]
    name = "refused-" + override[1].replace("/", "_")[-12:]
    with pytest.raises(loop.Fsdp2Failed) as failed:
        fsdp2(name, cp=2, cp_type="ring", laga=True, overrides=override, every_rank_exits=True)
    for rank in range(2):
        assert any(line.startswith(f"mindspeed_laga.launch (rank {rank}): {loop.LAGA_KEY}")
                   and message in line for line in failed.value.log.splitlines()), \
            failed.value.log[-3000:]
