"""Imported by every Python process of a real-loop run (its folder is first on PYTHONPATH).

In a torchrun rank (``RANK`` set) with ``LAGA_LOOP_RECORD`` naming a folder, before
``pretrain_gpt.py`` imports anything:

- the CPU stand-ins of tests/support/npu_host.py are installed;
- Megatron's JIT warm-up runs under ``torch.random.fork_rng``: it draws dropout masks on
  what are CPU tensors here, and how much it draws depends on the sequence length per
  rank, so without this CP=1 and CP=2 would start from different weights;
- counters are put around ``mindspeed_laga.api.laga_attention`` (before LAGA's patch
  imports it) and ``sparse_laga_attention`` (sparse MLA), around the stand-in's fused DSA
  ops, around every ``CustomMLASelfAttention`` call and every core attention
  module call and every forward of MindSpeed's TE modules (global forward pre-hooks;
  tests/support/loop/te_modules.py), and the stand-in's ``npu_fusion_attention``
  records its calls;
- the collectives (every one, the agreement's included) and host reads LAGA causes are
  counted per MLA layer call and iteration, inside the MLA module's call and LAGA's
  autograd backward functions (tests/support/host_syncs.py, collectives.py,
  laga_regions.py), into ``steady_state``;
- in the host's own runs of packed DSA, its three fused calls are fixed
  (tests/support/loop/host_packed_dsa.py says how and why);
- the host's ``training_log`` is wrapped to keep each iteration's losses and grad norm
  at full precision.

At exit each rank writes ``rank<RANK>.json`` into the folder. The torchrun agent
itself (no ``RANK``) is left alone.
"""
import os

if os.environ.get("LAGA_LOOP_RECORD") and os.environ.get("RANK") is not None:
    import loop_recorder

    loop_recorder.start(os.environ["LAGA_LOOP_RECORD"])
