"""The cost model against measurements of the real forms, and its DeepSeek-V3 figures.

Measured on 2 and 4 gloo ranks at small shapes, every rank:
- collective bytes (payload and wire, forward and backward) equal the byte
  counter exactly, for every form and LAGA option x cp_algo x layout;
- activation bytes saved for backward (saved-tensor hooks, each storage once,
  kv_up_weight excluded) are within 5% of the model (they are in fact equal)
  for every variant, kernels eager and sdpa, float32 and bfloat16. The sdpa
  kernel runs the CPU flash op for any head dims (kernels/sdpa.py), which the
  model describes as ``fused``, at d_v != d_n + d_r and d_v == d_n + d_r;
- FLOPs equal ``FlopCounterMode``'s count of the matmuls the forms run
  (CPU flash SDPA has no FLOP formula: there only the rebuild is compared).
"""
import itertools

import pytest

from mindspeed_laga.tools import costmodel as cm
from mindspeed_laga.tools.costmodel import geometry
from mindspeed_laga.tools import equivalence as eq
from mindspeed_laga.tools.measure import worker
from mindspeed_laga.tools.runspec import RunSpec
from mindspeed_laga.kernels.registry import model_kind
from mindspeed_laga.tools.spawn import run_on_ranks
from mindspeed_laga.vocab.blocks import query_block_rows
from mindspeed_laga.vocab.names import LAYOUTS
from mindspeed_laga.vocab.segments import rank_segments
from mindspeed_laga.vocab.dims import ModelDims
from support.variants import CPU_KERNELS

# d_v != d_n + d_r (MLA-like: CPU SDPA takes its math path) and d_v == d_n + d_r (flash).
SHAPES = {
    "mla": eq.MLAShape(seq_len=32, batch=2, heads=8, qk_head_dim=16, rope_dim=8, v_head_dim=12,
                       kv_lora_rank=24),
    "flash": eq.MLAShape(seq_len=32, batch=1, heads=8, qk_head_dim=16, rope_dim=8, v_head_dim=24,
                         kv_lora_rank=24),
}
ALGO_LAYOUTS = (("allgather", "zigzag"), ("ulysses", "contiguous"), ("allgather", "contiguous"),
                ("ulysses", "zigzag"))
KERNELS = CPU_KERNELS  # the registry's CPU kernels (torch SDPA: the model's "sdpa" on CPU)


def kind(kernel: str) -> str:
    """The cost model's kind of a registry kernel on CPU (what each kernel declares): the
    model and the filters below ask the kind, never the registry name."""
    return model_kind(kernel, "cpu")
DTYPES = ("float32", "bfloat16")


def _variants():
    return [RunSpec("explicit", "explicit"), RunSpec("absorbed", "absorbed"),
            RunSpec("laga", "laga"), RunSpec("laga+trim", "laga", trim_causal_prefix=True),
            RunSpec("laga+recompute", "laga", recompute_kv=True),
            RunSpec("laga+blockwise", "laga", recompute_kv=True, kv_block_size=6),
            RunSpec("laga+blockwise+trim", "laga", trim_causal_prefix=True, recompute_kv=True,
                    kv_block_size=4)]


VARIANTS = {v.name: v for v in _variants()}


def _runs():
    runs = []
    for shape_name, (algo, lay), kernel, dtype, v in itertools.product(
            SHAPES, ALGO_LAYOUTS, KERNELS, DTYPES, VARIANTS.values()):
        if v.recompute_kv and kind(kernel) != cm.EAGER:  # the blockwise path has its own kernels
            continue
        # The flash shape is there for CPU SDPA's fused kernel: its default layouts suffice.
        if shape_name == "flash" and (kind(kernel) != cm.SDPA or (algo, lay) not in ALGO_LAYOUTS[:2]):
            continue
        runs.append(eq.Case(spec=v, cp_algo=algo, layout=lay, kernel=kernel, dtype=dtype,
                            shape=SHAPES[shape_name]))
    return runs


RUNS = _runs()


def model_config(case: eq.Case, cp_size: int) -> cm.Config:
    s = case.shape
    dims = ModelDims(s.heads, s.qk_head_dim, s.rope_dim, s.v_head_dim, s.kv_lora_rank)
    return cm.Config(dims, s.seq_len, s.batch, cp_size, 1, case.cp_algo, case.layout, case.dtype,
                     kind(case.kernel), case.causal)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda p: f"cp{p}")
def measured(request):
    """One spawn per CP size: every run once, with FLOPs counted."""
    return request.param, run_on_ranks(worker, request.param, RUNS, 1, 0, True)


