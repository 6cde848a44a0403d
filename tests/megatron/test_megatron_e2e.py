"""Real megatron-core (0.16.1 to 0.19.2) MLA GPT trained on CPU with the LAGA patch, against CP=1.

Three spawned gloo worlds, each running several configurations:

- world 1: the single-process reference (CP=1, megatron's unpatched forward
  with the plain baseline core attention), for two model variants; and the
  patched forward at CP=1, which must be megatron's own forward.
- world 2 (CP=2): megatron's unpatched forward with the CP baseline attention;
  the patch with form laga/explicit x cp_algo allgather/ulysses; ulysses on
  megatron's zigzag batches; core options passed through (prefix trimming,
  blockwise recompute, the overlapped latent gather); eval mode; a
  fallback; a mis-declared layout (must be caught by the comparison).
- world 4: CP=4 with the four patched forms; then TP=2 x CP=2, compared with
  megatron's own TP=2 run (TP=2 x DP=2, same batch on both replicas).
- packed (THD) worlds 1, 2, 4: documents packed into one sequence (padded to
  megatron's THD split, and unpadded), megatron's own CP=1 forward on them
  vs the patch at CP=2 and 4 (split per document as get_thd_batch_on_this_cp_rank
  does), bytes compared with an unpacked run of the same length; the packed
  world 4 also runs hybrid CP (CP=4, ulysses_degree=2) on hybrid-zigzag batches
  against the unpacked CP=1 reference.

Batches: allgather runs use megatron's get_batch_on_this_cp_rank (zigzag);
ulysses runs use contiguous shards (mindspeed_laga.layout.shard) and declare
layout="contiguous", plus one ulysses run on zigzag batches with
layout="zigzag". Every run trains 3 SGD steps; losses are the global mean
over all tokens and grads are megatron's main_grad after its dp x cp
reduction (TP shards gathered).
"""
from __future__ import annotations

import contextlib
import functools
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
from mindspeed_laga.tools import megatron_cpu as mc  # noqa: E402

from mindspeed_laga.tools.spawn import WorkerError, run_on_ranks  # noqa: E402
from support import megatron_steady  # noqa: E402
from support.megatron_training import (LOSS_TOL, STEPS, assert_not_degenerate,  # noqa: E402
                                       assert_same_training)

pytestmark = pytest.mark.mcore  # the leg that runs it (tests/conftest.py)

VARIANTS = {
    "yarn-qlora": mc.TinyMLA(),
    "rope-no-qlora": mc.TinyMLA(rope_type="rope", q_lora_rank=None),
    "packed": mc.TinyMLA(seq_length=64, micro_batch=1),  # one sequence of packed documents
}
# Documents of the packed runs: stored at padded lengths (multiples of 2*CP for CP <= 4,
# as megatron's THD split needs), real lengths shorter; and the same without padding.
DOCS = {"padded": mc.PackedDocs(real=(13, 24, 5, 16), padded=(16, 24, 8, 16)),
        "exact": mc.PackedDocs(real=(16, 24, 8, 16), padded=(16, 24, 8, 16))}
RECOMPUTE_CORE_ATTN = dict(recompute_granularity="selective", recompute_modules=["core_attn"])
OPTIONS = {  # core options through patch_megatron_mla: (patch arguments, batch layout)
    "laga-allgather+trim": (dict(cp_algo="allgather", trim_causal_prefix=True), "zigzag"),
    "laga-allgather+recompute+overlap": (dict(cp_algo="allgather", recompute_kv=True,
                                              kv_block_size=8, overlap_latent_gather=True),
                                         "zigzag"),
    "laga-ulysses+recompute+overlap": (dict(cp_algo="ulysses", layout="contiguous",
                                            recompute_kv=True, kv_block_size=8,
                                            overlap_latent_gather=True), "contiguous"),
    "laga-allgather+all-options": (dict(cp_algo="allgather", trim_causal_prefix=True,
                                        recompute_kv=True, kv_block_size=5,
                                        overlap_latent_gather=True), "zigzag"),
}
PATCHED = {  # name: (patch arguments, batch layout)
    "laga-allgather": (dict(cp_algo="allgather"), "zigzag"),
    "laga-ulysses": (dict(cp_algo="ulysses", layout="contiguous"), "contiguous"),
    "explicit-allgather": (dict(form="explicit", cp_algo="allgather"), "zigzag"),
    "explicit-ulysses": (dict(form="explicit", cp_algo="ulysses", layout="contiguous"),
                         "contiguous"),
}


