"""The host's attention mask as LAGA's key padding, exactly or not at all.

MindSpeed-LLM's SFT trainer (``get_tune_attention_mask``) hands every layer a
bool [b, 1, S, S] mask, True = masked, that is ``~(causal & key_valid)``:
the causal mask plus padding keys (right, or left with
``--tokenizer-padding-side left``); every mapped CP algorithm keeps it whole
(S = the full sequence). LAGA takes the padding as ``key_padding_mask`` [b, S]
(the mask's last row: the last query sees every key that is not padding) and
checks that the mask *is* that: rebuilt from the padding it must equal the
given one element for element. Anything else (a band, a document mask, a
mask split by CP) is refused by name on every CP rank before any data
collective: LAGA never runs a different mask than the host's. A plain causal
mask (no padding) gives None: the fast path.

The check costs one comparison of the mask (a block of rows at a time, so
nothing of [S, S] is allocated) once per micro-batch: under CP the verdict is kept
for the micro-batch (``agreement.memo``, keyed by the mask's storage, view and
version counter, which a recompute's ``detach`` keeps), so the layers of one
forward, and its recompute, read nothing from the device. The next micro-batch
reads the mask again, whatever object it is; an edit within one micro-batch that
bumps no version counter (through ``.data`` or numpy) is read at the next one.
Without micro-batches (no CP, or a caller that never opens one) every call reads
it. The ranks' agreement on the padding is the core call's (its ``key_padding``
field, exchanged once per micro-batch); a mask this rank refuses does not raise
here under CP: the layer's core call reports it on every rank
(``agreement.defer_failure``), before any data collective.
"""
from __future__ import annotations

from typing import Optional

import torch

from mindspeed_laga import agreement

COMPRESSED_MASK_SIZE = 2048  # MindSpeed's compressed causal mask (flash attention, sparse mode 2/3)


def key_padding_from_mask(mask, seq_len: int, micro_batch: int, cp_group,
                          length_error=None) -> Optional[torch.Tensor]:
    """The host's ``attention_mask`` -> ``key_padding_mask`` [b, S] or None (causal only).

    ``length_error(S)``: the message for a full length the CP split cannot take, or None
    (the mask's S is the batch's padded length, which --no-pad-to-seq-lengths varies).
    A mask that is not causal + key padding over the full sequence raises; under CP
    (a group of size > 1) the raise is left to the layer's core call, which reports it on
    every CP rank alike (module docstring)."""
    padding, failure = _verdict(mask, seq_len, micro_batch, length_error, cp_group)
    if failure is None:
        return padding
    if cp_group is not None and torch.distributed.get_world_size(cp_group) > 1:
        agreement.defer_failure(cp_group, failure)
        return None
    raise failure


def _verdict(mask, seq_len: int, micro_batch: int, length_error, cp_group):
    """(key padding or None, this rank's error or None), read once per micro-batch."""
    if mask is None:
        return None, None
    if not isinstance(mask, torch.Tensor):
        return None, ValueError(_refused(f"an attention mask of type {type(mask).__name__}"))
    key = ("attention_mask",) + agreement.tensor_key(mask) + (seq_len, micro_batch)
    return agreement.memo(cp_group, key, lambda: _read(mask, seq_len, micro_batch, length_error))


def _read(mask, seq_len: int, micro_batch: int, length_error):
    try:
        length = mask.shape[-1] if mask.dim() else 0
        if length_error is not None and length_error(length):
            raise ValueError(length_error(length))
        return _key_padding(mask, seq_len, micro_batch), None
    except ValueError as exc:
        return None, exc


def _key_padding(mask: torch.Tensor, seq_len: int, micro_batch: int) -> Optional[torch.Tensor]:
    if mask.dtype != torch.bool:
        raise ValueError(_refused(f"a {mask.dtype} attention mask (LAGA reads bool masks, True = "
                                  "masked, as get_tune_attention_mask builds them)"))
    if tuple(mask.shape) == (COMPRESSED_MASK_SIZE,) * 2 and seq_len != COMPRESSED_MASK_SIZE:
        if torch.equal(mask, _causal(COMPRESSED_MASK_SIZE, mask.device)):
            return None  # the compressed causal mask: plain causal attention
        raise ValueError(_refused("a 2048x2048 mask that is not the compressed causal mask"))
    full = mask.reshape(-1, *mask.shape[-2:]) if mask.dim() >= 2 else mask
    if mask.dim() not in (2, 4) or tuple(full.shape[-2:]) != (seq_len, seq_len) \
            or full.shape[0] not in (1, micro_batch) or (mask.dim() == 4 and mask.shape[1] != 1):
        raise ValueError(_refused(
            f"an attention mask of shape {list(mask.shape)}; LAGA reads [b, 1, S, S] or [S, S] "
            f"over the full sequence (S = {seq_len}, micro-batch {micro_batch}), as MindSpeed-LLM "
            "keeps it with --attention-mask-type causal"))
    padding = full[:, -1, :]  # the last query sees every key but the padding
    if not _is_causal_plus(full, padding):
        raise ValueError(_refused("an attention mask that is not the causal mask plus key "
                                  "padding (e.g. a band from --pre-tockens/--next-tockens, or "
                                  "documents without --reset-attention-mask)"))
    if not bool(padding.any()):
        return None
    return padding.expand(micro_batch, seq_len).contiguous()


ROWS_PER_CHECK = 1024  # rows of the mask rebuilt at a time: [b, 1024, S] bools, never [S, S]


def _is_causal_plus(full: torch.Tensor, padding: torch.Tensor) -> bool:
    """Whether ``full`` [b|1, S, S] equals the causal mask | ``padding`` [b|1, S] (keys),
    compared a block of rows at a time."""
    seq_len = full.shape[-1]
    cols = torch.arange(seq_len, device=full.device)
    for r0 in range(0, seq_len, ROWS_PER_CHECK):
        rows = torch.arange(r0, min(r0 + ROWS_PER_CHECK, seq_len), device=full.device)
        expected = (cols[None, :] > rows[:, None])[None] | padding[:, None, :]
        if not torch.equal(full[:, r0:r0 + len(rows)], expected):
            return False
    return True


def _causal(size: int, device) -> torch.Tensor:
    """True = masked: the keys after each query."""
    return torch.ones(size, size, dtype=torch.bool, device=device).triu(diagonal=1)


def _refused(what: str) -> str:
    return (f"--mla-latent-all-gather got {what}: LAGA computes causal attention with key "
            "padding (MindSpeed-LLM's SFT mask, right or left padding) and nothing else; drop "
            "--mla-latent-all-gather for this mask")
