"""MindSpeed feature for LAGA (installed as ``mindspeed_laga.features``).

``LAGAFeature`` is imported on first use: its module subclasses MindSpeed's
feature base when MindSpeed is importable, and importing MindSpeed's feature
package early would change MindSpeed-LLM's import order.
"""

__all__ = ["LAGAFeature"]


def __getattr__(name):
    if name == "LAGAFeature":
        from .laga_feature import LAGAFeature
        return LAGAFeature
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