# ----------------------------------------------------------------- worker side

def _run(name, results, tp, cp, variant="yarn-qlora", patch=None, layout="zigzag", **config):
    """Build, (un)patch, train; store losses, grads and the collectives' tags."""
    import mindspeed_laga
    from mindspeed_laga import count_bytes
    tiny = VARIANTS[variant]
    if patch is None:
        mindspeed_laga.unpatch_megatron_mla()
    else:
        mindspeed_laga.patch_megatron_mla(**patch)
    model = mc.build_tiny_mla_gpt(tiny, tp=tp, cp=cp, **config)
    counted = patch is not None and cp > 1
    with count_bytes() as counter, warnings.catch_warnings(record=True) as caught, \
            (megatron_steady.counted_mla(tiny.num_layers) if counted
             else contextlib.nullcontext({})) as steady:
        warnings.simplefilter("always")
        res = mc.train(model, mc.make_batches(tiny, STEPS), layout=layout, tp=tp)
    results[name] = dict(losses=res.losses, grads=res.grads, bytes=counter.bytes(),
                         tags=sorted({r.tag for r in counter.records if r.kind != "handshake"}),
                         warnings=[str(w.message) for w in caught if "mindspeed_laga" in
                                   str(w.message)], steady=steady, layers=tiny.num_layers)


def _run_eval(name, results, cp):
    """Eval-mode forward (no inference context) at CP>1 takes the LAGA path too."""
    import mindspeed_laga
    from mindspeed_laga import count_bytes
    tiny = VARIANTS["yarn-qlora"]
    mindspeed_laga.patch_megatron_mla(cp_algo="allgather")
    model = mc.build_tiny_mla_gpt(tiny, cp=cp)
    with count_bytes() as counter:
        loss = mc.eval_loss(model, mc.make_batches(tiny, 1)[0])
    results[name] = dict(loss=loss, tags=sorted({r.tag for r in counter.records}))


def _run_expect_error(name, results, cp, patch, layout, **config):
    try:
        _run(name, {}, 1, cp, patch=patch, layout=layout, **config)
    except ValueError as exc:
        results[name] = dict(error=str(exc))
    else:
        results[name] = dict(error=None)


def _world_1(results):
    mc.init_parallel(cp=1)
    for variant in VARIANTS:
        _run(f"reference/{variant}", results, 1, 1, variant)
    _run("patched-cp1", results, 1, 1, patch=dict(cp_algo="allgather"))


def _world_2(results):
    mc.init_parallel(cp=2)
    _run("baseline", results, 1, 2)
    for name, (patch, layout) in PATCHED.items():
        _run(name, results, 1, 2, patch=patch, layout=layout)
    _run("laga-ulysses-zigzag", results, 1, 2, patch=dict(cp_algo="ulysses", layout="zigzag"))
    for name, (patch, layout) in OPTIONS.items():
        _run(name, results, 1, 2, patch=patch, layout=layout)
    for name in ("laga-allgather", "laga-ulysses"):
        patch, layout = PATCHED[name]
        _run(f"{name}/rope-no-qlora", results, 1, 2, "rope-no-qlora", patch, layout)
    _run_eval("eval-laga-allgather", results, 2)
    _run("fallback-recompute", results, 1, 2, patch=dict(cp_algo="allgather"),
         **RECOMPUTE_CORE_ATTN)
    _run_expect_error("fallback-contiguous", results, 2,
                      dict(cp_algo="ulysses", layout="contiguous"), "contiguous",
                      **RECOMPUTE_CORE_ATTN)
    # Negative control: ulysses told "zigzag" but fed contiguous shards.
    _run("misdeclared-layout", results, 1, 2, patch=dict(cp_algo="ulysses", layout="zigzag"),
         layout="contiguous")


def _world_4(results):
    mc.init_parallel(cp=4)
    for name, (patch, layout) in PATCHED.items():
        _run(name, results, 1, 4, patch=patch, layout=layout)
    mc.init_parallel(tp=2, cp=1)  # DP=2, both replicas see the same batch
    _run("tp2-megatron", results, 2, 1)
    mc.init_parallel(tp=2, cp=2)
    for name in ("laga-allgather", "laga-ulysses"):
        patch, layout = PATCHED[name]
        _run(f"tp2/{name}", results, 2, 2, patch=patch, layout=layout)


