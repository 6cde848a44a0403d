"""mindspeed-laga: Latent All-Gather Attention for MindSpeed-LLM.

The repository keeps the user's folder names (``features/``, ``patches/``)
but installs them under ``mindspeed_laga`` so no generic top-level name
(``features``, ``patches``) lands in site-packages.
"""
from setuptools import setup

setup(
    name="mindspeed-laga",
    version="0.1.0",
    description="LAGA: context-parallel MLA attention that all-gathers the latent, not per-head K/V",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=[
        "mindspeed_laga",
        "mindspeed_laga.kernels",
        "mindspeed_laga.forms",
        "mindspeed_laga.commands",
        "mindspeed_laga.features",
        "mindspeed_laga.patches",
    ],
    package_dir={
        "mindspeed_laga": "mindspeed_laga",
        "mindspeed_laga.features": "features",
        "mindspeed_laga.patches": "patches",
    },
    install_requires=["torch>=2.1,<2.15"],
    extras_require={
        "test": ["pytest>=7", "numpy"],
        "megatron": ["megatron-core==0.16.1; python_version<'3.12'",
                     "megatron-core==0.19.2; python_version>='3.12'"],
        "npu": ["torch_npu"],
        "plot": ["matplotlib"],
    },
    entry_points={"console_scripts": ["mindspeed-laga=mindspeed_laga.cli:main"]},
)
