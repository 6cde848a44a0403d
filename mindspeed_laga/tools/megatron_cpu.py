"""Real megatron-core (0.16.1 to 0.19.2) MLA on CPU: shims, a tiny MLA GPTModel, a CP baseline,
a trainer.

Imported by the CPU demo scripts/train_tiny_cpu.py and by the end-to-end tests
(tests/megatron); it ships with the package's tooling, so the demo needs no checkout
of the tests. Nothing in site-packages is edited: every gap of
docs/HOSTS.md, section 'megatron-core on CPU', is bridged by monkeypatching in :func:`install_cpu_shims`,
which only the processes that build megatron models call.

- :func:`install_cpu_shims`: CUDA device, RNG, CP rope slicing, HAVE_TE.
- :class:`CPBaselineAttention`: megatron's unpatched MLA needs a core attention
  that accepts ``k_channels``/``v_channels`` and runs under CP; this one
  all-gathers per-head K/V over the CP group with megatron's own mapping and
  masks from the global positions of megatron's zigzag layout.
  Packed (THD) calls get TransformerEngine's semantics (documents, padding).
- packed batches: :class:`PackedDocs`, :func:`make_packed_batches`,
  :func:`packed_seq_params`, :func:`shard_thd` (megatron's per-document CP split);
  :func:`shard_hybrid`: hybrid CP's batch split.
- :func:`build_tiny_mla_gpt`: a 2-layer MLA ``GPTModel`` from
  ``get_gpt_layer_local_spec(multi_latent_attention=True)``.
- :func:`train`: a few SGD steps through megatron's DDP and
  ``finalize_model_grads`` (grads reduced over dp x cp), ``torch.optim.SGD``
  on ``main_grad`` (megatron's optimizer hard-codes CUDA: docs/HOSTS.md, section 'megatron-core on CPU', item 7).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

# the CP baseline core attention: its own module, its names reachable here as before
from .megatron_cp_baseline import (CPBaselineAttention, _thd_visible, thd_positions,  # noqa: F401
                                   zigzag_positions)

CPU = torch.device("cpu")
_SHIMS_INSTALLED = False


# ------------------------------------- shims (docs/HOSTS.md, section 'megatron-core on CPU')

def _cpu_rng_shims(random_mod):
    """Item 2: megatron's RNG tracker keeps CUDA generator states; keep CPU ones."""
    def get_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    def tracker_add(self, name, seed):
        # Same bookkeeping as the original, on the CPU generator.
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        outer = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(outer)

    random_mod._get_cuda_rng_state = get_state
    random_mod._set_cuda_rng_state = set_state
    random_mod.CudaRNGStatesTracker.add = tracker_add


def _cpu_pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
    """Item 4: megatron's zigzag slice of the rope table, without pin_memory/.cuda()."""
    if cp_group is None:
        raise ValueError("cp_group must be provided")
    size, rank = cp_group.size(), cp_group.rank()
    chunks = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * size, -1, *pos_emb.shape[seq_dim + 1:])
    index = torch.tensor([rank, 2 * size - 1 - rank], device=pos_emb.device)
    picked = chunks.index_select(seq_dim, index)
    return picked.view(*picked.shape[:seq_dim], -1, *picked.shape[seq_dim + 2:])


class _CPUStream:
    """What megatron asks of ``torch.cuda.current_stream()``; CPU work is already in order."""

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass

    def synchronize(self):
        pass


_CPU_STREAM = _CPUStream()


def install_cpu_shims():
    """Bridge the CUDA-only spots of megatron-core 0.16.1 to 0.19.2 (idempotent).

    Item 3 of docs/HOSTS.md, section 'megatron-core on CPU' (the causal mask built on CUDA), is not needed: only the
    local DotProductAttention reads it, and MLA cannot use that (item 5).
    """
    global _SHIMS_INSTALLED
    if _SHIMS_INSTALLED:
        return
    import megatron.core.models.common.embeddings.rope_utils as rope_utils
    import megatron.core.models.common.embeddings.rotary_pos_embedding as rotary
    import megatron.core.models.common.embeddings.yarn_rotary_pos_embedding as yarn
    import megatron.core.tensor_parallel.random as random_mod
    import megatron.core.transformer.multi_latent_attention as mla

    torch.cuda.current_device = lambda: CPU  # item 1
    # item 1, megatron-core 0.19: DDP's grad sync waits on the current CUDA stream for
    # CUDA-graph events (0.17/0.18 only with a communication stream); on CPU there is
    # one stream and no event to wait for.
    torch.cuda.current_stream = lambda device=None: _CPU_STREAM
    _cpu_rng_shims(random_mod)  # item 2
    for mod in (rope_utils, rotary, yarn):  # item 4 (imported by name)
        mod.get_pos_emb_on_this_cp_rank = _cpu_pos_emb_on_this_cp_rank
    try:  # item 6: without TE, megatron installs MagicMocks and claims HAVE_TE
        import transformer_engine  # noqa: F401
    except ImportError:
        mla.HAVE_TE = False
    _SHIMS_INSTALLED = True