# ----------------------------------------------------------------- packed (THD) and hybrid

def _run_packed(name, results, cp, docs, patch=None, padded_field=True):
    """Train the packed variant on THD batches (megatron's per-document CP split)."""
    import mindspeed_laga
    from mindspeed_laga import count_bytes
    tiny = VARIANTS["packed"]
    if patch is None:
        mindspeed_laga.unpatch_megatron_mla()
    else:
        mindspeed_laga.patch_megatron_mla(**patch)
    model = mc.build_tiny_mla_gpt(tiny, cp=cp)
    params = mc.packed_seq_params(DOCS[docs], padded_field=padded_field)
    with count_bytes() as counter:
        res = mc.train(model, mc.make_packed_batches(tiny, DOCS[docs], STEPS),
                       layout=functools.partial(mc.shard_thd, docs=DOCS[docs]),
                       packed_seq_params=params)
    results[name] = dict(losses=res.losses, grads=res.grads, bytes=counter.bytes(),
                         tags=sorted({r.tag for r in counter.records if r.kind != "handshake"}))


def _expect_error(name, results, fn, *args, **kwargs):
    try:
        fn(name, {}, *args, **kwargs)
    except ValueError as exc:
        results[name] = dict(error=str(exc))
    else:
        results[name] = dict(error=None)


def _mismatched_kv(docs):
    """packed_seq_params whose cu_seqlens_kv differ from cu_seqlens_q."""
    params = mc.packed_seq_params(docs)
    params.cu_seqlens_kv = torch.tensor([0, docs.total], dtype=torch.int32)
    return params


def _run_mismatched_kv(name, results, cp):
    import mindspeed_laga
    tiny = VARIANTS["packed"]
    mindspeed_laga.patch_megatron_mla(cp_algo="allgather")
    model = mc.build_tiny_mla_gpt(tiny, cp=cp)
    docs = DOCS["exact"]
    mc.train(model, mc.make_packed_batches(tiny, docs, 1),
             layout=functools.partial(mc.shard_thd, docs=docs),
             packed_seq_params=_mismatched_kv(docs))


PACKED = {  # name: (patch arguments, documents, cu_seqlens_*_padded given)
    "laga-allgather/padded": (dict(cp_algo="allgather"), "padded", True),
    "laga-allgather/exact": (dict(cp_algo="allgather"), "exact", False),
    "laga-ulysses/padded": (dict(cp_algo="ulysses"), "padded", True),
    "explicit-allgather/padded": (dict(form="explicit", cp_algo="allgather"), "padded", True),
    "laga-allgather+recompute/padded": (dict(cp_algo="allgather", recompute_kv=True,
                                             kv_block_size=8, trim_causal_prefix=True),
                                        "padded", True),
}
HYBRID = {  # CP=4, ulysses_degree=2, hybrid-zigzag batches
    "laga-hybrid": dict(cp_algo="hybrid", ulysses_degree=2),
    "explicit-hybrid": dict(form="explicit", cp_algo="hybrid", ulysses_degree=2),
    "laga-hybrid+recompute+overlap": dict(cp_algo="hybrid", ulysses_degree=2, recompute_kv=True,
                                          kv_block_size=8, overlap_latent_gather=True),
}


def _packed_world_1(results):
    mc.init_parallel(cp=1)
    for docs, padded_field in (("padded", True), ("exact", False)):
        _run_packed(f"reference/{docs}", results, 1, docs, padded_field=padded_field)
    _run("reference/yarn-qlora", results, 1, 1, "yarn-qlora")


def _packed_world_2(results):
    mc.init_parallel(cp=2)
    for name, (patch, docs, padded_field) in PACKED.items():
        _run_packed(name, results, 2, docs, patch, padded_field)
    # The same tokens unpacked (one sequence of 64): the bytes LAGA moves must not change.
    _run("unpacked/laga-allgather", results, 1, 2, "packed", dict(cp_algo="allgather"))
    _expect_error("mismatched-kv", results, _run_mismatched_kv, 2)
    _expect_error("packed-contiguous", results, _run_packed, 2, "padded",
                  dict(cp_algo="ulysses", layout="contiguous"))


