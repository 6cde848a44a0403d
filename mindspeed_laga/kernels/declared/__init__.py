"""What each kernel declares, one torch-free module per kernel: its name, aliases, device,
cost-model kind, when ``auto`` picks it and what it checks. Its running methods import
the backend's torch module (``kernels/<backend>.py``) on first call, so the registry, the
CLI's parser and the cost model read these without importing torch."""
