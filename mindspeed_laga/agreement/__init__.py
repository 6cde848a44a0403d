"""The cross-rank agreement: every CP rank agrees on a call, or every rank raises naming the
cause (docs/DESIGN.md, "Handshake"). Imports go one way: rows -> inband -> schedule ->
content -> wire -> fields, and all of them to ``comm``. Names are imported on first use."""
from ..lazy import lazy

_MODULES = {
    "fields": "FIELDS STAGES DTYPES INPUTS UNKNOWN CONTENT TABLE Field float_bits bits_float "
              "dtype_code grad_pattern row_of",
    "schedule": "Mode new_micro_batch settle reset skips state decide defer_failure "
                "agree_call memo content_code flag note_weight",
    "content": "tensor_key device_code padding_code padding_counts documents_code "
               "check_same_weight weight_checksum",
    "rows": "agree_on_call gather_row kv_up_linear_code call_tensors",
    "wire": "exchange exchange_device as_exception"}
_API = {name: "." + module for module, names in _MODULES.items() for name in names.split()}
__getattr__ = lazy(__name__, _API)
__all__ = sorted(_API)
