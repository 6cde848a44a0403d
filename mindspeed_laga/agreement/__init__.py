"""The cross-rank agreement: every CP rank agrees on a call, or every rank raises naming
the cause (docs/DESIGN.md, "Handshake").

- ``fields.py``: the one table of fields (name, code, how a difference is explained);
- ``wire.py``: the exchange and its messages; ``store.py``: a failure told through the
  process group's store; ``weights.py``: the same weight on every rank;
- ``schedule.py``: when a call exchanges, records or skips; ``settle``, ``reset``;
- ``content.py``: key padding and documents as codes; ``rows.py``: the dense forms' rows;
- ``inband.py``: a later call's code and verdict carried in its latent all-gather.

Imports go one way: rows -> inband -> schedule -> wire -> fields; nothing imports back. The
names below are imported on first use, so that ``comm`` can import ``store`` alone.
"""
from ..lazy import lazy

_API = {name: ".fields" for name in (
    "FIELDS", "STAGES", "DTYPES", "INPUTS", "UNKNOWN", "CONTENT", "TABLE", "Field", "float_bits",
    "bits_float", "dtype_code", "grad_pattern", "row_of")}
_API.update({name: ".schedule" for name in (
    "Mode", "new_micro_batch", "settle", "reset", "skips", "state", "decide", "open_micro_batch",
    "in_backward", "defer_failure", "agree_call", "memo", "content_code", "flag",
    "note_weight")})
_API.update({name: ".content" for name in (
    "tensor_key", "device_code", "padding_code", "padding_counts", "documents_code")})
_API.update({name: ".rows" for name in ("agree_on_call", "gather_row", "kv_up_linear_code",
                                              "call_tensors")})
_API.update({"check_same_weight": ".weights", "weight_checksum": ".weights",
             "exchange": ".wire", "exchange_device": ".wire", "as_exception": ".wire"})

__getattr__ = lazy(__name__, _API)
__all__ = sorted(_API)
