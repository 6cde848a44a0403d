"""The MindSpeed-LLM releases LAGA's MindSpeed-LLM adapter is tested with, told apart
by the host's own source, and the small differences of their MLA forward.

MindSpeed-LLM and MindSpeed declare no release version (their ``setup.py``
versions are placeholders that no release changes), so a release is named by
facts of its source, read without importing it (importing MindSpeed-LLM
patches Megatron):

- MindSpeed-LLM: from ``mindspeed_llm/tasks/models/transformer/multi_latent_attention.py``,
  parsed, what ``CustomMLASelfAttention`` and its module define (see
  :func:`mindspeed_llm_facts`);
- MindSpeed: which of a few files exist (see :data:`MINDSPEED_FILES`).

Each release is a pair (a MindSpeed-LLM branch and the MindSpeed branch it
names); a host whose facts match no tested pair is refused, naming the pairs.

What differs in the MLA forward LAGA reproduces is a field of :class:`Release`
(``lora_scales``, ``rope_deinterleave``, ``documents_refused``); the forward
itself (patches/mindspeed_llm/forward.py) is one for all releases.
"""
from __future__ import annotations

import ast
import functools
import importlib.util
import os
from dataclasses import dataclass
from typing import Dict, NamedTuple, Optional, Tuple

MLA_MODULE = os.path.join("tasks", "models", "transformer", "multi_latent_attention.py")
MLA_CLASS = "CustomMLASelfAttention"

# MindSpeed: files that appeared branch by branch (relative to the mindspeed package)
MINDSPEED_FILES = (
    os.path.join("auto_settings", "mindspeed_adaptor", "__init__.py"),  # 2.3.0 on
    os.path.join("core", "dist_checkpointing", "__init__.py"),  # 26.0.0 on
    os.path.join("core", "hccl_buffer", "hccl_op_mode_adaptor.py"),  # 26.1.0 on
    os.path.join("core", "distill", "__init__.py"),  # master (028de58c)
)


class LLMFacts(NamedTuple):
    """What a MindSpeed-LLM release's MLA module shows (:func:`mindspeed_llm_facts`)."""
    reads_up_proj_recompute_gate: bool   # imports should_recompute_mla_up_proj
    shares_dsa_indices: bool             # assigns self._dsa_index_share
    kv_lora_scale: bool                  # assigns self.mla_scale_kv_lora
    submodule_builder: bool              # module-level get_mla_self_attn_submodules
    rope_deinterleaved: Tuple[str, ...]  # rope types the forward de-interleaves


@dataclass(frozen=True)
class Release:
    """One tested MindSpeed-LLM release with the MindSpeed branch it pairs with."""
    name: str
    mindspeed_llm_commit: str
    mindspeed_branch: str
    mindspeed_commit: str
    cann: Optional[str]  # the CANN and torch_npu the release names (master: none)
    torch_npu: Optional[str]
    # what the host's source shows (mindspeed_llm_facts / mindspeed_facts)
    llm_facts: LLMFacts
    mindspeed_facts: Tuple[bool, ...]
    # --- the differences of the MLA forward -------------------------------------------
    # the forward scales the q/kv latents by mla_scale_q_lora / mla_scale_kv_lora
    lora_scales: bool = True
    # rope_scaling_type values for which the forward de-interleaves the rope dims of
    # q_pos_emb and k_pos_emb (pairs -> halves) before applying rope
    rope_deinterleave: Tuple[str, ...] = ()
    # --reset-attention-mask: the CP algorithms LAGA takes packed documents with on this
    # release (None: every one LAGA maps) and why not the others
    document_algos: Optional[Tuple[str, ...]] = None
    documents_refused: Optional[str] = None

    def label(self) -> str:
        return (f"MindSpeed-LLM {self.name} ({self.mindspeed_llm_commit}) with MindSpeed "
                f"{self.mindspeed_branch} ({self.mindspeed_commit})")

    def deinterleaves(self, rope_scaling_type) -> bool:
        return rope_scaling_type in self.rope_deinterleave

    def takes_documents(self, cp_algo: str) -> bool:
        return self.document_algos is None or cp_algo in self.document_algos


RELEASES = (
    Release("master", "c77308a1", "master", "028de58c", None, None,
            llm_facts=LLMFacts(True, True, True, True, ()),
            mindspeed_facts=(True, True, True, True)),
    Release("26.1.0", "ad615b3b", "26.1.0_core_r0.12.1", "57a33053", "9.1.0", "26.1.0",
            llm_facts=LLMFacts(False, True, True, True, ()),
            mindspeed_facts=(True, True, True, False)),
    Release("26.0.0", "4a035628", "26.0.0_core_r0.12.1", "3c44c134", "9.0.0", "26.0.0",
            llm_facts=LLMFacts(False, False, True, True, ()),
            mindspeed_facts=(True, True, False, False)),
    Release("2.3.0", "62d4640b", "2.3.0_core_r0.12.1", "674226a1", "8.5.0", "7.3.0",
            llm_facts=LLMFacts(False, False, False, True, ("plm", "yarn")),
            mindspeed_facts=(True, False, False, False),
            lora_scales=False, rope_deinterleave=("yarn", "plm"),
            document_algos=("megatron_cp_algo",),
            documents_refused=(
                "its MindSpeed splits packed documents per document (zigzag, after padding) "
                "for every CP algorithm, which only megatron_cp_algo's attention follows")),
    Release("2.2.0", "337813b0", "2.2.0_core_r0.12.1", "a654440c", "8.3.RC1", "7.2.0",
            llm_facts=LLMFacts(False, False, False, False, ("yarn",)),
            mindspeed_facts=(False, False, False, False),
            lora_scales=False, rope_deinterleave=("yarn",), document_algos=(),
            documents_refused=(
                "its MLA forward hands rope packed_seq_params.cu_seqlens_q (a tensor) while "
                "the THD rope its --reset-attention-mask feature installs reads "
                "cu_seqlens.position_ids, so the host itself cannot apply rope to packed "
                "documents")),
)
BY_NAME: Dict[str, Release] = {r.name: r for r in RELEASES}


