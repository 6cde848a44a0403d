"""Imported by every Python process of an FSDP2 loop run (its folder is first on PYTHONPATH).

In a torchrun rank (``RANK`` set) with ``LAGA_FSDP2_RECORD`` naming a folder, before
``train_fsdp2.py`` imports anything, fsdp2_recorder.py installs the CPU stand-ins and the
counters, and at exit writes ``rank<RANK>.json`` there. The torchrun agent is left alone.
"""
import os

if os.environ.get("LAGA_FSDP2_RECORD") and os.environ.get("RANK") is not None:
    import fsdp2_recorder

    fsdp2_recorder.start(os.environ["LAGA_FSDP2_RECORD"])
