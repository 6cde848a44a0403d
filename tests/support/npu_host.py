"""CPU stand-ins for what MindSpeed-LLM's training loop needs from an Ascend host.

``install()`` makes a CPU process look, to MindSpeed-LLM, MindSpeed and Megatron, like
a process on an NPU host with ``torch_npu.contrib.transfer_to_npu`` imported:

- ``torch_npu``: tests/support/fake_torch_npu.py's strict ``npu_fusion_attention`` and its
  grad, ``torch_npu.npu`` (the device namespace below),
  ``torch_npu.utils.collect_env.get_cann_version`` and
  ``torch_npu.contrib.transfer_to_npu`` (importing it is what maps the devices, as the
  real module does).
- The device mapping of ``transfer_to_npu``: on an NPU host it rewrites ``cuda`` to
  ``npu`` in tensor factories, ``Tensor.new_*``, ``Tensor.to``, ``Module.to``, ``.cuda()`` and makes
  ``torch.cuda.is_available()`` true. Here ``cuda`` and ``npu`` both mean the CPU,
  ``Tensor.type()`` reports ``torch.cuda.*`` (Megatron's grad clipping asserts it) and
  ``Tensor.is_cuda`` is true (it is ``is_npu`` there).
  ``pin_memory`` requests give ordinary memory (there is no device to pin for).
  Device indices must lie below ``device_count()`` (the node's devices: torchrun's
  ``LOCAL_WORLD_SIZE``), as on the real host.
- The device namespace (``torch.cuda`` and ``torch.npu``): current/set device,
  synchronize, streams and events with their documented signatures, memory counters.
  ``Event.elapsed_time`` raises unless both events were created with
  ``enable_timing=True`` and recorded, like the real one.
- ``torch.histc`` counts integer input, as the NPU kernel does (MindSpeed-LLM's
  ``--seq-aux`` router counts expert ids with it); the CPU kernel takes floats only.
- ``Tensor.scatter_`` taking int32 and -1 indices, ``gather`` int32 ones, ``Tensor.float``
  contiguous (the DSA indexer's host code relies on them: npu_scatter_, npu_gather,
  npu_float);
- ``torch.distributed.all_reduce`` with ``ReduceOp.AVG`` on a gloo group (a sum over
  the group's size: the DSA indexer's loss tracker averages with it);
- ``torch.distributed.reduce_scatter`` on a gloo group: HCCL has it, gloo before torch 2.9
  does not ("ProcessGroupGloo does not support reduce_scatter"), and Megatron's MoE
  dispatcher calls it under tensor parallelism with uneven splits. Here it is an all-reduce
  of the concatenated inputs of which each rank keeps its own slice: the same sum.
- A separate device RNG behind ``torch.cuda.get_rng_state / set_rng_state /
  manual_seed / default_generators / _lazy_call``: "device" randomness (Megatron's
  model-parallel RNG tracker) never touches the CPU generator that CPU-initialized
  weights are drawn from.
- Import stand-ins for what MindSpeed-LLM imports at module level but pretraining does
  not use: ``scipy``, ``torchair``, ``acl``, ``datasets``, ``peft`` (only where the real
  package is not installed). Any name imported from them exists; calling or
  instantiating it raises ``NpuHostError`` naming the stand-in, so a code path that
  really needs the package fails instead of running on a dummy. One exception:
  ``scipy.linalg.hadamard`` (the DSA indexer's rotation) is Sylvester's construction,
  as scipy documents it.

Deliberately not provided: ``transformer_engine`` and ``apex`` (with a catch-all stub
Megatron would pick a dummy ``FusedAdam``; MindSpeed brings its own replacements, as on
a real NPU host).

Nothing here is part of the product; the real-loop tests install it in every rank
through tests/support/loop/real_loop.py's bootstrap.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import time
import types
from types import SimpleNamespace

import torch

CANN_VERSION = "8.2.RC1"  # what get_cann_version returns (MindSpeed parses it)
SOC_NAME = "Ascend910B2"
DEVICE_TYPES = ("cuda", "npu")  # both mean the CPU here
DEFAULT_DEVICE_SEED = 67280421310721  # torch's default seed of a fresh device generator
TOTAL_MEMORY = 64 << 30
IMPORT_STAND_INS = ("scipy", "torchair", "acl", "datasets", "peft")
_INSTALLED = "_npu_host_installed"


class NpuHostError(RuntimeError):
    """A call the real NPU host would reject, or one the stand-ins do not cover."""


# ---------------------------------------------------------------- devices

def device_count() -> int:
    """The node's devices: torchrun's LOCAL_WORLD_SIZE (every rank sees all of them)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


