"""``--moe-fb-overlap``: MindSpeed's forward/backward overlap of the MoE all-to-all.

A layer whose attention carries ``a2a_hooked_on_attention`` expects its attention to
start the MoE all-to-all in forward (once the query and key are built) and again from
the attention output's gradient in backward; the original MLA forwards do both, so
LAGA's forwards (dense and sparse) do them at the same points.
"""
from __future__ import annotations


def launch_a2a(module) -> None:
    """Start the MoE all-to-all where the original forward does (no-op without the hook)."""
    if getattr(module, "a2a_hooked_on_attention", False):
        from mindspeed.core.transformer.moe.moe_feature.fb_overlap.modules.attention import (
            launch_async_all2all)
        launch_async_all2all()


def hook_a2a(module, core_out) -> None:
    """Start it again from ``core_out``'s gradient in backward, as the original does."""
    if getattr(module, "a2a_hooked_on_attention", False) and core_out.requires_grad:
        from mindspeed.core.transformer.moe.moe_feature.fb_overlap.modules.attention import (
            launch_async_all2all_hook)
        core_out.register_hook(launch_async_all2all_hook)