def _each(measured):
    cp_size, per_rank = measured
    for i, case in enumerate(RUNS):
        cfg = model_config(case, cp_size)
        for rank in range(cp_size):
            yield case, rank, per_rank[rank][i], cm.form_cost(cfg, case.spec, rank)


def _counter_bytes(result, direction, measure):
    return sum(v[measure] for k, v in result["comm"].get(direction, {}).items() if k != "handshake")


def test_comm_bytes_equal_the_counter(measured):
    checked = 0
    for case, rank, got, model in _each(measured):
        for direction in ("forward", "backward"):
            for measure in ("payload", "wire"):
                assert model.comm_bytes(direction, measure) == _counter_bytes(got, direction, measure), \
                    (case.spec.name, case.label(), rank, direction, measure)
            assert model.comm_bytes(direction, "design") == got["design_bytes"][direction]
        checked += 1
    assert checked == len(RUNS) * measured[0]


def test_saved_activation_bytes_match_the_model(measured):
    for case, rank, got, model in _each(measured):
        assert got["saved_bytes"] > 0
        assert abs(got["saved_bytes"] - model.saved_bytes) <= 0.05 * got["saved_bytes"], (
            case.spec.name, case.label(), rank, got["saved_bytes"], model.saved_bytes,
            [(t.name, t.bytes) for t in model.saved], got["saved"])


def test_fused_kernel_is_measured_for_every_form(measured):
    """Every form's sdpa runs (each kernel of the model's kind "sdpa" on CPU), at both shapes,
    are modelled as the fused kernel and covered by the measurements above."""
    kinds = {(case.shape == SHAPES["flash"], case.form, model.kernel)
             for case, _, _, model in _each(measured) if kind(case.kernel) == cm.SDPA}
    assert {(f, form, "fused") for f in (True, False) for form in ("explicit", "absorbed", "laga")} <= kinds
    assert all(kind == "fused" for _, _, kind in kinds)


def test_flops_match_flop_counter(measured):
    for case, rank, got, model in _each(measured):
        f = model.flops
        rebuild = f["rebuild_fwd"] + f["rebuild_bwd"]
        if model.kernel in ("fused", "sdpa_flash"):  # no FLOP formula for the CPU flash op
            expected = rebuild
        else:
            expected = rebuild + f["attention_fwd"] + f["attention_bwd"]
        assert got["flops"]["total"] == expected, (case.spec.name, case.label(), rank,
                                                   got["flops"], f)


