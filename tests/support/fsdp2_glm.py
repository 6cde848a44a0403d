"""LAGA's GLM-5.2 forward for MindSpeed-LLM's FSDP2 backend against the host's *real*
``GlmMoeDsaAttention`` (``mindspeed_llm/fsdp2/models/glm52/``, release 26.1.0), on CPU.

A chain of three shrunk attention layers (GLM-5.2's dims where the fused ops need them:
latent 512, rope 64, index head 128; ``indexer_types`` full, shared, full), each one's
output the next one's hidden states, the picks of the first handed to the second as the
model's layer loop hands them. At CP 2 and 4 every rank runs :func:`laga_glm_dsa_forward`
on its tokens (the host's batch split: contiguous under ``cp_type: ulysses``, zigzag under
``ring``), at CP 1 the host's own forward runs the whole sequence; both forward and
backward in float64. The module keeps what the host keeps in float32 (its RMSNorm and
rope tables compute in float32), hence the tolerance.

The fused case turns on the GLM-5.2 recipe's ops (``use_sparse_flash_attn``,
``use_fused_lightning_indexer``, ``use_fused_lightning_indexer_loss`` with
``indexer_loss_coeff``) on the stand-ins of tests/support/fake_dsa_ops.py (float64
allowed). The host's forward runs its fused ops only on an NPU tensor: its reference is
its own forward and ``select_topk`` with that one device test read as true
(:func:`_host_fused_forward`); LAGA's forward reads its own test the same way
(``FUSED_DEVICE_TYPES``).

The host sources: :func:`sources` (the one place that finds them).
"""
from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import inspect
import os
import sys
import textwrap
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

RELEASE = "26.1.0"
HOST = "mindspeed_llm.fsdp2.models.glm52.modeling_glm_moe_dsa"
SEQ, BATCH, SEED = 40, 1, 1234
TOLERANCE = 2e-6
ATTENTION_STD = 0.1
LOSS_TOLERANCE = 2e-7  # the host tracks the loss in float32
CONFIG = dict(vocab_size=64, hidden_size=48, num_attention_heads=8, num_key_value_heads=8,
              q_lora_rank=32, kv_lora_rank=512, qk_nope_head_dim=16, qk_rope_head_dim=64,
              v_head_dim=16, index_n_heads=32, index_head_dim=128, index_topk=6,
              num_hidden_layers=3, index_topk_pattern="FSF", attention_dropout=0.0,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
FUSED = dict(use_sparse_flash_attn=True, use_fused_lightning_indexer=True,
             use_fused_lightning_indexer_loss=True)
STUBBED = ("torchair", "acl", "scipy", "transformer_engine", "apex")


def sources() -> dict:
    """{env var: source root} of the 26.1.0 pair: the glm52 model is in its MindSpeed-LLM
    archive (the FSDP2 overlay adds only the entry script, recipes and docs)."""
    from support.thirdparty import release_sources
    return release_sources(RELEASE)


def prepare(roots: dict) -> None:
    """Sources first on sys.path, the torch_npu stand-in (wide dtypes), stubs for the rest,
    a CPU answer to the accelerator probe the host's device mesh asks (idempotent)."""
    for key in ("MEGATRON_SRC", "MINDSPEED_SRC", "MINDSPEED_LLM_SRC"):
        if roots[key] not in sys.path:
            sys.path.insert(0, roots[key])
    os.environ["TRAINING_BACKEND"] = "none"
    from support import fake_dsa_ops, fake_torch_npu
    from support.mindspeed_llm_real import StubFinder
    npu = fake_torch_npu.install()
    if getattr(npu, "__spec__", None) is None:  # transformers probes it (no package: not NPU)
        npu.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    os.environ[fake_dsa_ops.WIDE_ENV] = "1"
    if not any(isinstance(f, StubFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, StubFinder(
            {r for r in STUBBED if importlib.util.find_spec(r) is None}))
    torch.accelerator.current_accelerator = lambda *a, **k: torch.device("cpu")


def set_host_args(cp_type: str, fused: bool, coeff: float = 0.5):
    """The flattened arguments ``train_fsdp2.py`` hands ``set_args``, the fields read here."""
    from mindspeed_llm.fsdp2.utils.global_vars import set_args
    flags = {name: fused for name in FUSED}
    set_args(SimpleNamespace(cp_type=cp_type, indexer_loss_coeff=coeff, pre_tokens=1048576,
                             next_tokens=0, use_fused_rmsnorm=False,
                             use_fused_rotary_pos_emb=False, **flags))


def build_layers():
    """The three attention layers, float64, the same weights on every rank."""
    host = importlib.import_module(HOST)
    from mindspeed_llm.fsdp2.models.glm52.configuration_glm_moe_dsa import GlmMoeDsaConfig
    config = GlmMoeDsaConfig(**CONFIG)
    torch.manual_seed(SEED)
    layers = [host.GlmMoeDsaAttention(config, i) for i in range(config.num_hidden_layers)]
    for layer in layers:
        for name, param in layer.named_parameters():  # away from the init's ones and zeros
            # the indexer's wide enough that its scores have no ties (its top-k is then
            # the same whatever the order of equal scores), the attention's logits mild
            # (the host's softmax runs in float32: large logits amplify its rounding)
            std = 0.3 if name.startswith("indexer.") else ATTENTION_STD
            torch.nn.init.normal_(param, std=std if param.dim() > 1 else 0.1)
            if param.dim() == 1:
                param.data.add_(1.0)
        layer.double().train()
    rope = host.GlmMoeDsaRotaryEmbedding(config)
    return config, layers, rope


def inputs(config, rope):
    """(hidden [b, S, h], (cos, sin) [b, S, d_r], grad of the last output [b, S, h])."""
    gen = torch.Generator().manual_seed(SEED + 1)
    hidden = torch.randn(BATCH, SEQ, config.hidden_size, generator=gen, dtype=torch.float64)
    grad_out = torch.randn(BATCH, SEQ, config.hidden_size, generator=gen, dtype=torch.float64)
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    return hidden, rope(hidden, positions), grad_out


def rank_rows(cp_type: str, size: int, rank: int) -> torch.Tensor:
    """The sequence positions the host's batch split gives ``rank`` (trainer.py)."""
    if cp_type == "ulysses":
        chunk = SEQ // size
        return torch.arange(rank * chunk, (rank + 1) * chunk)
    chunk = SEQ // (2 * size)
    chunks = (rank, 2 * size - 1 - rank)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in chunks])


