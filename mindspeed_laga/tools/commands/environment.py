"""What ``mindspeed-laga doctor`` reports about the node: software versions, devices,
and which LAGA paths run here.

Nothing here imports a host framework (importing MindSpeed patches Megatron):
versions come from package metadata, or from the git HEAD of the source
checkout a package would be imported from. The CANN version comes from the
toolkit's install record ``<toolkit>/<arch>-linux/ascend_toolkit_install.info``
(``version=...``; the CANN installation guide's "File Paths" table), with the
toolkit found through ``ASCEND_HOME_PATH`` / ``ASCEND_TOOLKIT_HOME`` (set by
the toolkit's ``set_env.sh``) or the default install paths.
"""
from __future__ import annotations

import glob
import importlib
import importlib.metadata as metadata
import importlib.util
import os
import platform
from typing import Dict, List, Optional

import torch

# (what the report calls it, import name, distribution names to ask metadata)
HOST_PACKAGES = (
    ("MindSpeed", "mindspeed", ("mindspeed",)),
    ("MindSpeed-LLM", "mindspeed_llm", ("mindspeed_llm", "mindspeed-llm")),
    ("megatron-core", "megatron", ("megatron-core", "megatron_core")),
)
TOOLKIT_ENV = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")
TOOLKIT_DEFAULTS = ("/usr/local/Ascend/ascend-toolkit/latest", "/usr/local/Ascend/cann",
                    os.path.expanduser("~/Ascend/ascend-toolkit/latest"))


def torch_npu_module():
    """torch_npu if it imports, else None (whatever keeps it from importing)."""
    try:
        return importlib.import_module("torch_npu")
    except Exception:  # noqa: BLE001 - a broken install is reported as "not importable"
        return None


def accelerator() -> str:
    """'npu', 'cuda' or 'cpu': the device this node computes on."""
    has_torch_npu = torch_npu_module() is not None  # importing it is what adds torch.npu
    npu = getattr(torch, "npu", None)
    if has_torch_npu and npu is not None and _safe(npu.is_available):
        return "npu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def local_device(local_rank: int = 0) -> torch.device:
    kind = accelerator()
    return torch.device("cpu") if kind == "cpu" else torch.device(kind, local_rank)


def report() -> Dict[str, object]:
    """Every environment fact, as strings and numbers (JSON-ready)."""
    env: Dict[str, object] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_npu": _dist_version("torch_npu", "torch-npu") or _attr(torch_npu_module(), "__version__"),
        "cuda": torch.version.cuda,
        "cann": cann_version(),
    }
    env.update(devices())
    for label, module, dists in HOST_PACKAGES:
        env[label] = package_version(module, dists)
    env["MindSpeed-LLM release"] = mindspeed_llm_release()
    env["mindspeed-laga"] = _laga_version()
    return env


def mindspeed_llm_release() -> Optional[str]:
    """Which tested MindSpeed-LLM release's facts (with its MindSpeed's) the importable
    sources show, read from their files (``Release.found``: the facts, never a release
    they may not be); None without MindSpeed-LLM; 'untested: ...' for another."""
    from mindspeed_laga.patches.mindspeed_llm.releases import (UnknownHostRelease, installed_release, package_dir)
    if package_dir("mindspeed_llm") is None:
        return None
    try:
        return installed_release().found()
    except UnknownHostRelease as exc:
        return f"untested: {exc}"


def devices() -> Dict[str, object]:
    kind = accelerator()
    if kind == "cpu":
        return {"device": "cpu", "device_name": platform.processor() or platform.machine(),
                "device_count": os.cpu_count()}
    api = getattr(torch, kind)
    return {"device": kind, "device_name": _safe(lambda: api.get_device_name(0)),
            "device_count": _safe(api.device_count)}


def cann_version() -> Optional[str]:
    """CANN from torch_npu's version module, else the toolkit's install record."""
    version_mod = getattr(torch_npu_module(), "version", None)
    for attr in ("cann", "cann_version"):
        if isinstance(getattr(version_mod, attr, None), str):
            return getattr(version_mod, attr)
    for root in [os.environ.get(k) for k in TOOLKIT_ENV] + list(TOOLKIT_DEFAULTS):
        if not root or not os.path.isdir(root):
            continue
        for path in sorted(glob.glob(os.path.join(root, "*-linux", "ascend_toolkit_install.info"))) + \
                [os.path.join(root, "version.cfg"), os.path.join(root, "compiler", "version.info")]:
            found = _version_line(path)
            if found:
                return f"{found} ({path})"
    return None


def _version_line(path: str) -> Optional[str]:
    """``version=8.0.RC2`` / ``Version=...`` in a key=value file."""
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition("=")
                if key.strip().lower() in ("version", "toolkit_version") and value.strip():
                    return value.strip()
    except OSError:
        return None
    return None


def package_version(module: str, dists=()) -> Optional[str]:
    """A distribution's version, plus the git commit of the checkout it is imported from."""
    version = next((v for v in (_dist_version(d) for d in dists) if v), None)
    spec = _find_spec(module)
    if spec is None:
        return version
    where = (os.path.dirname(spec.origin) if spec.origin
             else next(iter(spec.submodule_search_locations or []), None))
    commit = git_head(where) if where else None
    parts = [p for p in (version, f"git {commit}" if commit else None) if p]
    return ", ".join(parts) or f"importable ({where}), version unknown"


