"""LAGA inside MindSpeed-LLM: the forward wrapper of ``CustomMLASelfAttention`` and its host checks."""
