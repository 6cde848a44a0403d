"""LAGA on MindSpeed-LLM's FSDP2 backend (``train_fsdp2.py CONFIG.yaml``).

- ``host.py``: the release with this backend (26.1.0), the models LAGA covers on it, the
  key that turns it on, and the CP group both forwards use (:func:`host.cp_group`);
- ``register.py``: LAGA's forwards entered in the host's own CP mapping table at run time;
- ``deepseek_v3.py``: the dense form for transformers' ``DeepseekV3Attention``;
- ``glm_dsa.py``: the sparse form for ``GlmMoeDsaAttention`` (GLM-5/5.2).

The launcher (``mindspeed_laga.launch``) reads the key and calls :func:`register.install`.
"""