def run_chain(layers, hidden, rope_rows, positions, grad_out, regions=None):
    """Forward through the layers (picks handed on as the model's loop hands them) and
    backward; returns outputs, the input's grad and each layer's tracked indexer loss
    (a tensor, read by the caller: no host read here). ``regions``: an object whose
    ``region(name)`` opens a counted block (one per layer call, one for the backward)."""
    from mindspeed_llm.fsdp2.models.common.indexer_loss import IndexerLossLoggingHelper
    region = regions.region if regions is not None else (lambda name: contextlib.nullcontext())
    x = hidden.detach().clone().requires_grad_(True)
    h, picks, losses, all_picks = x, None, [], []
    for i, layer in enumerate(layers):
        IndexerLossLoggingHelper.tracker.clear()
        with region(f"layer{i}"):
            h, _, picks = layer(h, rope_rows, None, position_ids=positions,
                                prev_topk_indices=picks)
        tracked = IndexerLossLoggingHelper.tracker.get("value")
        losses.append(None if tracked is None else tracked.detach().clone())
        all_picks.append(picks)
    with region("backward"):
        (h * grad_out).sum().backward()
    run_chain.picks = all_picks
    return h.detach(), x.grad, losses


def read_losses(losses):
    return [None if t is None else float(t.sum()) for t in losses]


def grads(layers) -> dict:
    return {f"{i}.{n}": (None if p.grad is None else p.grad.detach().clone())
            for i, layer in enumerate(layers) for n, p in layer.named_parameters()}


@contextlib.contextmanager
def _host_fused_forward(host):
    """The host's forward and ``select_topk`` with their NPU device test read as true (the
    stand-in ops run on CPU); nothing else of their source changes."""
    saved = {}
    tests = ((host.GlmMoeDsaAttention, "forward", 'q_states.device.type == "npu"'),
             (host.GlmMoeDsaIndexer, "select_topk", 'q.device.type == "npu"'))
    for owner, name, test in tests:
        source = textwrap.dedent(inspect.getsource(getattr(owner, name)))
        if source.count(test) != 1:
            raise RuntimeError(f"the host's {owner.__name__}.{name} no longer tests {test}")
        namespace = {}
        exec(compile(source.replace(test, "True"), host.__file__, "exec"), vars(host), namespace)
        saved[owner, name] = getattr(owner, name)
        setattr(owner, name, namespace[name])
    try:
        yield
    finally:
        for (owner, name), value in saved.items():
            setattr(owner, name, value)