class UnknownHostRelease(RuntimeError):
    """The installed MindSpeed-LLM / MindSpeed pair is none of the tested releases."""


def tested() -> str:
    return "; ".join(r.label() for r in RELEASES)


# --- the host's facts -----------------------------------------------------------------------

def mindspeed_llm_facts(mla_path: str) -> Tuple:
    """Facts of MindSpeed-LLM's MLA module (see ``Release.llm_facts``), parsed, not imported."""
    with open(mla_path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=mla_path)
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == MLA_CLASS]
    if not classes:
        return ("no " + MLA_CLASS,)
    cls = classes[0]
    imported = {a.asname or a.name for n in ast.walk(tree)
                if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    assigned = {t.attr for n in ast.walk(cls) if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                and t.value.id == "self"}
    top_level = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    return LLMFacts("should_recompute_mla_up_proj" in imported, "_dsa_index_share" in assigned,
                    "mla_scale_kv_lora" in assigned, "get_mla_self_attn_submodules" in top_level,
                    _rope_types_deinterleaved(cls))


def _rope_types_deinterleaved(cls: ast.ClassDef) -> Tuple[str, ...]:
    """The string constants the class compares ``args.rope_scaling_type`` with: the
    2.x forwards de-interleave the rope dims for exactly those."""
    found = set()
    for node in ast.walk(cls):
        if not (isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute)
                and node.left.attr == "rope_scaling_type"):
            continue
        for right in node.comparators:
            values = right.elts if isinstance(right, (ast.Tuple, ast.List, ast.Set)) else [right]
            found.update(v.value for v in values
                         if isinstance(v, ast.Constant) and isinstance(v.value, str))
    return tuple(sorted(found))


def mindspeed_facts(mindspeed_package: str) -> Tuple[bool, ...]:
    return tuple(os.path.isfile(os.path.join(mindspeed_package, p)) for p in MINDSPEED_FILES)


# --- identification -------------------------------------------------------------------------

def package_dir(name: str) -> Optional[str]:
    """Where ``import name`` would load the package from, without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    locations = list(spec.submodule_search_locations or [])
    return locations[0] if locations else (os.path.dirname(spec.origin) if spec.origin else None)


def identify(llm_package: str, mindspeed_package: Optional[str]) -> Release:
    """The tested release whose facts these packages show; raises UnknownHostRelease."""
    llm = identify_mindspeed_llm(os.path.join(llm_package, MLA_MODULE))
    if mindspeed_package is None:
        raise UnknownHostRelease(f"MindSpeed-LLM {llm.name} found but MindSpeed is not "
                                 f"importable; install MindSpeed {llm.mindspeed_branch}")
    found = mindspeed_facts(mindspeed_package)
    if found != llm.mindspeed_facts:
        paired = [r.mindspeed_branch for r in RELEASES if r.mindspeed_facts == found]
        raise UnknownHostRelease(
            f"MindSpeed-LLM {llm.name} is tested with MindSpeed {llm.mindspeed_branch}, but the "
            f"MindSpeed at {mindspeed_package} is "
            f"{('branch ' + paired[0]) if paired else 'none of the tested branches'}. Install "
            f"the pair (tested: {tested()})")
    return llm


def identify_mindspeed_llm(mla_path: str) -> Release:
    facts = _cached_facts(os.path.realpath(mla_path))
    for release in RELEASES:
        if release.llm_facts == facts:
            return release
    raise UnknownHostRelease(
        f"the MindSpeed-LLM at {mla_path} is not a tested release (its MLA module shows "
        f"{describe(facts)}); LAGA's adapter is tested with: {tested()}")


@functools.lru_cache(maxsize=None)
def _cached_facts(mla_path: str) -> Tuple:
    try:
        return mindspeed_llm_facts(mla_path)
    except (OSError, SyntaxError) as exc:
        return (f"unreadable: {exc}",)


def describe(facts: Tuple) -> str:
    names = ("should_recompute_mla_up_proj", "_dsa_index_share", "mla_scale_kv_lora",
             "get_mla_self_attn_submodules", "rope de-interleave for")
    if len(facts) != len(names):
        return str(facts)
    parts = [f"{'+' if have else '-'}{name}" for name, have in zip(names[:4], facts[:4])]
    return ", ".join(parts + [f"{names[4]} {list(facts[4])}"])


def installed_release() -> Release:
    """The release of the importable MindSpeed-LLM and MindSpeed (not imported)."""
    llm = package_dir("mindspeed_llm")
    if llm is None:
        raise UnknownHostRelease(f"MindSpeed-LLM is not importable; tested: {tested()}")
    return identify(llm, package_dir("mindspeed"))


def release_of_forward(forward) -> Release:
    """The release whose MLA module defines ``forward`` (MindSpeed-LLM's own, unwrapped)."""
    import inspect
    source = inspect.getsourcefile(inspect.unwrap(forward))
    return identify_mindspeed_llm(source)


# --- the differences, as the forward applies them -------------------------------------------

def deinterleave_rope_dims(x):
    """[..., d] with the rope pairs (x0, x1), (x2, x3), ... -> (x0, x2, ..., x1, x3, ...):
    what the 2.x forwards do to q_pos_emb and k_pos_emb before rope (yarn/plm
    checkpoints keep the rope dims interleaved)."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