def test_model_segments_follow_layout_module():
    for lay, P in itertools.product(LAYOUTS, (1, 2, 4)):
        docs = (16, 48) if lay == "doc_zigzag" else None  # doc_zigzag cuts documents
        cfg = cm.Config(ModelDims(8, 16, 8, 16, 32), 64, 1, P, 1, "allgather", lay, doc_lens=docs)
        bounds = cfg.documents if docs else None
        for rank in range(P):
            got = [(q.length, q.start) for q in geometry.query_segments(cfg, rank)]
            want = [(n, g) for _, n, g in rank_segments(lay, P, rank, 64 // P, bounds)]
            assert got == want


# ---------------------------------------------------------------- closed forms

def _blockwise_pairs_by_loop(length, start, block, last, causal):
    """What laga_blockwise computes, pair by pair: for each key block [k0, k1), each query
    at position p (causal: p >= k0, the rows before the block are cut) against the keys
    of the block it may see (causal: k <= p is masked inside the rectangle, but the
    rectangle runs to the segment's last position)."""
    pairs = 0
    size = block or last
    for k0 in range(0, last, size):
        k1 = min(k0 + size, last)
        rows = [p for p in range(start, start + length) if not causal or p >= k0]
        cols = [k for k in range(k0, k1) if not causal or k < start + length]
        pairs += len(rows) * len(cols)
    return pairs


def test_blockwise_pairs_closed_form_equals_the_loop():
    checked = 0
    for length, start, block, extra, causal in itertools.product(
            (1, 2, 3, 5, 8), (0, 1, 4, 7, 9), (None, 1, 2, 3, 4, 6, 16), (0, 1, 5), (True, False)):
        last = start + length + extra  # the keys rebuilt reach at least the segment's end
        want = _blockwise_pairs_by_loop(length, start, block, last, causal)
        assert geometry.blockwise_pairs(length, start, block, last, causal) == want, \
            (length, start, block, last, causal)
        checked += 1
    assert checked == 5 * 5 * 7 * 3 * 2


def test_visible_pairs_closed_form_equals_the_loop():
    for length, start, total in itertools.product((1, 3, 8), (0, 2, 5), (16, 20)):
        want = sum(p + 1 for p in range(start, start + length))  # query p sees keys 0..p
        assert geometry.segment_visible_pairs(length, start, True, total) == want
        assert geometry.segment_visible_pairs(length, start, False, total) == length * total


def test_model_is_constant_time_in_sequence_length():
    """S = 2^31 with one-key blocks: a loop over blocks would run ~2^31 times per rank."""
    import time
    cfg = cm.Config(cm.preset("deepseek-v3"), seq_len=2 ** 31, cp_size=8, cp_algo="allgather")
    spec = RunSpec("laga+blockwise+trim", "laga", trim_causal_prefix=True, recompute_kv=True,
                   kv_block_size=1)
    start = time.perf_counter()
    s = cm.summarize(cfg, spec)
    assert time.perf_counter() - start < 1.0
    # One-key blocks: every visible pair, nothing masked, is computed. Rank 0 (zigzag)
    # holds positions [0, c) and [15c, 16c), c = S/16: c(c+1)/2 + (c*15c + c(c+1)/2) pairs.
    c = 2 ** 31 // 16
    pairs = c * (c + 1) // 2 + c * 15 * c + c * (c + 1) // 2
    h, qk, v = 128, 192, 128
    assert s.rank0.flops["attention_fwd"] == 2 * h * pairs * (qk + v)


# ---------------------------------------------------------------- DeepSeek-V3 scale
# Figures derived by hand from DeepSeek-V3's config.json: n=128 heads, d_n=128,
# d_r=64, d_v=128, d_c=512; S=16384 over CP=8 (s=2048 tokens a rank), bf16 (2 bytes).

V3 = cm.preset("deepseek-v3")


def v3(algo, kernel="fused", **kw):
    return cm.Config(V3, seq_len=16384, micro_batch=1, cp_size=8, cp_algo=algo, dtype="bfloat16",
                     kernel=kernel, **kw)


def summary(cfg, name, **kw):
    form = name.split("+")[0]
    return cm.rank_summary(cfg, RunSpec(name, form, **kw))


def comm(s, measure="design"):
    return s["comm"]["forward"][measure] + s["comm"]["backward"][measure]


def test_v3_comm_bytes_by_hand():
    # Per token: explicit all-gathers K and V of every head, 128 * (192 + 128) = 40,960
    # values; LAGA all-gathers the latent, 512 + 64 = 576 values. Per direction a rank
    # hands 2048 tokens x 2 bytes to the collective; DESIGN counts 7/8 of it.
    ex, la = summary(v3("allgather"), "explicit"), summary(v3("allgather"), "laga")
    assert ex["comm"]["forward"]["payload"] == 40_960 * 2048 * 2 == 167_772_160
    assert la["comm"]["forward"]["payload"] == 576 * 2048 * 2 == 2_359_296
    assert comm(ex) == 2 * 167_772_160 * 7 / 8
    assert comm(la) == 2 * 2_359_296 * 7 / 8
    assert comm(ex) / comm(la) == pytest.approx(40_960 / 576)  # 71.1x
    # A ring all-gather sends its shard to 7 peers: 7 x the payload on the wire.
    assert la["comm"]["forward"]["wire"] == 7 * 2_359_296
    # Ulysses: explicit moves q, K (192 each), V, O (128 each) per head by all-to-all:
    # 128 * 640 = 81,920 values; LAGA q and O (40,960) by all-to-all plus the latent (576).
    ul_ex, ul_la = summary(v3("ulysses"), "explicit"), summary(v3("ulysses"), "laga")
    assert comm(ul_ex) == 2 * 81_920 * 2048 * 2 * 7 / 8
    assert comm(ul_la) == 2 * (40_960 + 576) * 2048 * 2 * 7 / 8
    # On the wire the all-to-all sends 7/8 of its input, the all-gather 7 shards.
    assert comm(ul_la, "wire") == 2 * (40_960 * 2048 * 2 * 7 // 8 + 7 * 576 * 2048 * 2)


def test_v3_ulysses_memory_laga_near_explicit_absorbed_above():
    for kernel in ("eager", "fused"):
        cfg = v3("ulysses", kernel)
        ex, ab, la = (summary(cfg, n)["saved_bytes"]["worst"] for n in ("explicit", "absorbed", "laga"))
        assert ab > ex, kernel
        assert la > ex
    eager = [summary(v3("ulysses", "eager"), n)["saved_bytes"]["worst"] for n in ("explicit", "laga")]
    assert eager[1] / eager[0] < 1.01  # the score matrix dominates both
    # Fused: LAGA keeps exactly what explicit keeps, plus the gathered latent (the input
    # of the rebuild, 16384 x 576 bf16), minus the local latent (the input of explicit's
    # up-projection, 2048 x 512 bf16).
    cfg = v3("ulysses")
    ex = cm.form_cost(cfg, RunSpec("explicit", "explicit"))
    la = cm.form_cost(cfg, RunSpec("laga", "laga"))
    assert la.saved_bytes - ex.saved_bytes == 16384 * 576 * 2 - 2048 * 512 * 2 == 16_777_216
    assert la.saved_bytes / ex.saved_bytes < 1.06


def test_v3_allgather_trade_offs():
    cfg = v3("allgather")
    ex, ab, la = (summary(cfg, n) for n in ("explicit", "absorbed", "laga"))
    assert ab["saved_bytes"]["worst"] < ex["saved_bytes"]["worst"] < la["saved_bytes"]["worst"]
    # Absorbed attends with 576-wide keys and 512-wide values instead of 192 and 128.
    ratio = ab["flops"]["attention_fwd"]["worst"] / ex["flops"]["attention_fwd"]["worst"]
    assert ratio == pytest.approx((576 + 512) / (192 + 128)) == 3.4
    # Explicit up-projects its 2048 tokens, LAGA all 16384 keys: 8 times the work.
    assert la["flops"]["rebuild_fwd"]["worst"] == 8 * ex["flops"]["rebuild_fwd"]["worst"]
    # 2 * tokens * d_c * n * (d_n + d_v) multiply-adds for explicit's up-projection.
    assert ex["flops"]["rebuild_fwd"]["worst"] == 2 * 2048 * 512 * 128 * 256
    ul = [summary(v3("ulysses"), n)["flops"]["rebuild_fwd"]["worst"] for n in ("explicit", "laga")]
    assert ul[0] == ul[1]  # ulysses: 16384 keys x 16 heads = 2048 tokens x 128 heads


def test_v3_prefix_trimming_helps_the_average_not_rank_0():
    cfg = v3("allgather")
    la = summary(cfg, "laga")
    tr = summary(cfg, "laga+trim", trim_causal_prefix=True)
    assert tr["flops"]["rebuild_fwd"]["average"] < la["flops"]["rebuild_fwd"]["average"]
    assert tr["flops"]["rebuild_fwd"]["worst"] == la["flops"]["rebuild_fwd"]["worst"]
    # zigzag rank r rebuilds keys [0, (2P-r)*S/(2P)); rank 0 sees everything.
    for r in range(8):
        assert geometry.visible_keys(cfg, r) == (16 - r) * 16384 // 16


def test_v3_blockwise_recompute_below_explicit_and_absorbed():
    for algo, ceiling in (("allgather", 0.2), ("ulysses", 0.6)):
        cfg = v3(algo)
        ex, ab, la = (summary(cfg, n) for n in ("explicit", "absorbed", "laga"))
        bw = summary(cfg, "laga+blockwise", recompute_kv=True, kv_block_size=2048)
        assert bw["saved_bytes"]["worst"] <= ceiling * ex["saved_bytes"]["worst"], algo
        assert bw["saved_bytes"]["worst"] < ab["saved_bytes"]["worst"], algo
        # What it costs: the rebuild runs again in backward (4 rebuilds' worth instead of 3),
        # and each row block rebuilds the keys it sees. allgather: a rank's two segments of
        # c = S/16 queries (rows per block 2 x 2048 >= c: one block each) see (r+1)c and
        # (16-r)c keys, 17c in all against LAGA's 16c; ulysses (contiguous): the 8 ranks'
        # tokens follow one another, 16384 queries in 4 row blocks of 4096 that see 4096,
        # 8192, 12288 and 16384 keys: 40960 against 16384.
        rebuild = {k: s["flops"]["rebuild_fwd"]["worst"] + s["flops"]["rebuild_bwd"]["worst"]
                   for k, s in (("laga", la), ("blockwise", bw))}
        keys = {"allgather": (17, 16), "ulysses": (40960, 16384)}[algo]
        assert rebuild["blockwise"] * 3 * keys[1] == rebuild["laga"] * 4 * keys[0], algo


def test_time_estimate_is_typed_and_adds_up():
    cfg = v3("allgather")
    machine = cm.MACHINES["910b-intra-node"]
    plain = cm.estimate_seconds(cfg, cm.summarize(cfg, RunSpec("laga", "laga")), machine)
    over = cm.estimate_seconds(cfg, cm.summarize(cfg, RunSpec("laga+overlap", "laga", overlap=True)),
                               machine)
    # The latent's wire bytes: 7 shards of 2048 x 576 bf16, forward and backward, at 196 GB/s.
    assert plain.comm_s == pytest.approx(2 * 7 * 2048 * 576 * 2 / 196e9)
    assert plain.hidden_s == 0 and over.hidden_s > 0
    assert over.total_s == pytest.approx(plain.total_s - over.hidden_s)


def test_model_rejects_bad_configs():
    good = v3("ulysses")
    for bad, word in ((cm.with_(good, seq_len=16383), "divisible"),
                      (cm.with_(good, cp_size=256), "heads"),
                      (cm.with_(good, tp_size=3), "TP"),
                      (cm.with_(good, micro_batch=-1), "micro_batch"),
                      (cm.with_(good, kernel="magic"), "kernel")):
        with pytest.raises(ValueError, match=word):
            cm.validate(bad)
    with pytest.raises(ValueError, match="unknown preset"):
        cm.preset("deepseek-v9")
    with pytest.raises(ValueError, match="kv_block_size"):
        RunSpec("laga+blockwise", "laga", recompute_kv=True, kv_block_size=0)


def test_one_record_of_a_variant_for_model_and_runs():
    """A case built from a RunSpec and one built from laga_attention keywords agree."""
    spec = RunSpec("laga+all", "laga", trim_causal_prefix=True, recompute_kv=True, kv_block_size=8,
                   overlap=True)
    case = eq.Case(spec=spec, cp_algo="ulysses", layout="contiguous")
    assert case.form == "laga"
    assert case.options == (("trim_causal_prefix", True), ("recompute_kv", True), ("kv_block_size", 8),
                            ("overlap", True))
    again = eq.Case(form="laga", options=case.options).spec
    assert (again.options(), again.overlap) == ({"trim_causal_prefix": True, "recompute_kv": True,
                                                 "kv_block_size": 8}, True)
    with pytest.raises(ValueError, match="unknown"):
        eq.Case(form="laga", options=(("latent_gather", True),))
    with pytest.raises(ValueError, match="form"):
        RunSpec("x", "mla")


# ---------------------------------------------------------------- documents
# The model's pair counts against counts taken from a (query, key) mask built here
# from document ids and positions; the segment and run structure is read off the
# chunks the layout module gives each rank, not from the model.

import torch  # noqa: E402

DOC_CASES = (  # (doc lens, cp, cp_algo, layout, causal)
    ((16, 4, 12), 2, "allgather", "zigzag", True),
    ((16, 4, 12), 2, "allgather", "contiguous", False),
    ((8, 16, 8), 2, "allgather", "doc_zigzag", True),
    ((8, 16, 8), 2, "ulysses", "doc_zigzag", True),
    ((5, 11, 7, 9), 4, "ulysses", "contiguous", True),
    ((5, 11, 7, 9), 4, "allgather", "zigzag", False),
    ((32,), 4, "allgather", "zigzag", True),
    ((3,) * 10 + (2,), 1, "allgather", "zigzag", True),
)
BLOCKS = (None, 1, 3, 5, 8)


def _doc_config(lens, cp, algo, lay, causal):
    return cm.Config(ModelDims(4, 8, 4, 8, 16), sum(lens), 1, cp, 1, algo, lay, "float32", "eager",
                     causal, doc_lens=tuple(lens))


def _mask(lens, causal):
    doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    pos = torch.arange(sum(lens))
    keep = doc[:, None] == doc[None, :]
    return keep & (pos[None, :] <= pos[:, None]) if causal else keep


def _query_segments(cfg, rank):
    """Position lists of the kernel's query segments at a rank (the layout's chunks, in
    the order the kernel sees them; ulysses: every rank's)."""
    docs = cfg.documents if cfg.seq_layout == "doc_zigzag" else None
    ranks = range(cfg.cp_size) if cfg.heads_split else [rank]
    return [list(range(g, g + n)) for r in ranks
            for _, n, g in rank_segments(cfg.seq_layout, cfg.cp_size, r, cfg.local_len, docs)]


def _joined_segments(cfg, rank):
    """The segments the blockwise walk cuts row blocks from: one that continues the
    previous one's positions is joined to it."""
    out = []
    for seg in _query_segments(cfg, rank):
        if out and out[-1][-1] + 1 == seg[0]:
            out[-1] = out[-1] + seg
        else:
            out.append(list(seg))
    return out


def _query_positions(cfg, rank):
    return [p for seg in _query_segments(cfg, rank) for p in seg]


def _cut(seg, doc_of):
    """A segment cut where the document changes: the blockwise path's runs."""
    runs = []
    for p in seg:
        if runs and doc_of[p] == doc_of[runs[-1][-1]]:
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


def _pairs_from_mask(cfg, rank, spec):
    keep = _mask(cfg.doc_lens, cfg.causal)
    doc_of = torch.repeat_interleave(torch.arange(len(cfg.doc_lens)), torch.tensor(cfg.doc_lens)).tolist()
    qpos = _query_positions(cfg, rank)
    visible = int(keep[qpos].sum())
    if not spec.recompute_kv:
        # one kernel call per segment, over the span of keys its queries see
        executed = 0
        for seg in _query_segments(cfg, rank):
            cols = keep[seg].any(0).nonzero().flatten()
            executed += len(seg) * int(cols.max() - cols.min() + 1)
        return executed, visible
    # blockwise: blocks tile the key index (trimmed: the keys some query sees, in order);
    # per block and run, the rows that see a key of the block times the span of keys seen
    keys = keep[qpos].any(0).nonzero().flatten().tolist() if spec.trim_causal_prefix \
        else list(range(cfg.seq_len))
    size = spec.kv_block_size or len(keys)
    rows = query_block_rows(spec.kv_block_size)  # a segment's queries in row blocks
    row_blocks = [seg[i:i + (rows or len(seg))] for seg in _joined_segments(cfg, rank)
                  for i in range(0, len(seg), rows or len(seg))]
    executed = 0
    for k0 in range(0, len(keys), size):
        block = keys[k0:k0 + size]
        for run in (r for chunk in row_blocks for r in _cut(chunk, doc_of)):
            sub = keep[run][:, block]
            rows, cols = sub.any(1).nonzero().flatten(), sub.any(0).nonzero().flatten()
            if len(rows):
                executed += len(rows) * int(cols.max() - cols.min() + 1)
    return executed, visible


def _rebuilds_from_mask(cfg, rank, spec):
    """Keys the blockwise walk rebuilds: per (row block, key block), the span of the
    block's keys that some row of the row block sees."""
    keep = _mask(cfg.doc_lens, cfg.causal)
    qpos = _query_positions(cfg, rank)
    keys = keep[qpos].any(0).nonzero().flatten().tolist() if spec.trim_causal_prefix \
        else list(range(cfg.seq_len))
    size = spec.kv_block_size or len(keys)
    rows = query_block_rows(spec.kv_block_size)
    total = 0
    for seg in _joined_segments(cfg, rank):
        for i in range(0, len(seg), rows or len(seg)):
            for k0 in range(0, len(keys), size):
                cols = keep[seg[i:i + (rows or len(seg))]][:, keys[k0:k0 + size]].any(0).nonzero()
                if len(cols):
                    total += int(cols.max() - cols.min() + 1)
    return total


def test_document_pair_counts_equal_counts_over_the_mask():
    checked = 0
    for (lens, cp, algo, lay, causal), block, trim in itertools.product(DOC_CASES, BLOCKS, (False, True)):
        cfg = _doc_config(lens, cp, algo, lay, causal)
        cm.validate(cfg)
        specs = [RunSpec("b", "laga", trim_causal_prefix=trim, recompute_kv=True, kv_block_size=block)]
        if block is None:
            specs.append(RunSpec("l", "laga", trim_causal_prefix=trim))
        for spec, rank in itertools.product(specs, range(cp)):
            want = _pairs_from_mask(cfg, rank, spec)
            got = geometry.attention_pairs(cfg, rank, spec)
            assert (got.executed, got.visible) == want, (lens, cp, algo, lay, causal, spec, rank)
            if spec.recompute_kv:
                assert geometry.blockwise_rebuilds(cfg, rank, spec) == _rebuilds_from_mask(cfg, rank, spec), \
                    (lens, cp, algo, lay, causal, spec, rank)
            if trim:  # what trimming rebuilds: the keys some query sees
                keep = _mask(lens, causal)[_query_positions(cfg, rank)]
                assert geometry.rebuilt_keys(cfg, rank, spec) == int(keep.any(0).sum())
            checked += 1
    assert checked == 21 * 6 * 2  # rank-cases x (5 blockwise + 1 plain) x trim


def test_sixteen_equal_documents_cut_causal_attention_work_sixteen_fold():
    one = cm.Config(cm.preset("deepseek-v3"), seq_len=2 ** 16, cp_size=8, cp_algo="allgather")
    docs = cm.with_(one, doc_lens=(2 ** 12,) * 16)
    spec = RunSpec("laga+blockwise", "laga", recompute_kv=True, kv_block_size=256)
    a, b = cm.summarize(one, spec), cm.summarize(docs, spec)
    ratio = b.flops_average["attention_fwd"] / a.flops_average["attention_fwd"]
    assert 1 / 16 <= ratio < 1.1 / 16
    # visible pairs: S(S+1)/2 without documents, 16 x s(s+1)/2 with them (s = S/16), over the group
    S, s = 2 ** 16, 2 ** 12
    assert sum(geometry.attention_pairs(docs, r, spec).visible for r in range(8)) == 16 * s * (s + 1) // 2
    assert sum(geometry.attention_pairs(one, r, spec).visible for r in range(8)) == S * (S + 1) // 2
    # collective bytes do not depend on documents
    assert b.rank0.comm == a.rank0.comm


def test_documents_keep_the_model_fast():
    import time
    cfg = cm.Config(cm.preset("deepseek-v3"), seq_len=2 ** 31, cp_size=8, cp_algo="ulysses",
                    doc_lens=(2 ** 31 // 64,) * 64)
    start = time.perf_counter()
    for spec in (RunSpec("laga+blockwise+trim", "laga", trim_causal_prefix=True, recompute_kv=True,
                         kv_block_size=1), RunSpec("laga", "laga")):
        cm.summarize(cfg, spec)
    assert time.perf_counter() - start < 1.0


def test_doc_lens_are_checked():
    cfg = _doc_config((16, 16), 2, "allgather", "zigzag", True)
    for lens, word in (((16, 15), "sum to 31"), ((16, 0, 16), "positive"), ((10, 22), None)):
        bad = cm.with_(cfg, doc_lens=lens)
        if word is None:  # doc_zigzag needs every document divisible by 2*CP
            with pytest.raises(ValueError, match="divisible by 4"):
                cm.validate(cm.with_(bad, layout="doc_zigzag"))
            continue
        with pytest.raises(ValueError, match=word):
            cm.validate(bad)
    with pytest.raises(ValueError, match="--doc-lens or --num-docs"):
        cm.validate(cm.with_(cfg, doc_lens=None, layout="doc_zigzag"))
    assert cm.doc_lens_for(32, num_docs=4) == (8,) * 4
    with pytest.raises(ValueError, match="divide"):
        cm.doc_lens_for(32, num_docs=5)


DOC_SHAPE = eq.MLAShape(seq_len=32, batch=1, heads=4, qk_head_dim=8, rope_dim=4, v_head_dim=6,
                        kv_lora_rank=12)
DOC_RUNS = [eq.Case(spec=v, cp_algo=algo, layout=lay, kernel=kernel, dtype=dtype, shape=DOC_SHAPE,
                    cu_seqlens=bounds)
            for (algo, lay, bounds), kernel, dtype, v in itertools.product(
                (("allgather", "zigzag", (0, 12, 16, 32)), ("ulysses", "doc_zigzag", (0, 8, 24, 32))),
                KERNELS, DTYPES, VARIANTS.values())
            if not (v.recompute_kv and kind(kernel) != cm.EAGER)]


@pytest.fixture(scope="module")
def measured_documents():
    return run_on_ranks(worker, 2, DOC_RUNS, 1, 0, True)


def test_documents_measured_flops_bytes_and_saved_equal_the_model(measured_documents):
    """Every form and option with packed documents on 2 ranks: FlopCounterMode's count,
    the saved bytes and the byte counter against the model; the bytes also equal the
    model's without documents (documents change no collective)."""
    for i, case in enumerate(DOC_RUNS):
        lens = tuple(b - a for a, b in zip(case.cu_seqlens[:-1], case.cu_seqlens[1:]))
        cfg = cm.with_(model_config(case, 2), doc_lens=lens)
        plain = model_config(case, 2) if case.layout != "doc_zigzag" else \
            cm.with_(model_config(case, 2), layout="zigzag")
        for rank in range(2):
            got, model = measured_documents[rank][i], cm.form_cost(cfg, case.spec, rank)
            f = model.flops
            expected = f["rebuild_fwd"] + f["rebuild_bwd"]
            if model.kernel not in ("fused", "sdpa_flash"):
                expected += f["attention_fwd"] + f["attention_bwd"]
            assert got["flops"]["total"] == expected, (case.label(), rank, got["flops"], f)
            assert got["saved_bytes"] == model.saved_bytes, (
                case.label(), rank, [(t.name, t.bytes) for t in model.saved], got["saved"])
            for direction in ("forward", "backward"):
                for measure in ("payload", "wire"):
                    counted = _counter_bytes(got, direction, measure)
                    assert model.comm_bytes(direction, measure) == counted
                    assert cm.form_cost(plain, case.spec, rank).comm_bytes(direction, measure) == counted


# ---------------------------------------------------------------- peak memory

def test_peak_is_saved_plus_output_plus_the_largest_transient():
    for algo, kernel, name in itertools.product(("allgather", "ulysses"), ("eager", "fused"), VARIANTS):
        cfg = v3(algo, kernel)
        cost = cm.form_cost(cfg, VARIANTS[name])
        terms = {t.name: t.bytes for t in cost.peak}
        # the inputs' storages; and allgather's blockwise output, which is the caller's output
        shared = ("attn_out",) if VARIANTS[name].recompute_kv and algo == "allgather" else ()
        inputs = sum(t.bytes for t in cost.saved if t.name in ("query", "kv_latent") + shared)
        assert terms["saved"] == cost.saved_bytes - inputs and len(terms) == 3, (algo, kernel, name)
        # the output: 2048 tokens x 128 heads x d_v 128, bf16
        assert terms["output"] == 2048 * 128 * 128 * 2
        transient = next(t for t in cost.peak if t.name not in ("saved", "output"))
        want = ("blockwise_buffers",) if VARIANTS[name].recompute_kv else \
            ("kernel_workspace", "backward_buffers")
        assert transient.name in want and transient.bytes > 0
    # eager, ulysses, explicit: the largest segment is the last rank's 2048 queries against
    # all 16384 keys, 16 heads, float32 scores (bf16 inputs) and masked scores: 4 GiB; the
    # backward buffers add the kernel's dq (16384 x 16 x 192) and the all-to-all'd K/V grads
    # (16384 x 16 x 320), bf16
    cost = cm.form_cost(v3("ulysses", "eager"), VARIANTS["explicit"])
    transient = {t.name: t.bytes for t in cost.peak}["backward_buffers"]
    assert transient == 2 * 16 * 2048 * 16384 * 4 + 16384 * 16 * (192 + 320) * 2
    # the blockwise path's peak falls with the block size
    big, small = (cm.form_cost(v3("allgather"), RunSpec("b", "laga", recompute_kv=True, kv_block_size=k))
                  for k in (None, 1024))
    assert small.peak_bytes < big.peak_bytes and small.saved_bytes == big.saved_bytes


def test_peak_check_on_cpu_gives_the_prediction_and_a_measurement():
    from mindspeed_laga.tools.measure import peak_check, predicted_peak
    case = eq.Case(spec=VARIANTS["laga+blockwise"], kernel="eager", shape=SHAPES["mla"],
                   cu_seqlens=None)
    predicted, measured = peak_check(case, "cpu")
    assert measured > 0  # the CPU allocator's peak (test_cpu_peak.py)
    cfg = model_config(case, 1)
    assert predicted == cm.form_cost(cfg, case.spec).peak_bytes == sum(t.bytes for t in predicted_peak(case))


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_peak_prediction_against_cuda():
    """The prediction beside max_memory_allocated on one CUDA device, no CP, at a size where
    allocator rounding is small: within a factor of 2 either way (an estimate)."""
    from mindspeed_laga.tools.measure import peak_check
    shape = eq.MLAShape(seq_len=2048, batch=1, heads=16, qk_head_dim=128, rope_dim=64, v_head_dim=128,
                        kv_lora_rank=512)
    for name, kernel in (("explicit", "sdpa"), ("laga", "sdpa"), ("laga+blockwise", "auto")):
        case = eq.Case(spec=VARIANTS[name] if name != "laga+blockwise" else
                       RunSpec(name, "laga", recompute_kv=True, kv_block_size=512),
                       kernel=kernel, dtype="bfloat16", shape=shape)
        predicted, measured = peak_check(case, "cuda")
        assert 0.5 <= measured / predicted <= 2.0, (name, predicted, measured)


class _OneDocument:
    """A config without documents, seen by the mask helpers as one document of S tokens."""

    def __init__(self, cfg):
        self._cfg = cfg

    def __getattr__(self, name):
        return (self._cfg.seq_len,) if name == "doc_lens" else getattr(self._cfg, name)


def test_blockwise_counts_without_documents_equal_counts_over_the_mask():
    """Row blocks of many tiles (one-key blocks: rows of 2) summed in closed form per family."""
    for (cp, algo, lay, causal), block, trim in itertools.product(
            ((2, "allgather", "zigzag", True), (4, "ulysses", "contiguous", True),
             (2, "allgather", "contiguous", False), (4, "allgather", "zigzag", True)),
            BLOCKS, (False, True)):
        cfg = cm.Config(ModelDims(4, 8, 4, 8, 16), 56, 1, cp, 1, algo, lay, "float32", "eager", causal)
        spec = RunSpec("b", "laga", trim_causal_prefix=trim, recompute_kv=True, kv_block_size=block)
        for rank in range(cp):
            got = geometry.attention_pairs(cfg, rank, spec)
            assert (got.executed, got.visible) == _pairs_from_mask(_OneDocument(cfg), rank, spec)
            assert geometry.blockwise_rebuilds(cfg, rank, spec) == \
                _rebuilds_from_mask(_OneDocument(cfg), rank, spec), (cp, algo, lay, causal, block, trim)