def host_reference(roots, fused: bool, timeout_s=300.0) -> dict:
    """The host's own forward at CP 1 over the whole sequence, in a process of its own
    (the stand-ins and the host's modules stay out of the caller's)."""
    from mindspeed_laga.tools.spawn import run_on_ranks
    return run_on_ranks(_host_worker, 1, roots, fused, timeout_s=timeout_s)[0]


def _host_worker(rank, size, roots, fused):
    prepare(roots)
    host = importlib.import_module(HOST)
    set_host_args("ulysses", fused)  # read by nothing at CP 1 but the fused flags
    config, layers, rope = build_layers()
    hidden, (cos, sin), grad_out = inputs(config, rope)
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    with (_host_fused_forward(host) if fused else contextlib.nullcontext()), \
            watch_shapes() as shapes:
        out, dx, losses = run_chain(layers, hidden, (cos, sin), positions, grad_out)
    return dict(out=out, dx=dx, losses=read_losses(losses), grads=grads(layers),
                square=shapes.square(BATCH, SEQ), picks=run_chain.picks)


class watch_shapes(TorchDispatchMode):
    """Every op's output shapes while open: to show no ``[b, S, S]``-like tensor is made."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.shapes.append((str(func), tuple(t.shape)))
        return out

    def square(self, batch, seq):
        """The ops whose output has two dims of the whole sequence's length."""
        return [(f, s) for f, s in self.shapes if sum(d == seq for d in s) >= 2]


def _parallel_state(size: int):
    """The host's ParallelState over the spawned ranks: FSDP over all, CP over all."""
    from mindspeed_llm.fsdp2.distributed.parallel_state import ParallelState
    return ParallelState(fully_shard_parallel_size=size, tensor_parallel_size=1,
                         context_parallel_size=size, expert_parallel_size=1,
                         expert_fully_shard_parallel_size=size)


MICRO_BATCHES = 3  # counted on the last: every module past its first call


def worker(rank, size, roots, cp_type, fused, mutant=None):
    """One CP rank: LAGA's forward on the rank's rows, three micro-batches; the last one's
    results, its collectives and host reads per layer call, and its bytes per token."""
    prepare(roots)
    host = importlib.import_module(HOST)
    set_host_args(cp_type, fused)
    _parallel_state(size)
    from mindspeed_laga import count_bytes
    from mindspeed_laga.patches.fsdp2 import glm_dsa
    from mindspeed_llm.fsdp2.models.common.indexer_loss import IndexerLossAutoScaler
    from support.collectives import count_collectives
    from support.host_syncs import count_host_syncs
    if fused:
        glm_dsa.FUSED_DEVICE_TYPES = ("npu", "cpu")  # the stand-ins run on CPU
    if mutant is not None:
        MUTANTS[mutant](glm_dsa)
    host.GlmMoeDsaAttention.forward = glm_dsa.laga_glm_dsa_forward
    # each rank's loss is the mean over its queries; the grads summed over CP ranks then
    # make the CP 1 mean's (what averaging grads over CP does)
    IndexerLossAutoScaler.set_loss_scale(torch.tensor(1.0 / size))
    config, layers, rope = build_layers()
    hidden, (cos, sin), grad_out = inputs(config, rope)
    rows = rank_rows(cp_type, size, rank)
    local = (hidden[:, rows], (cos[:, rows], sin[:, rows]),
             rows.unsqueeze(0).expand(BATCH, -1), grad_out[:, rows])
    for _ in range(MICRO_BATCHES - 1):
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        run_chain(layers, *local)
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    per_layer = _PerLayerBytes(count_bytes)
    with count_host_syncs() as syncs, count_collectives(regions=syncs) as calls, \
            watch_shapes() as shapes:
        per_layer.regions = syncs
        out, dx, losses = run_chain(layers, *local[:3], local[3], regions=per_layer)
    regions = [f"layer{i}" for i in range(len(layers))] + ["backward"]
    return dict(rows=rows, out=out, dx=dx, losses=read_losses(losses), grads=grads(layers),
                picks=run_chain.picks,
                square=shapes.square(BATCH, SEQ),
                kinds={r: calls.kinds(region=r) for r in regions},
                syncs={r: syncs.total(region=r) for r in regions},
                values_per_token=per_layer.values_per_token(rows.numel() * BATCH))