def _packed_world_4(results):
    mc.init_parallel(cp=4)
    _run_packed("laga-allgather/padded", results, 4, "padded", dict(cp_algo="allgather"))
    _run_packed("laga-ulysses/padded", results, 4, "padded", dict(cp_algo="ulysses"))
    hybrid_batches = functools.partial(mc.shard_hybrid, ulysses_degree=2)
    for name, patch in HYBRID.items():
        _run(f"hybrid/{name}", results, 1, 4, patch=patch, layout=hybrid_batches)
    # Negative control: hybrid fed megatron's plain zigzag batches trains another model.
    _run("hybrid/plain-zigzag-batches", results, 1, 4,
         patch=dict(cp_algo="hybrid", ulysses_degree=2), layout="zigzag")
    _expect_error("hybrid/degree-3", results, _run, 1, 4,
                  patch=dict(cp_algo="hybrid", ulysses_degree=3), layout=hybrid_batches)
    _expect_error("hybrid/packed", results, _run_packed, 4, "padded",
                  dict(cp_algo="hybrid", ulysses_degree=2))
    _expect_error("hybrid/fallback", results, _run, 1, 4,
                  patch=dict(cp_algo="hybrid", ulysses_degree=2), layout=hybrid_batches,
                  **RECOMPUTE_CORE_ATTN)


WORLDS = {1: _world_1, 2: _world_2, 4: _world_4,
          "packed1": _packed_world_1, "packed2": _packed_world_2, "packed4": _packed_world_4}


def _worker(rank, size, world):
    warnings.filterwarnings("ignore", message=".*Apex.*")
    results = {}
    WORLDS[world](results)
    return results if rank == 0 else None


def _spawn(world, size=None):
    """One world's runs on ``size`` gloo ranks (bounded: a hang fails the fixture)."""
    size = world if size is None else size
    try:
        return run_on_ranks(_worker, size, world, timeout_s=600)[0]
    except WorkerError as exc:
        raise AssertionError(f"world {world} failed:\n{exc}") from exc


# ----------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def world1():
    return _spawn(1)


@pytest.fixture(scope="module")
def world2():
    return _spawn(2)


@pytest.fixture(scope="module")
def world4():
    return _spawn(4)


EXPECTED_TAGS = {"laga": {"latent"}, "explicit": {"key", "value"}}


def _assert_form_ran(run, name):
    """The collectives prove which path ran (a silent fallback would show none)."""
    form = name.split("-")[0]
    tags = set(run["tags"])
    assert EXPECTED_TAGS[form] <= tags, f"{name}: collectives {tags}"
    assert not (EXPECTED_TAGS["laga" if form == "explicit" else "explicit"] & tags)
    if "ulysses" in name:
        assert {"query", "output"} <= tags


# ----------------------------------------------------------------- tests: CP=1

def test_reference_is_not_degenerate(world1):
    """Every compared grad is far from zero and the steps change the loss well past LOSS_TOL,
    so matching them means something."""
    for variant in VARIANTS:
        assert_not_degenerate(world1[f"reference/{variant}"], variant)


def test_patch_at_cp1_is_megatrons_forward(world1):
    run, ref = world1["patched-cp1"], world1["reference/yarn-qlora"]
    assert run["losses"] == ref["losses"]  # the very same computation
    for name, grad in ref["grads"].items():
        assert torch.equal(run["grads"][name], grad), name
    assert run["tags"] == []


# ----------------------------------------------------------------- tests: CP=2, CP=4

def test_megatron_baseline_cp2_matches_cp1(world1, world2):
    """megatron's own unpatched MLA at CP=2 (CP baseline attention) = the CP=1 run."""
    assert_same_training(world2["baseline"], world1["reference/yarn-qlora"], "baseline CP=2")
    assert set(world2["baseline"]["tags"]) == set()  # megatron's own collectives, not ours


@pytest.mark.parametrize("name", list(PATCHED))
def test_patched_cp2_matches_cp1(world1, world2, name):
    assert_same_training(world2[name], world1["reference/yarn-qlora"], f"{name} CP=2")
    assert_same_training(world2[name], world2["baseline"], f"{name} vs megatron CP=2")
    _assert_form_ran(world2[name], name)


@pytest.mark.parametrize("name", list(PATCHED))
def test_patched_cp4_matches_cp1(world1, world4, name):
    assert_same_training(world4[name], world1["reference/yarn-qlora"], f"{name} CP=4")
    _assert_form_ran(world4[name], name)


def test_ulysses_on_megatron_zigzag_batches(world1, world2):
    run = world2["laga-ulysses-zigzag"]
    assert_same_training(run, world1["reference/yarn-qlora"], "ulysses on zigzag batches")
    _assert_form_ran(run, "laga-ulysses")


