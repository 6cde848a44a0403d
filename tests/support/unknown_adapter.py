"""A wrapper LAGA has never read, for the tests of what patches/lora.py refuses."""
from torch import nn


class UnknownAdapter(nn.Module):
    """It keeps the module as ``base_layer``, as peft does, with a forward of its own."""

    def __init__(self, base):
        super().__init__()
        self.base_layer = base

    def forward(self, x):
        return self.base_layer(x) * 2