class _PerLayerBytes:
    """``region(name)``: the host-sync region and, around each layer call, LAGA's byte
    counter (its forward all-gather's payload)."""

    def __init__(self, count_bytes):
        self.count_bytes, self.regions, self.payload = count_bytes, None, {}

    @contextlib.contextmanager
    def region(self, name):
        with self.regions.region(name), self.count_bytes() as counter:
            yield
        if name != "backward":
            self.payload[name] = counter.bytes(kind="all_gather")

    def values_per_token(self, tokens):
        return {name: payload / tokens / 8 for name, payload in self.payload.items()}  # float64


def _neighbour_keys(glm_dsa):
    """Mutant: each query scores the index key of its neighbour."""
    index_inputs = glm_dsa._index_inputs

    def mutant(*args, **kwargs):
        q, k, w = index_inputs(*args, **kwargs)
        return q, torch.roll(k, 1, dims=0), w
    glm_dsa._index_inputs = mutant


def _rope_offset(glm_dsa):
    """Mutant: the rope one position off."""
    mla_inputs = glm_dsa._mla_inputs

    def mutant(self, host, hidden_states, position_embeddings):
        cos, sin = (torch.roll(t, 1, dims=1) for t in position_embeddings)
        return mla_inputs(self, host, hidden_states, (cos, sin))
    glm_dsa._mla_inputs = mutant


def _dropped_loss_grad(glm_dsa):
    """Mutant: the index inputs built without a gradient (the loss trains nothing)."""
    index_inputs = glm_dsa._index_inputs

    def mutant(self, hidden_states, q_resid, position_embeddings, dtype, with_grad):
        return index_inputs(self, hidden_states, q_resid, position_embeddings, dtype, False)
    glm_dsa._index_inputs = mutant


MUTANTS = {"neighbour_keys": _neighbour_keys, "rope_offset": _rope_offset,
           "dropped_loss_grad": _dropped_loss_grad}


def run_laga(roots, cp_type, fused, size, mutant=None, timeout_s=300.0):
    from mindspeed_laga.tools.spawn import run_on_ranks
    return run_on_ranks(worker, size, roots, cp_type, fused, mutant, timeout_s=timeout_s)


def mismatches(ref, per_rank, size) -> list:
    """What differs from the host's CP 1 beyond the tolerance (empty: all agree)."""
    bad = []

    def close(name, got, want, tol):
        if (got is None) != (want is None):
            bad.append(f"{name}: {'None' if got is None else 'a grad'} vs the host's "
                       f"{'None' if want is None else 'grad'}")
        elif got is not None:
            err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
            if err > tol:
                bad.append(f"{name}: relative error {err:.3g}")

    out = torch.zeros_like(ref["out"])
    dx = torch.zeros_like(ref["dx"])
    for r in per_rank:
        out[:, r["rows"]] = r["out"]
        dx[:, r["rows"]] = r["dx"]
    close("output", out, ref["out"], TOLERANCE)
    close("input grad", dx, ref["dx"], TOLERANCE)
    for name, want in ref["grads"].items():
        parts = [r["grads"][name] for r in per_rank]
        got = None if any(p is None for p in parts) else sum(parts)
        close(f"grad {name}", got, want, TOLERANCE)
    for i, want in enumerate(ref["losses"]):
        got = [r["losses"][i] for r in per_rank]
        if (want is None) != any(g is None for g in got):
            bad.append(f"layer {i} indexer loss: {got} vs the host's {want}")
        elif want is not None and abs(sum(got) / size - want) > LOSS_TOLERANCE * abs(want):
            bad.append(f"layer {i} indexer loss: {sum(got) / size} vs the host's {want}")
    return bad



def plan_flags(cp_size: int = 2) -> list:
    """The flags after ``mindspeed-laga plan --backend fsdp2`` that ask the cost model about the
    layers measured here: ``--dsa glm-5.2`` at ``CONFIG``'s dims, ``SEQ`` and ``BATCH``."""
    dims = {"--heads": "num_attention_heads", "--qk-head-dim": "qk_nope_head_dim",
            "--qk-pos-emb-head-dim": "qk_rope_head_dim", "--v-head-dim": "v_head_dim",
            "--kv-lora-rank": "kv_lora_rank", "--hidden-size": "hidden_size",
            "--q-lora-rank": "q_lora_rank", "--index-heads": "index_n_heads",
            "--index-head-dim": "index_head_dim"}
    flags = ["--dsa", "glm-5.2", "--seq-len", str(SEQ), "--cp", str(cp_size),
             "--micro-batch", str(BATCH)]
    for flag, key in dims.items():
        flags += [flag, str(CONFIG[key])]
    return flags
