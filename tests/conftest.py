"""Fixtures, plugins and markers shared by the tests.

The layout: ``core/`` (forms, options, documents, hybrid CP, checks), ``npu/`` (the NPU
kernel against the ``torch_npu`` stand-in), ``tools/`` (cost model, CLI, runners),
``mindspeed/`` (the MindSpeed feature, launcher and MindSpeed-LLM adapter), ``megatron/``
(the megatron-core patch), ``loop/`` (MindSpeed-LLM's real training loop), ``support/``
(what the tests share; never the product).

Markers choose CI's extra legs (``.ci/run``): ``ascend`` tests also run on the Ascend
stack (Python 3.10, torch 2.7.1), ``mcore`` tests on the newest megatron-core (Python 3.12).
The main leg runs every test but those marked ``hosts``: the matrix of real hosts, i.e.
the MindSpeed-LLM release pairs other than master and the real training loop
(``loop/``: LAGA trained through MindSpeed-LLM's own ``pretrain_gpt.py`` under torchrun),
and the real-module comparisons that take tens of seconds to minutes (the real
``CustomMLASelfAttention`` on every release pair, master's included; peft's LoRA layers;
sparse MLA's host forward at CP 1, 2 and 4; the FP8 rebuild on MindSpeed's TE linear).
They are ``ascend`` tests and run in the Ascend leg, the stack they exercise.
"""
# the real host sources (master; every release pair), unpacked once per run
from support.thirdparty import host_sources, release_host_sources  # noqa: F401

pytest_plugins = ["support.bounded"]

MARKERS = {
    "ascend": "also runs in CI's Ascend leg (Python 3.10, torch 2.7.1)",
    "mcore": "also runs in CI's mcore leg (Python 3.12, the newest megatron-core)",
    "loop": "trains through MindSpeed-LLM's own pretrain_gpt.py under torchrun",
    "hosts": ("the real-host matrix (releases other than master, the real loop, the slow "
              "real-module comparisons): Ascend leg only"),
}


def pytest_configure(config):
    for name, what in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {what}")
