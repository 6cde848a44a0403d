"""LAGA inside megatron-core's ``MLASelfAttention`` (Megatron-LM without MindSpeed)."""
