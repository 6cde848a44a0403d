"""Where LAGA's gathered latent comes from: gathered now, or by a gather started earlier.

Both sources hand out the gathered ``[kv_latent, k_pos_emb]`` of every rank
in global position order, autograd-connected (the backward reduce-scatters
its gradient). ``laga_forward`` asks for it in one of two shapes:

- ``latent(setup)``: [S, b, d_c + d_r] in one tensor (the blockwise path
  keeps exactly this for backward);
- ``parts(setup)``: (kv part [S, b, d_c], rope key [S, b, d_r]) for the
  up-projection, with no copy at all when there is no CP.

``SyncLatent`` gathers when asked; ``overlap.LatentGather`` was launched
before the query projection and only waits.
"""
from __future__ import annotations

import torch

from ..vocab.attn_setup import AttnSetup
from .common import gathered_latent, split_latent


class SyncLatent:
    """Gather ``[kv_latent, k_pos_emb]`` over the CP group when the latent is needed."""

    def __init__(self, kv_latent: torch.Tensor, k_pos_emb: torch.Tensor):
        self.kv_latent, self.k_pos_emb = kv_latent, k_pos_emb

    def latent(self, setup: AttnSetup) -> torch.Tensor:
        return gathered_latent(self.kv_latent, self.k_pos_emb, setup)

    def parts(self, setup: AttnSetup):
        if setup.cp_size == 1:
            return self.kv_latent, self.k_pos_emb
        return split_latent(self.latent(setup), setup)