@pytest.mark.parametrize("name", list(OPTIONS))
def test_core_options_pass_through(world1, world2, name):
    """trim_causal_prefix, recompute_kv + kv_block_size, overlap_latent_gather: same training."""
    run = world2[name]
    assert_same_training(run, world1["reference/yarn-qlora"], name)
    _assert_form_ran(run, name.split("+")[0])


@pytest.mark.parametrize("name", ["laga-allgather", "laga-ulysses"])
def test_plain_rope_without_q_lora(world1, world2, name):
    run = world2[f"{name}/rope-no-qlora"]
    assert_same_training(run, world1["reference/rope-no-qlora"], f"{name}, rope, no q_lora")
    _assert_form_ran(run, name)


def test_eval_forward_takes_laga_path(world1, world2):
    run = world2["eval-laga-allgather"]
    assert abs(run["loss"] - world1["reference/yarn-qlora"]["losses"][0]) <= LOSS_TOL
    assert "latent" in run["tags"]


def test_uncovered_option_falls_back_to_megatron(world1, world2):
    """recompute of core_attn: the original forward runs (and says so once)."""
    run = world2["fallback-recompute"]
    assert_same_training(run, world1["reference/yarn-qlora"], "fallback")
    assert run["tags"] == []
    assert len(run["warnings"]) == 1 and "recompute of core_attn" in run["warnings"][0]


def test_fallback_refused_for_contiguous_batches(world2):
    """The original forward assumes zigzag: with contiguous batches it must not run."""
    error = world2["fallback-contiguous"]["error"]
    assert error is not None and "recompute of core_attn" in error and "zigzag" in error


def test_misdeclared_layout_is_caught(world1, world2):
    """Negative control: the comparisons above can fail."""
    run, ref = world2["misdeclared-layout"], world1["reference/yarn-qlora"]
    assert max(abs(a - b) for a, b in zip(run["losses"], ref["losses"])) > 100 * LOSS_TOL


# ----------------------------------------------------------------- tests: TP x CP

@pytest.mark.parametrize("name", ["laga-allgather", "laga-ulysses"])
def test_tp2_cp2_matches_megatron_tp2(world4, name):
    """TP=2 composes: each TP rank's core sees its own heads and kv_up_weight rows.

    Compared with megatron's own TP=2 run: megatron 0.16.1's local-spec MLA at
    TP=2 does not reproduce TP=1 grads by itself (see docs/MEGATRON.md).
    """
    assert_same_training(world4[f"tp2/{name}"], world4["tp2-megatron"], f"TP=2 x CP=2 {name}")
    _assert_form_ran(world4[f"tp2/{name}"], name)


# ----------------------------------------------------------------- steady state

def _assert_steady(run, name):
    """From the second step on, per layer call only LAGA's data collectives (one agreement
    exchange at most, on a step's first layer) and no host read (support/megatron_steady.py)."""
    algo = next((a for a in ("hybrid", "ulysses") if a in name), "allgather")
    problems = megatron_steady.check(run["steady"], run["layers"], STEPS, algo)
    assert run["steady"] and not problems, f"{name}: " + "\n".join(problems[:20])


STEADY_CP2 = [n for n in [*PATCHED, *OPTIONS] if n.startswith("laga")] + [
    "laga-ulysses-zigzag", "laga-allgather/rope-no-qlora", "laga-ulysses/rope-no-qlora"]


@pytest.mark.parametrize("name", STEADY_CP2)
def test_laga_steady_state_in_training_cp2(world2, name):
    _assert_steady(world2[name], name)


@pytest.mark.parametrize("name", [n for n in PATCHED if n.startswith("laga")])
def test_laga_steady_state_in_training_cp4(world4, name):
    _assert_steady(world4[name], name)


# ----------------------------------------------------------------- the CPU demo

def test_demo_script_trains_with_laga():
    """scripts/train_tiny_cpu.sh wires its flags to the patch: LAGA=1 ulysses on 2 ranks."""
    import os
    import re
    import subprocess
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, LAGA="1", NPROC="2", CP_ALGO="ulysses", PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(root / "scripts" / "train_tiny_cpu.sh"), "--steps", "2",
                           "--seq-length", "32"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CP=2 layout=contiguous" in proc.stdout and "cp_algo=ulysses" in proc.stdout
    steps = re.findall(r"step (\d): loss ([\d.]+)\s+bytes sent by rank 0's attention so far: (\d+)",
                       proc.stdout)
    assert [s[0] for s in steps] == ["1", "2"], proc.stdout
    losses, sent = [float(s[1]) for s in steps], [int(s[2]) for s in steps]
    assert losses[1] < losses[0]  # one batch, repeated: the loss falls
    assert 0 < sent[0] < sent[1]