_CURRENT = {"index": 0}


def _check_index(index: int) -> int:
    if not isinstance(index, int) or isinstance(index, bool):
        raise NpuHostError(f"device index must be an int, got {index!r}")
    if not 0 <= index < device_count():
        raise NpuHostError(f"invalid device ordinal {index}: this host has {device_count()} "
                           "device(s) (LOCAL_WORLD_SIZE)")
    return index


def map_device(device):
    """A device argument as the real mapping sees it -> what the CPU host uses.

    ``cuda``/``npu`` (with or without an index) and a bare index become ``cpu``;
    ``cpu`` and ``meta`` pass; anything else is rejected."""
    if device is None:
        return None
    if isinstance(device, int) and not isinstance(device, bool):
        _check_index(device)
        return torch.device("cpu")
    if isinstance(device, str):
        device = _npu_device(device) if device.startswith("npu") else torch.device(device)
    if not isinstance(device, torch.device):
        raise NpuHostError(f"not a device: {device!r}")
    if device.type == "cuda":
        if device.index is not None:
            _check_index(device.index)
        return torch.device("cpu")
    if device.type in ("cpu", "meta"):
        return device
    raise NpuHostError(f"device type {device.type!r} does not exist on this host")


def _npu_device(text: str) -> torch.device:
    # "npu" / "npu:3": torch does not know the type on a CPU build; read it as cuda
    name, _, index = text.partition(":")
    if name != "npu" or (index and not index.isdigit()):
        raise NpuHostError(f"not a device: {text!r}")
    return torch.device("cuda", int(index)) if index else torch.device("cuda")


def _is_device_like(value) -> bool:
    if isinstance(value, torch.device):
        return True
    if isinstance(value, str):
        return value.split(":")[0] in DEVICE_TYPES + ("cpu", "meta")
    return isinstance(value, int) and not isinstance(value, bool)


FACTORIES = ("tensor", "as_tensor", "empty", "empty_like", "empty_strided", "zeros",
             "zeros_like", "ones", "ones_like", "full", "full_like", "arange", "range",
             "linspace", "logspace", "rand", "rand_like", "randn", "randn_like", "randint",
             "randint_like", "randperm", "eye", "tril_indices", "triu_indices", "scalar_tensor")
# Tensor methods that take a device too (Megatron's all-to-all-v allocates its output with
# input.new_empty(..., device=torch.cuda.current_device()))
TENSOR_FACTORIES = ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor",
                    "new_empty_strided")