# ----------------------------------------------------------------- the tiny model

@dataclass
class TinyMLA:
    """Sizes of the tiny MLA GPT (DeepSeek-V3's shapes, scaled down)."""

    num_layers: int = 2
    hidden_size: int = 32
    num_attention_heads: int = 4
    q_lora_rank: int = 16
    kv_lora_rank: int = 16
    qk_head_dim: int = 8
    qk_pos_emb_head_dim: int = 4
    v_head_dim: int = 8
    vocab_size: int = 64
    seq_length: int = 32
    micro_batch: int = 2
    rope_type: str = "yarn"  # "rope" or "yarn"


def qk_layernorm(tiny: TinyMLA) -> bool:
    """q/kv norms on, except without q_lora on megatron-core >= 0.19.

    0.19 applies the Q norm of a model without q_lora inside a fused
    norm+linear ``linear_q_proj`` (TE only; 0.16.1 applies none there), so the
    local spec can build that model only without q/kv norms.
    """
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    return tiny.q_lora_rank is not None or not hasattr(MLASelfAttention,
                                                       "_resolve_qk_norm_config")


def init_parallel(tp: int = 1, cp: int = 1, seed: int = 1234):
    """megatron parallel_state over the already-initialized gloo world, CPU RNG seeded."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    install_cpu_shims()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             context_parallel_size=cp)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def mla_config(tiny: TinyMLA, tp: int = 1, cp: int = 1, **overrides):
    """fp32, fusions off, no dropout (LAGA and the baseline have none); ``overrides`` win."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    fields = dict(
        num_layers=tiny.num_layers, hidden_size=tiny.hidden_size,
        num_attention_heads=tiny.num_attention_heads, ffn_hidden_size=2 * tiny.hidden_size,
        q_lora_rank=tiny.q_lora_rank, kv_lora_rank=tiny.kv_lora_rank,
        qk_head_dim=tiny.qk_head_dim, qk_pos_emb_head_dim=tiny.qk_pos_emb_head_dim,
        v_head_dim=tiny.v_head_dim, rope_type=tiny.rope_type, rotary_base=10000,
        rotary_scaling_factor=4.0 if tiny.rope_type == "yarn" else 1.0,
        original_max_position_embeddings=max(1, tiny.seq_length // 4),
        # mscale != mscale_all_dim: both the rope factor and the softmax scale differ from 1.
        mscale=1.0, mscale_all_dim=0.5,
        normalization="RMSNorm", qk_layernorm=qk_layernorm(tiny),
        tensor_model_parallel_size=tp, context_parallel_size=cp,
        params_dtype=torch.float32, use_cpu_initialization=True, perform_initialization=True,
        attention_dropout=0.0, hidden_dropout=0.0,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        add_bias_linear=False,
    )
    fields.update(overrides)
    return MLATransformerConfig(**fields)


def build_tiny_mla_gpt(tiny: TinyMLA, tp: int = 1, cp: int = 1, **overrides):
    """A tiny MLA GPTModel from the local spec; core attention = CPBaselineAttention.

    ``overrides`` go to the config (e.g. recompute_granularity). Sequence
    parallelism cannot run here: the local spec's torch norms reject it.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    install_cpu_shims()
    config = mla_config(tiny, tp, cp, **overrides)
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=qk_layernorm(tiny),
                                    normalization="RMSNorm")
    # docs/HOSTS.md, section 'megatron-core on CPU', item 5: the local DotProductAttention cannot serve MLA.
    spec.submodules.self_attention.submodules.core_attention = CPBaselineAttention
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=tiny.vocab_size,
                     max_sequence_length=tiny.seq_length, position_embedding_type="rope",
                     pre_process=True, post_process=True)
    set_weights_by_name(model, tp)
    return model


def set_weights_by_name(model, tp: int = 1, scale: float = 0.1):
    """Give every parameter a value that depends only on its name (not on TP/CP/RNG).

    A TP-sharded parameter is drawn at full size and this rank's shard is kept,
    so runs with any TP x CP start from the same weights as the CP=1 reference.
    """
    from megatron.core import parallel_state
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, param in model.named_parameters():
            gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            dim = getattr(param, "partition_dim", -1) if getattr(
                param, "tensor_model_parallel", False) else -1
            shape = list(param.shape)
            if dim >= 0:
                shape[dim] *= tp
            full = torch.randn(shape, generator=gen) * scale
            if "norm" in name.split(".")[-2]:  # norm gains start near 1
                full = 1.0 + full
            if dim >= 0:
                full = full.chunk(tp, dim=dim)[tp_rank]
            param.copy_(full)


# ----------------------------------------------------------------- data and training

def make_batches(tiny: TinyMLA, steps: int, seed: int = 7) -> List[Dict[str, torch.Tensor]]:
    """Full-sequence batches [b, S]: tokens, next-token labels, a loss mask with holes."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        seq = torch.randint(0, tiny.vocab_size, (tiny.micro_batch, tiny.seq_length + 1),
                            generator=gen)
        mask = (torch.rand(tiny.micro_batch, tiny.seq_length, generator=gen) > 0.1).float()
        batches.append({"tokens": seq[:, :-1].contiguous(), "labels": seq[:, 1:].contiguous(),
                        "loss_mask": mask,
                        "position_ids": torch.arange(tiny.seq_length).expand(tiny.micro_batch, -1)
                        .contiguous()})
    return batches