def git_head(path: str) -> Optional[str]:
    """The commit HEAD names in the git checkout holding ``path`` (12 hex digits), read
    from the files (no git binary needed)."""
    path = os.path.abspath(path)
    if {"site-packages", "dist-packages"} & set(path.split(os.sep)):
        return None  # an installed copy: any checkout above it is another project's
    while True:
        dot_git = os.path.join(path, ".git")
        if os.path.isfile(dot_git):  # a worktree or submodule: "gitdir: <dir>"
            with open(dot_git) as f:
                dot_git = os.path.join(path, f.read().partition("gitdir:")[2].strip())
        if os.path.isdir(dot_git):
            return _resolve_head(dot_git)
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent


def _resolve_head(git_dir: str) -> Optional[str]:
    try:
        with open(os.path.join(git_dir, "HEAD")) as f:
            head = f.read().strip()
    except OSError:
        return None
    if not head.startswith("ref:"):
        return head[:12]
    ref = head[4:].strip()
    common = git_dir
    if os.path.isfile(os.path.join(git_dir, "commondir")):
        with open(os.path.join(git_dir, "commondir")) as f:
            common = os.path.join(git_dir, f.read().strip())
    for base in (git_dir, common):
        try:
            with open(os.path.join(base, ref)) as f:
                return f.read().strip()[:12]
        except OSError:
            pass
        try:
            with open(os.path.join(base, "packed-refs")) as f:
                for line in f:
                    sha, _, name = line.strip().partition(" ")
                    if name == ref:
                        return sha[:12]
        except OSError:
            pass
    return None


def _find_spec(module: str):
    try:
        return importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None


def _dist_version(*names: str) -> Optional[str]:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _laga_version() -> str:
    import mindspeed_laga
    commit = git_head(os.path.dirname(mindspeed_laga.__file__))
    return mindspeed_laga.__version__ + (f", git {commit}" if commit else "")


def _attr(obj, name):
    return getattr(obj, name, None) if obj is not None else None


def _safe(fn):
    try:
        return fn()
    except Exception:  # noqa: BLE001 - a device query that fails is reported as None
        return None


def laga_paths(device: torch.device) -> Dict[str, str]:
    """Which LAGA paths run on ``device``: the blockwise kernel ``recompute_kv`` picks
    per dtype (``kernels.resolve``), the NPU kernel, its V layouts (tried
    on a 192/128 call, forward and backward) and packed documents through it."""
    from ... import kernels
    out = {}
    for dtype in dtypes_for(device):
        name = str(dtype).replace("torch.", "")
        kernel = kernels.resolve("auto", device, dtype, blockwise=True)
        out[f"recompute_kv block kernel ({name})"] = kernel.name + (
            f": {kernel.block_note}" if kernel.block_note else "")
    if torch_npu_module() is None:
        out["npu kernel"] = "not available (torch_npu does not import)"
        return out
    out["npu kernel"] = "available"
    for pad_v in (False, True):
        out[f"npu {'padded' if pad_v else 'unpadded'} V (pad_v={pad_v})"] = probe_npu_v(device, pad_v)
    out["npu packed documents (cu_seqlens)"] = (
        "available" if npu_documents_supported() else "not in this build (use kernel eager/sdpa)")
    return out


def dtypes_for(device: torch.device):
    """The dtypes checked on a device: training's bfloat16 on an accelerator, and float32."""
    return (torch.float32,) if device.type == "cpu" else (torch.bfloat16, torch.float32)


def installed_kernels() -> List[str]:
    """The registry's kernels whose runtime imports here (npu: torch_npu), in the CLI's order."""
    from ...kernels.registry import KERNEL_NAMES, KERNEL_TYPES
    out = []
    for name in KERNEL_NAMES:
        try:
            KERNEL_TYPES[name].check_installed()
        except Exception:  # noqa: BLE001 - a broken install is reported as "not importable"
            continue
        out.append(name)
    return out


def npu_documents_supported() -> bool:
    """Whether the NPU kernel takes a segment's document pieces (packed documents)."""
    import inspect
    from ...kernels import npu
    return "pieces" in inspect.signature(npu.attend_segment).parameters


def probe_npu_v(device: torch.device, pad_v: bool) -> str:
    """One causal call at MLA's 192/128 head dims, forward and backward, against eager."""
    from ...kernels import eager, npu
    g = torch.Generator().manual_seed(0)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    q, k = (torch.randn(1, 2, 16, 192, generator=g) for _ in range(2))
    v, dy = (torch.randn(1, 2, 16, 128, generator=g) for _ in range(2))
    try:
        leaves = [x.to(device, dtype).requires_grad_() for x in (q, k, v)]
        out = npu.attend_segment(*leaves, scale=192 ** -0.5, causal=True, pad_v=pad_v)
        grads = torch.autograd.grad(out, leaves, dy.to(device, dtype))
    except Exception as exc:  # noqa: BLE001 - what fails here is the finding
        return f"fails: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    ref_leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref = eager.attend_segment(*ref_leaves, scale=192 ** -0.5, causal=True)
    ref_grads = torch.autograd.grad(ref, ref_leaves, dy.double())
    err = max(_rel(a, b) for a, b in zip((out,) + tuple(grads), (ref,) + tuple(ref_grads)))
    return f"works (max rel err {err:.1e} vs float64 eager)"


def _rel(got, ref) -> float:
    return ((got.detach().double().cpu() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