# ----------------------------------------------------------------- packed (THD) sequences

@pytest.fixture(scope="module")
def packed1():
    return _spawn("packed1", 1)


@pytest.fixture(scope="module")
def packed2():
    return _spawn("packed2", 2)


@pytest.fixture(scope="module")
def packed4():
    return _spawn("packed4", 4)


def test_packed_reference_is_not_degenerate(packed1):
    """Megatron's own packed CP=1 runs: grads far from zero, the loss moves; padding changes
    the model (the padded documents are other documents), so the two references differ."""
    for docs in DOCS:
        assert_not_degenerate(packed1[f"reference/{docs}"], docs)
    assert abs(packed1["reference/padded"]["losses"][0]
               - packed1["reference/exact"]["losses"][0]) > 100 * LOSS_TOL


@pytest.mark.parametrize("name", list(PACKED))
def test_packed_cp2_matches_megatron_cp1(packed1, packed2, name):
    """THD at CP=2 (megatron's per-document split): the real tokens' loss and every grad
    equal megatron's own CP=1 run on the same (padded) documents."""
    docs = PACKED[name][1]
    assert_same_training(packed2[name], packed1[f"reference/{docs}"], f"packed {name} CP=2")
    _assert_form_ran(packed2[name], name.split("/")[0].split("+")[0])


@pytest.mark.parametrize("name", ["laga-allgather/padded", "laga-ulysses/padded"])
def test_packed_cp4_matches_megatron_cp1(packed1, packed4, name):
    assert_same_training(packed4[name], packed1["reference/padded"], f"packed {name} CP=4")
    _assert_form_ran(packed4[name], name.split("/")[0])


def test_packing_moves_the_same_bytes(packed2):
    """Documents change masks only: the collectives carry what the unpacked run carries."""
    unpacked = packed2["unpacked/laga-allgather"]["bytes"]
    assert unpacked > 0
    for name in ("laga-allgather/padded", "laga-allgather/exact"):
        assert packed2[name]["bytes"] == unpacked, name


def test_packed_errors_name_the_argument(packed2, packed4):
    """Raised on every rank before any collective (a hang would fail the fixture)."""
    error = packed2["mismatched-kv"]["error"]
    assert error is not None and "cu_seqlens_kv" in error and "cu_seqlens_q" in error
    error = packed2["packed-contiguous"]["error"]
    assert error is not None and "layout='contiguous'" in error and "THD" in error
    error = packed4["hybrid/packed"]["error"]
    assert error is not None and "cp_algo='hybrid'" in error and "THD" in error


# ----------------------------------------------------------------- hybrid CP

@pytest.mark.parametrize("name", list(HYBRID))
def test_hybrid_cp4_matches_cp1(packed1, packed4, name):
    """CP=4 as 2 Ulysses groups of 2 (hybrid-zigzag batches) = megatron's unpatched CP=1."""
    run = packed4[f"hybrid/{name}"]
    assert_same_training(run, packed1["reference/yarn-qlora"], f"hybrid {name}")
    _assert_form_ran(run, name.split("+")[0].replace("hybrid", "ulysses"))


@pytest.mark.parametrize("name", [n for n in HYBRID if n.startswith("laga")])
def test_laga_steady_state_in_training_hybrid(packed4, name):
    _assert_steady(packed4[f"hybrid/{name}"], f"hybrid/{name}")


def test_hybrid_on_plain_zigzag_batches_is_another_model(packed1, packed4):
    """Negative control: megatron's get_batch_on_this_cp_rank split is not hybrid's."""
    run, ref = packed4["hybrid/plain-zigzag-batches"], packed1["reference/yarn-qlora"]
    assert max(abs(a - b) for a, b in zip(run["losses"], ref["losses"])) > 100 * LOSS_TOL


def test_hybrid_errors_name_the_fix(packed4):
    error = packed4["hybrid/degree-3"]["error"]
    assert error is not None and "ulysses_degree=3" in error and "does not divide" in error
    error = packed4["hybrid/fallback"]["error"]
    assert error is not None and "recompute of core_attn" in error and "hybrid" in error