def shard_zigzag(batch):
    """megatron's own get_batch_on_this_cp_rank (zigzag)."""
    from megatron.core import parallel_state
    return megatron_cp_batch(batch, parallel_state.get_context_parallel_group())


def megatron_cp_batch(batch, cp_group):
    """get_batch_on_this_cp_rank of the installed megatron-core, without packed sequences.

    0.16.1 and 0.17 read the CP group from parallel_state; 0.18 and 0.19 take
    ``is_hybrid_cp`` and ``cp_group`` (without one they split over the whole world).
    """
    import inspect
    from megatron.core.utils import get_batch_on_this_cp_rank
    if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters:
        return get_batch_on_this_cp_rank(dict(batch), is_hybrid_cp=False, cp_group=cp_group)
    return get_batch_on_this_cp_rank(dict(batch))


def shard_contiguous(batch):
    """Rank r keeps tokens [r*s, (r+1)*s) (MindSpeed ulysses), via mindspeed_laga.layout."""
    from megatron.core import parallel_state
    from mindspeed_laga import layout
    size = parallel_state.get_context_parallel_world_size()
    rank = parallel_state.get_context_parallel_rank()
    return {k: layout.shard(v, "contiguous", size, rank, dim=1) for k, v in batch.items()}


def shard_hybrid(batch, ulysses_degree: int):
    """Hybrid CP's zigzag (2R chunks, each pair cut over U ranks), via mindspeed_laga.layout."""
    from megatron.core import parallel_state
    from mindspeed_laga import layout
    size = parallel_state.get_context_parallel_world_size()
    rank = parallel_state.get_context_parallel_rank()
    return {k: layout.shard(v, "zigzag", size, rank, dim=1, ulysses_degree=ulysses_degree)
            for k, v in batch.items()}


SHARDERS: Dict[str, Callable] = {"zigzag": shard_zigzag, "contiguous": shard_contiguous}


# ----------------------------------------------------------------- packed documents (THD)

@dataclass(frozen=True)
class PackedDocs:
    """Documents packed into one sequence: real lengths and the lengths they are stored at."""

    real: Tuple[int, ...]
    padded: Tuple[int, ...]

    @staticmethod
    def bounds(lengths) -> List[int]:
        out = [0]
        for n in lengths:
            out.append(out[-1] + n)
        return out

    @property
    def total(self) -> int:
        return sum(self.padded)


def make_packed_batches(tiny: TinyMLA, docs: PackedDocs, steps: int,
                        seed: int = 11) -> List[Dict[str, torch.Tensor]]:
    """Packed batches [1, T]: random tokens, a loss mask that is 0 on padding (and a few
    holes), position_ids = offset in the document."""
    gen = torch.Generator().manual_seed(seed)
    starts = PackedDocs.bounds(docs.padded)
    real = torch.zeros(docs.total, dtype=torch.bool)
    offsets = torch.zeros(docs.total, dtype=torch.long)
    for start, n, padded in zip(starts, docs.real, docs.padded):
        real[start:start + n] = True
        offsets[start:start + padded] = torch.arange(padded)
    batches = []
    for _ in range(steps):
        seq = torch.randint(0, tiny.vocab_size, (1, docs.total + 1), generator=gen)
        holes = (torch.rand(1, docs.total, generator=gen) > 0.1)
        batches.append({"tokens": seq[:, :-1].contiguous(), "labels": seq[:, 1:].contiguous(),
                        "loss_mask": (holes & real).float(), "position_ids": offsets[None].clone()})
    return batches


