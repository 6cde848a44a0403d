"""The real-loop harness: MindSpeed-LLM's own pretrain_gpt.py on gloo CPU ranks (``real_loop``),
the per-rank bootstrap it puts first on PYTHONPATH, and the checks of the NPU-host stand-ins."""
