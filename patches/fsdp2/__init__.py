"""LAGA adapters for MindSpeed-LLM's FSDP2 backend (``train_fsdp2.py``)."""