def packed_seq_params(docs: PackedDocs, padded_field: bool = True):
    """megatron's PackedSeqParams for ``docs`` (as get_thd_batch_on_this_cp_rank builds it)."""
    from megatron.core.packed_seq_params import PackedSeqParams
    real = torch.tensor(PackedDocs.bounds(docs.real), dtype=torch.int32)
    padded = torch.tensor(PackedDocs.bounds(docs.padded), dtype=torch.int32)
    longest = max(docs.padded)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real.clone(),
                           cu_seqlens_q_padded=padded if padded_field else None,
                           cu_seqlens_kv_padded=padded.clone() if padded_field else None,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def shard_thd(batch, docs: PackedDocs):
    """This CP rank's tokens of megatron's THD split (see thd_positions)."""
    from megatron.core import parallel_state
    index = thd_positions(PackedDocs.bounds(docs.padded),
                          parallel_state.get_context_parallel_world_size(),
                          parallel_state.get_context_parallel_rank())
    return {k: v.index_select(1, index) for k, v in batch.items()}


@dataclass
class TrainResult:
    losses: List[float] = field(default_factory=list)  # global mean loss per step
    grads: Dict[str, torch.Tensor] = field(default_factory=dict)  # step 1, full (TP-gathered)


def _wrap_ddp(model):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=False)
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


def global_loss(model, local_batch, packed_seq_params=None):
    """(this rank's backward term, the global mean loss) for one CP-sharded batch.

    The global mean over every unmasked token equals the CP=1 loss. megatron's
    DDP averages grads over dp x cp, so the backward term is scaled by cp.
    """
    from megatron.core import parallel_state
    cp_group = parallel_state.get_context_parallel_group()
    extra = {} if packed_seq_params is None else {"packed_seq_params": packed_seq_params}
    per_token = model(local_batch["tokens"], local_batch["position_ids"], None,
                      labels=local_batch["labels"], **extra)
    mask = local_batch["loss_mask"]
    local_sum = (per_token * mask).sum()
    stats = torch.stack([local_sum.detach(), mask.sum()])
    dist.all_reduce(stats, group=cp_group)
    cp = dist.get_world_size(cp_group)
    return local_sum / stats[1] * cp, (stats[0] / stats[1]).item()


def full_grads(model, tp: int) -> Dict[str, torch.Tensor]:
    """main_grad of every parameter (TP shards gathered), by name without the DDP prefix."""
    from megatron.core import parallel_state
    out = {}
    for name, param in model.named_parameters():
        grad = param.main_grad.detach().clone()
        if tp > 1 and getattr(param, "tensor_model_parallel", False):
            parts = [torch.empty_like(grad) for _ in range(tp)]
            dist.all_gather(parts, grad, group=parallel_state.get_tensor_model_parallel_group())
            grad = torch.cat(parts, dim=param.partition_dim)
        out[name.removeprefix("module.")] = grad
    return out


def train(model, batches, layout: Union[str, Callable] = "zigzag", tp: int = 1,
          lr: float = 0.5, on_step: Optional[Callable[[int, float], None]] = None,
          packed_seq_params=None) -> TrainResult:
    """SGD steps through megatron's DDP and finalize_model_grads; losses and step-1 grads.

    ``layout``: a name of SHARDERS or a function batch -> this rank's batch.
    ``packed_seq_params``: THD batches (shard them with :func:`shard_thd`).
    SGD, not Adam: Adam's first step is nearly lr * sign(grad), which would let
    later losses agree even if grad magnitudes did not.
    """
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    ddp = _wrap_ddp(model)
    params = [p for p in ddp.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=lr)
    shard = layout if callable(layout) else SHARDERS[layout]
    result = TrainResult()
    ddp.train()
    for step, batch in enumerate(batches, start=1):
        ddp.zero_grad_buffer()
        optimizer.zero_grad(set_to_none=True)
        backward_term, loss = global_loss(ddp, shard(batch), packed_seq_params)
        backward_term.backward()
        finalize_model_grads([ddp])  # dp x cp averaging (+ megatron's TP norm-grad sums)
        if step == 1:
            result.grads = full_grads(ddp, tp)
        for p in params:
            p.grad = p.main_grad.to(p.dtype)
        optimizer.step()
        result.losses.append(loss)
        if on_step is not None:
            on_step(step, loss)
    return result


def eval_loss(model, batch, layout: str = "zigzag") -> float:
    """Global mean loss of one batch in eval mode, without grad."""
    model.eval()
    with torch.no_grad():
        _, loss = global_loss(model, SHARDERS[layout](batch))
    return loss


# ----------------------------------------------------------------- process helpers