def _with_device_kwarg(fn):
    @functools.wraps(fn)
    def factory(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = map_device(kwargs["device"])
        if kwargs.get("pin_memory"):  # page-locked host memory: ordinary memory on this host
            kwargs["pin_memory"] = False
        return fn(*args, **kwargs)

    factory.__npu_host_original__ = fn
    return factory


def _map_to_args(args, kwargs):
    """Tensor.to / Module.to arguments with the device mapped (positional or keyword)."""
    if args and _is_device_like(args[0]):
        args = (map_device(args[0]),) + tuple(args[1:])
    if "device" in kwargs:
        kwargs = dict(kwargs, device=map_device(kwargs["device"]))
    return args, kwargs


def _histc_of_integers(histc):
    """torch.histc as the NPU runs it: integer input is counted too (MindSpeed-LLM's
    --seq-aux router counts expert ids that way; the CPU kernel takes floating input only).
    The counts come back in the input's dtype."""
    @functools.wraps(histc)
    def histc_any(input, bins=100, min=0, max=0, *, out=None):
        if input.is_floating_point() or out is not None:
            return histc(input, bins=bins, min=min, max=max, out=out)
        return histc(input.double(), bins=bins, min=min, max=max).to(input.dtype)

    histc_any.__npu_host_original__ = histc
    return histc_any


def _install_device_mapping():
    for name in FACTORIES:
        fn = getattr(torch, name)
        if not hasattr(fn, "__npu_host_original__"):
            setattr(torch, name, _with_device_kwarg(fn))
    for name in TENSOR_FACTORIES:
        fn = getattr(torch.Tensor, name)
        if not hasattr(fn, "__npu_host_original__"):
            setattr(torch.Tensor, name, _with_device_kwarg(fn))

    tensor_to, module_to, tensor_type = torch.Tensor.to, torch.nn.Module.to, torch.Tensor.type

    def to(self, *args, **kwargs):
        args, kwargs = _map_to_args(args, kwargs)
        return tensor_to(self, *args, **kwargs)

    def to_device(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
        if device is not None:
            map_device(device)  # an invalid index fails as on the host
        return tensor_to(self, "cpu", non_blocking=non_blocking, memory_format=memory_format)

    def to_for_module(self, *args, **kwargs):
        args, kwargs = _map_to_args(args, kwargs)
        return module_to(self, *args, **kwargs)

    def module_to_device(self, device=None):
        if device is not None:
            map_device(device)
        return self

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None:  # what transfer_to_npu's host reports: a device tensor
            return tensor_type(self).replace("torch.", "torch.cuda.", 1)
        if isinstance(dtype, str):
            dtype = dtype.replace("torch.cuda.", "torch.", 1).replace("torch.npu.", "torch.", 1)
        return tensor_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.to = to
    # transfer_to_npu sets is_cuda = is_npu: a device tensor says so (Megatron's MoE dispatcher
    # moves its split sizes to the host only when they are on the device)
    torch.Tensor.is_cuda = property(lambda self: self.device.type == "cpu")
    torch.Tensor.record_stream = lambda self, stream: _check_stream(stream, "record_stream")
    torch.Tensor.cuda = to_device
    torch.Tensor.npu = to_device
    torch.Tensor.type = type_
    torch.Tensor.pin_memory = lambda self, device=None: self
    if not hasattr(torch.histc, "__npu_host_original__"):
        torch.histc = _histc_of_integers(torch.histc)
    if hasattr(torch, "accelerator"):  # torch's own accelerator API decides DataLoader pinning:
        torch.accelerator.is_available = lambda: False  # nothing to pin for (a CUDA build asks CUDA)
    torch.Tensor.is_pinned = lambda self, device=None: True
    torch.nn.Module.to = to_for_module
    torch.nn.Module.cuda = module_to_device
    torch.nn.Module.npu = module_to_device


# ---------------------------------------------------------------- streams and events

class Event:
    """torch.cuda.Event(enable_timing=False, blocking=False, interprocess=False)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False):
        for name, value in (("enable_timing", enable_timing), ("blocking", blocking),
                            ("interprocess", interprocess)):
            if not isinstance(value, bool):
                raise TypeError(f"Event({name}=...) takes a bool, got {value!r}")
        self.enable_timing = enable_timing
        self._recorded_at = None

    def record(self, stream=None):
        _check_stream(stream, "Event.record")
        self._recorded_at = time.perf_counter()

    def wait(self, stream=None):
        _check_stream(stream, "Event.wait")

    def query(self) -> bool:
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, end_event) -> float:
        if not isinstance(end_event, Event):
            raise TypeError(f"elapsed_time takes an Event, got {type(end_event).__name__}")
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self._recorded_at is None or end_event._recorded_at is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end_event._recorded_at - self._recorded_at) * 1e3


class Stream:
    """torch.cuda.Stream(device=None, priority=0); work on the CPU is synchronous."""

    def __init__(self, device=None, priority: int = 0, **kwargs):
        if not isinstance(priority, int):
            raise TypeError(f"Stream(priority=...) takes an int, got {priority!r}")
        if kwargs:
            raise TypeError(f"Stream() got unexpected arguments {sorted(kwargs)}")
        map_device(device)
        self.priority = priority
        self.device = torch.device("cpu")

    def wait_stream(self, stream):
        if not isinstance(stream, Stream):
            raise TypeError(f"wait_stream takes a Stream, got {type(stream).__name__}")

    def wait_event(self, event):
        if not isinstance(event, Event):
            raise TypeError(f"wait_event takes an Event, got {type(event).__name__}")

    def record_event(self, event=None):
        event = Event() if event is None else event
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self):
        pass


def _check_stream(stream, where):
    if stream is not None and not isinstance(stream, Stream):
        raise TypeError(f"{where} takes a Stream or None, got {type(stream).__name__}")


_STREAMS = {"default": None, "current": None}


def default_stream(device=None):
    map_device(device)
    if _STREAMS["default"] is None:
        _STREAMS["default"] = Stream()
    return _STREAMS["default"]


def current_stream(device=None):
    map_device(device)
    return _STREAMS["current"] or default_stream()


def set_stream(stream):
    _check_stream(stream, "set_stream")
    _STREAMS["current"] = stream


@contextlib.contextmanager
def stream(stream_):
    _check_stream(stream_, "stream")
    previous = _STREAMS["current"]
    _STREAMS["current"] = stream_ or previous
    try:
        yield stream_
    finally:
        _STREAMS["current"] = previous


class device:  # noqa: N801  (torch.cuda.device's name)
    """torch.cuda.device(index): a context manager selecting the current device."""

    def __init__(self, device):
        self.index = _index_of(device)
        self._previous = None

    def __enter__(self):
        self._previous = _CURRENT["index"]
        if self.index is not None:
            _CURRENT["index"] = self.index

    def __exit__(self, *exc):
        _CURRENT["index"] = self._previous
        return False


def _index_of(device):
    if device is None:
        return None
    if isinstance(device, int) and not isinstance(device, bool):
        return _check_index(device)
    if isinstance(device, str) and device.startswith("npu"):
        device = _npu_device(device)
    device = torch.device(device)
    if device.type != "cuda":
        raise NpuHostError(f"expected a device of this host (cuda/npu), got {device}")
    return _check_index(device.index if device.index is not None else _CURRENT["index"])


def set_device(device):
    index = _index_of(device)
    if index is not None:
        _CURRENT["index"] = index


def current_device() -> int:
    return _CURRENT["index"]


def synchronize(device=None):
    _index_of(device)


# ---------------------------------------------------------------- memory

def _zero(device=None) -> int:
    _index_of(device)
    return 0


def mem_get_info(device=None):
    _index_of(device)
    return TOTAL_MEMORY, TOTAL_MEMORY


def get_device_properties(device=None):
    _index_of(device)
    return SimpleNamespace(name=SOC_NAME, major=9, minor=0, total_memory=TOTAL_MEMORY,
                           multi_processor_count=1)


# ---------------------------------------------------------------- device RNG

class DeviceRNG:
    """One generator per device, separate from the CPU's (as on a real device host)."""

    def __init__(self):
        self.generators = tuple(torch.Generator().manual_seed(DEFAULT_DEVICE_SEED)
                                for _ in range(device_count()))

    def _generator(self, device):
        index = _index_of(device)
        return self.generators[_CURRENT["index"] if index is None else index]

    def get_rng_state(self, device="cuda"):
        return self._generator(device).get_state()

    def set_rng_state(self, new_state, device="cuda"):
        if not isinstance(new_state, torch.Tensor) or new_state.dtype != torch.uint8:
            raise TypeError(f"set_rng_state takes a torch.ByteTensor, got {type(new_state)}")
        self._generator(device).set_state(new_state)

    def manual_seed(self, seed):  # the current device's generator
        self._generator(None).manual_seed(int(seed))

    def manual_seed_all(self, seed):
        for generator in self.generators:
            generator.manual_seed(int(seed))

    def seed(self):
        self._generator(None).seed()

    def initial_seed(self) -> int:
        return self._generator(None).initial_seed()


DEVICE_RNG = None  # made by install(), when the node's device count is known


def _lazy_call(callable_, **kwargs):
    """The device is always initialised here: run the deferred call now."""
    callable_()


def _lazy_init():
    pass


# ---------------------------------------------------------------- the namespace

def _namespace_functions(rng: DeviceRNG):
    return dict(
        is_available=lambda: True, is_initialized=lambda: True, device_count=device_count,
        current_device=current_device, set_device=set_device, synchronize=synchronize,
        device=device, get_device_name=lambda device=None: (_index_of(device), SOC_NAME)[1],
        get_device_capability=lambda device=None: (_index_of(device), (9, 0))[1],
        get_device_properties=get_device_properties,
        Stream=Stream, Event=Event, stream=stream, current_stream=current_stream,
        default_stream=default_stream, set_stream=set_stream,
        memory_allocated=_zero, max_memory_allocated=_zero, memory_reserved=_zero,
        max_memory_reserved=_zero, reset_peak_memory_stats=_zero,
        reset_max_memory_allocated=_zero, empty_cache=lambda: None,
        memory_stats=lambda device=None: (_index_of(device), {})[1],
        mem_get_info=mem_get_info,
        get_rng_state=rng.get_rng_state, set_rng_state=rng.set_rng_state,
        manual_seed=rng.manual_seed, manual_seed_all=rng.manual_seed_all, seed=rng.seed,
        seed_all=rng.seed, initial_seed=rng.initial_seed,
        default_generators=rng.generators, _lazy_call=_lazy_call, _lazy_init=_lazy_init,
        is_bf16_supported=lambda *a, **k: True,
    )


def _install_cuda_namespace(rng: DeviceRNG):
    functions = _namespace_functions(rng)
    for name, value in functions.items():
        setattr(torch.cuda, name, value)
    for name in ("get_rng_state", "set_rng_state", "manual_seed", "manual_seed_all", "seed",
                 "seed_all", "initial_seed"):
        setattr(torch.cuda.random, name, functions[name])
    # transfer_to_npu maps the legacy typed constructors too (the host's SFT dataset index
    # builder calls torch.cuda.LongTensor([1])): here they make CPU tensors
    for name in ("ByteTensor", "IntTensor", "LongTensor", "FloatTensor", "DoubleTensor",
                 "BoolTensor"):
        setattr(torch.cuda, name, getattr(torch, name))
    return functions


def _npu_namespace(functions) -> types.ModuleType:
    """``torch.npu`` / ``torch_npu.npu``: the same functions plus the NPU-only ones."""
    npu = types.ModuleType("torch.npu", "CPU stand-in for torch.npu (tests/support/npu_host.py)")
    npu.__path__ = []
    for name, value in functions.items():
        setattr(npu, name, value)
    npu.set_compile_mode = _set_compile_mode
    npu.config = SimpleNamespace(allow_internal_format=False)
    npu.utils = npu
    npu.random = npu
    return npu


def _set_compile_mode(*, jit_compile: bool):
    if not isinstance(jit_compile, bool):
        raise TypeError(f"set_compile_mode(jit_compile=...) takes a bool, got {jit_compile!r}")


# ---------------------------------------------------------------- collectives gloo lacks

class _DoneWork:
    """What an ``async_op=True`` collective returns, for one that already finished."""

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


def _install_gloo_reduce_scatter():
    import torch.distributed as dist

    native = dist.reduce_scatter

    @functools.wraps(native)
    def reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if dist.get_backend(group) != "gloo":
            return native(output, input_list, op=op, group=group, async_op=async_op)
        flat = torch.cat([t.reshape(-1) for t in input_list])
        dist.all_reduce(flat, op=op, group=group)
        start = sum(t.numel() for t in input_list[:dist.get_rank(group)])
        output.copy_(flat[start:start + output.numel()].view_as(output))
        return _DoneWork() if async_op else None

    dist.reduce_scatter = reduce_scatter


def _install_gloo_all_reduce_avg():
    """``all_reduce`` with ``ReduceOp.AVG`` on a gloo group (HCCL has it, gloo does not; the
    DSA indexer's loss tracker averages with it): a sum divided by the group's size."""
    import torch.distributed as dist

    native = dist.all_reduce

    @functools.wraps(native)
    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if op != dist.ReduceOp.AVG or dist.get_backend(group) != "gloo":
            return native(tensor, op=op, group=group, async_op=async_op)
        native(tensor, op=dist.ReduceOp.SUM, group=group)
        tensor.div_(dist.get_world_size(group))
        return _DoneWork() if async_op else None

    dist.all_reduce = all_reduce


# ---------------------------------------------------------------- tensor semantics

def npu_scatter_(native):
    """``Tensor.scatter_`` as the DSA path's host code relies on it on NPU: an int32 index
    (the fused indexer's picks) is taken, and a -1 pick (a query with fewer visible keys
    than top-k) lands on the last column, which every such row masks causally anyway;
    CPU torch raises on both."""

    @functools.wraps(native)
    def scatter_(self, dim, index, *args, **kwargs):
        if isinstance(index, torch.Tensor) and not index.is_floating_point():
            index = index.long()
            index = torch.where(index < 0, index + self.shape[dim], index)
        return native(self, dim, index, *args, **kwargs)

    return scatter_


def npu_float(native):
    """``Tensor.float`` handing back a contiguous tensor, as the recipes' bf16 -> float32
    cast does (a copy): the float32 runs here would otherwise keep the strides, and the
    host's interleaved complex rope fails in ``view_as_complex`` (last dim stride)."""

    @functools.wraps(native)
    def cast(self, *args, **kwargs):
        return native(self, *args, **kwargs).contiguous()

    return cast


def npu_gather(native):
    """``gather`` taking an int32 index as NPU does (the host gathers with the fused
    indexer's int32 picks in its indexer loss); CPU torch raises."""

    @functools.wraps(native)
    def gather(input, dim, index, *args, **kwargs):
        if isinstance(index, torch.Tensor) and index.dtype == torch.int32:
            index = index.long()
        return native(input, dim, index, *args, **kwargs)

    return gather


def position_ordered_topk(native):
    """``topk`` whose tied values come in position order (the lower index first). The op
    leaves the order of ties unspecified (CPU's and NPU's kernels each pick their own);
    the DSA indexer's top-k picks ties (index scores of exactly 0, where ReLU zeroes every
    head) across the k-th place, so two correct implementations may train different
    models. LAGA, and the fused indexer's stand-in (fake_dsa_ops), pick by position: a
    loop comparing them with the host's torch path installs this in every rank
    (install_position_ordered_topk)."""

    @functools.wraps(native)
    def topk(input, k, dim=-1, largest=True, sorted=True, *, out=None):
        if out is not None:
            return native(input, k, dim, largest, sorted, out=out)
        order = torch.sort(input, dim=dim, descending=largest, stable=True)
        return torch.return_types.topk((order.values.narrow(dim, 0, k),
                                        order.indices.narrow(dim, 0, k)))

    return topk


def install_position_ordered_topk():
    torch.topk = position_ordered_topk(torch.topk)
    torch.Tensor.topk = position_ordered_topk(torch.Tensor.topk)


def _install_tensor_semantics():
    torch.Tensor.scatter_ = npu_scatter_(torch.Tensor.scatter_)
    torch.Tensor.gather = npu_gather(torch.Tensor.gather)
    torch.gather = npu_gather(torch.gather)
    torch.Tensor.float = npu_float(torch.Tensor.float)


# ---------------------------------------------------------------- torch_npu

def _package(name: str, doc: str) -> types.ModuleType:
    module = types.ModuleType(name, doc)
    module.__path__ = []
    module.__file__ = __file__
    return module


def _build_torch_npu(npu) -> dict:
    """{module name: module} of the torch_npu stand-in."""
    from . import fake_torch_npu

    torch_npu = fake_torch_npu._build()
    torch_npu.__path__ = []
    torch_npu.__version__ = "2.7.1"  # the torch_npu MindSpeed-LLM pins
    torch_npu.npu = npu
    contrib = _package("torch_npu.contrib", "stand-in")
    transfer = types.ModuleType("torch_npu.contrib.transfer_to_npu",
                                "importing it maps cuda to the host device (here: the CPU)")
    contrib.transfer_to_npu = transfer
    utils = _package("torch_npu.utils", "stand-in")
    collect_env = types.ModuleType("torch_npu.utils.collect_env", "stand-in")
    collect_env.get_cann_version = get_cann_version
    utils.collect_env = collect_env
    torch_npu.contrib, torch_npu.utils = contrib, utils
    torch_npu._C = _c_extension()
    return {"torch_npu": torch_npu, "torch_npu.npu": npu, "torch_npu.contrib": contrib,
            "torch_npu.contrib.transfer_to_npu": transfer, "torch_npu.utils": utils,
            "torch_npu.utils.collect_env": collect_env}


def _c_extension() -> SimpleNamespace:
    """``torch_npu._C``: only the HCCL process-group options class MindSpeed probes.

    It has no ``hccl_config`` (as torch_npu before 2.1), so MindSpeed's group-info wrapper
    leaves the options of the gloo groups alone."""
    class Options:
        def __init__(self):
            self.is_high_priority_stream = False

    hccl = type("ProcessGroupHCCL", (), {"Options": Options})
    return SimpleNamespace(_distributed_c10d=SimpleNamespace(ProcessGroupHCCL=hccl))


def get_cann_version() -> str:
    return CANN_VERSION


# ---------------------------------------------------------------- import stand-ins

class _Unavailable:
    """A name imported from an import stand-in: usable in imports, never in calls."""

    def __init__(self, qualname):
        self._qualname = qualname

    def __call__(self, *args, **kwargs):
        raise NpuHostError(f"{self._qualname} comes from an import stand-in "
                           "(tests/support/npu_host.py); this code path needs the real package")

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Unavailable(f"{self._qualname}.{name}")

    def __mro_entries__(self, bases):  # subclassing a stand-in class: an unusable base
        qualname = self._qualname

        def refuse(cls, *args, **kwargs):
            raise NpuHostError(f"{qualname} comes from an import stand-in "
                               "(tests/support/npu_host.py)")

        return (type(qualname.rsplit(".", 1)[-1], (), {"__new__": refuse}),)


def _registering_decorator(*args, **kwargs):
    """torchair's register_fx_node_ge_converter(op) / declare_supported(specs): MindSpeed
    decorates its graph-mode converters with them at import time; the converters only
    run under torchair's graph compiler, never in eager training."""
    return lambda converter: converter


def sylvester_hadamard(n, dtype=int):
    """scipy.linalg.hadamard as scipy documents it: Sylvester's construction, n a power of
    2 (the DSA indexer's rotation calls it; CPU hosts without scipy get this one)."""
    import numpy
    if n < 1 or n & (n - 1):
        raise ValueError("n must be a positive integer, and n must be a power of 2")
    h = numpy.ones((1, 1), dtype=dtype)
    while h.shape[0] < n:
        h = numpy.block([[h, h], [h, -h]])
    return h


# names a stand-in module must answer at import time, by module
STAND_IN_FUNCTIONS = {"scipy.linalg": {"hadamard": sylvester_hadamard}}
# names a stand-in must answer at import time, per top-level package
IMPORT_TIME_NAMES = {
    "torchair": {"register_fx_node_ge_converter": _registering_decorator,
                 "declare_supported": _registering_decorator},
    "acl": {"get_soc_name": lambda: SOC_NAME},
}


class StandInModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _Unavailable(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Every module under the given top-level names, as a StandInModule."""

    def __init__(self, roots):
        self.roots = frozenset(roots)

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = StandInModule(spec.name, "import stand-in (tests/support/npu_host.py)")
        module.__path__ = []
        module.__file__ = f"<stand-in {spec.name}>"
        module.__dict__.update(IMPORT_TIME_NAMES.get(spec.name.split(".")[0], {}))
        module.__dict__.update(STAND_IN_FUNCTIONS.get(spec.name, {}))
        return module

    def exec_module(self, module):
        pass


# ---------------------------------------------------------------- install

def install() -> types.ModuleType:
    """Install every stand-in (idempotent); returns the torch_npu stand-in."""
    if getattr(torch, _INSTALLED, None) is not None:
        return getattr(torch, _INSTALLED)
    if importlib.util.find_spec("torch_npu") is not None and "torch_npu" not in sys.modules:
        raise NpuHostError("a real torch_npu is installed: these CPU stand-ins would shadow it")
    global DEVICE_RNG
    DEVICE_RNG = DeviceRNG()
    functions = _install_cuda_namespace(DEVICE_RNG)
    npu = _npu_namespace(functions)
    modules = _build_torch_npu(npu)
    for name, module in modules.items():  # importlib.util.find_spec (accelerate's probe) needs one
        module.__spec__ = importlib.machinery.ModuleSpec(name, None,
                                                         is_package=hasattr(module, "__path__"))
    sys.modules.update(modules)
    sys.modules["torch.npu"] = npu
    torch.npu = npu
    _install_device_mapping()
    _install_gloo_reduce_scatter()
    _install_gloo_all_reduce_avg()
    _install_tensor_semantics()
    missing = [name for name in IMPORT_STAND_INS if importlib.util.find_spec(name) is None]
    if missing:
        sys.meta_path.insert(0, StandInFinder(missing))
    setattr(torch, _INSTALLED, modules["torch_npu"])
    return modules["torch_npu"]
