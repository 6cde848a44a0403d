"""MindSpeed-LLM's FSDP2 backend (``train_fsdp2.py``) run on gloo CPU ranks (loop.py)."""
