"""What a kernel is: one object per backend, the dense and the block kernel behind one protocol.

A :class:`Kernel` is resolved once per call (``checks.check``, :func:`kernels.resolve`)
into the setup, with the options only it reads (``pad_v``) bound, so the forms and
the blockwise walk call it without knowing which backend runs. Adding a kernel is a
subclass in its own ``kernels/declared/<name>.py`` (what it declares, torch-free; its
running methods import its torch module on first call) plus its entry in
``kernels/registry.py`` (docs/DESIGN.md, "Extension points"). Torch-free: the CLI's parser
and the cost model read the declarations.
"""
from __future__ import annotations

import functools
import importlib
from typing import ClassVar, Optional, Tuple


@functools.lru_cache(maxsize=None)
def running(name: str):
    """``kernels/<name>.py``, a kernel's torch module: imported on its first call, then kept
    (an import statement in a method runs importlib's Python code on every layer call)."""
    return importlib.import_module(f"{__package__}.{name}")


class Kernel:
    """One attention backend: ``attend_segment`` (dense, autograd) and ``block`` (the
    blockwise LAGA's block kernel, contract in ``kernels/block.py``)."""

    name: ClassVar[str]
    # Whether ``pad_v`` (zero-pad V to the q/k head dim for the op) means anything here.
    pads_v: ClassVar[bool] = False
    # Whether packed documents (cu_seqlens) through this kernel depend on the runtime's
    # build (the NPU op's varlen layout): the doctor runs those checks only where it has it.
    documents_need_build: ClassVar[bool] = False
    # What the blockwise path's block kernel is, for the doctor ("" = the name says it).
    block_note: ClassVar[str] = ""
    # The one device type it runs on (None: any, CPU included). The commands that spawn gloo
    # CPU ranks (verify, the CPU training demo) offer only kernels without one; bench offers
    # the others under torchrun on ``device_host``.
    device: ClassVar[Optional[str]] = None
    device_host: ClassVar[str] = ""
    # Whether MindSpeed-LLM's training flag (--mla-laga-kernel) offers it.
    in_training_flag: ClassVar[bool] = True
    # Other names the CLI flags accept for it (spellings older commands used). Its own: a
    # subclass does not take its parent's (``__init_subclass__``), or a new kernel built on
    # an old one would silently take over the old one's spellings.
    aliases: ClassVar[Tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "aliases" not in cls.__dict__:
            cls.aliases = ()

    def __init__(self, pad_v: bool = False):
        self.pad_v = bool(pad_v) and self.pads_v

    def __repr__(self) -> str:
        return f"{type(self).__name__}(pad_v={self.pad_v})" if self.pads_v else type(self).__name__

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other.pad_v == self.pad_v

    def __hash__(self) -> int:
        return hash((type(self), self.pad_v))

    # ---- resolution ("auto" and the checks), before anything runs

    @classmethod
    def picks_auto(cls, device, dtype, blockwise: bool) -> bool:
        """Whether ``kernel="auto"`` resolves to this kernel for these tensors (the registry
        asks in its order; the first that says yes is taken)."""
        return False

    @classmethod
    def check(cls, device, dtype, blockwise: bool) -> None:
        """ValueError naming the fix when this kernel cannot run these tensors."""

    @classmethod
    def check_installed(cls) -> None:
        """ValueError naming the fix when what it runs on is not installed here."""

    @classmethod
    def model_kind(cls, device_type: str) -> str:
        """The cost model's kernel kind of this kernel on ``device_type`` (its names:
        ``tools/costmodel/config.py``, ``MODEL_KERNELS``): how much it keeps for backward."""
        raise NotImplementedError(f"kernel {cls.name!r} names no cost-model kind (Kernel.model_kind)")

    # ---- running

    def attend_segment(self, q, k, v, *, scale: float, causal: bool, pieces=None, keep=None):
        """One query segment against its key window (kernels/__init__.py: ``attend``);
        ``keep`` [b, 1, rows, W] bool, with key padding: every row's visibility (it replaces
        ``causal`` and ``pieces``; no row of it is empty, ``masks.padded_keep_mask``)."""
        raise NotImplementedError

    def attend_rows(self, q, k, v, *, scale: float, windows):
        """Every query segment of a causal call without documents or key padding in one
        kernel call, or None: one :meth:`attend_segment` call per segment (the default).
        ``windows``: per segment, in row order, its rows and key window (``nonfinite.Window``);
        its rows see the window bottom-right aligned."""
        return None

    @property
    def block(self):
        """The block kernel of the blockwise walk (kernels/block.py: the contract)."""
        raise NotImplementedError


class BlockKernel:
    """A block kernel (contract: kernels/block.py): stateless, ``forward``/``backward`` per
    run of query rows; the packed entries below default to one call per run, and a
    kernel that can take all of a segment's runs at once (NPU: varlen) overrides them."""

    @classmethod
    def forward_runs(cls, q, key, value, runs, scale):
        """[(out, lse)] of one segment's runs against a block."""
        return [cls.forward(q[:, :, rows], key[:, :, ks], value[:, :, ks], offset, scale)
                for rows, ks, offset in runs]

    @classmethod
    def backward_runs(cls, q, key, value, runs, scale, d_out, out, lse):
        """[(dq, dk, dv)] of one segment's runs, shaped like q[rows] and key/value[ks]."""
        return [cls.backward(q[:, :, rows], key[:, :, ks], value[:, :, ks], offset, scale,
                             d_out[:, :, rows], out[:, :, rows], lse[:, :, rows])
                for rows, ks, offset in runs]
