"""The MindSpeed-LLM releases LAGA's MindSpeed-LLM adapter is tested with, told apart
by the host's own source, and the small differences of their MLA forward.

MindSpeed-LLM and MindSpeed declare no release version (their ``setup.py``
versions are placeholders that no release changes, and an installed source
records no commit), so a release is named by the facts of its pair, read
without importing it (importing MindSpeed-LLM patches Megatron):

- MindSpeed-LLM: from ``mindspeed_llm/tasks/models/transformer/multi_latent_attention.py``,
  parsed, which of :data:`LLM_NAMES` ``CustomMLASelfAttention`` and its module
  define, and the rope types it de-interleaves (see :func:`mindspeed_llm_facts`);
- MindSpeed: which of the files :data:`MINDSPEED_FILES` names exist.

Each release is a pair (a MindSpeed-LLM branch and the MindSpeed branch it
names), identified by both facts together: two releases may share an MLA
module as long as their pairs differ. A fact is a name a row lists (a new
fact edits only the rows that have it); a host whose pair matches no tested
release is refused, naming the pairs.

A release whose pair shows exactly another's facts (a patch release that left the MLA
module and MindSpeed's files alone) is declared ``same_as`` that release: it takes the
other's facts and differences, and no fact can tell the two apart. So what the source
identifies is a set of facts, named by the release that owns them, and a host is
reported by that (:meth:`Release.found`: "matches 26.1.0's MLA facts"), never as one
release of the set: an unlisted newer pair with the same facts is the same case.

What differs in the MLA forward LAGA reproduces is a field of :class:`Release`
(``lora_scales``, ``rope_deinterleave``, ``documents_refused``, ``index_share``); the forward
itself (patches/mindspeed_llm/forward.py) is one for all releases.
"""
from __future__ import annotations

import ast
import functools
import importlib.util
import os
from dataclasses import dataclass, fields, replace
from typing import Dict, FrozenSet, List, NamedTuple, Optional, Tuple

MLA_MODULE = os.path.join("tasks", "models", "transformer", "multi_latent_attention.py")
MLA_CLASS = "CustomMLASelfAttention"

# MindSpeed: files that appeared branch by branch (relative to the mindspeed package), by
# the name a release row lists when its MindSpeed has the file
MINDSPEED_FILES = {
    "auto_settings": os.path.join("auto_settings", "mindspeed_adaptor", "__init__.py"),  # 2.3.0 on
    "dist_checkpointing": os.path.join("core", "dist_checkpointing", "__init__.py"),  # 26.0.0 on
    "hccl_op_mode": os.path.join("core", "hccl_buffer", "hccl_op_mode_adaptor.py"),  # 26.1.0 on
    "distill": os.path.join("core", "distill", "__init__.py"),  # master (028de58c)
}
# MindSpeed-LLM: names its MLA module may define, and how (the module imports it, the class
# assigns ``self.<name>``, or the module defines the function), in the order the error
# messages list them: the up-projection's recompute gate, shared DSA indices, the kv latent's
# scale, the submodule builder
LLM_NAMES = {"should_recompute_mla_up_proj": "imports", "_dsa_index_share": "assigns",
             "mla_scale_kv_lora": "assigns", "get_mla_self_attn_submodules": "defines"}


class LLMFacts(NamedTuple):
    """What a MindSpeed-LLM release's MLA module shows (:func:`mindspeed_llm_facts`)."""
    defines: FrozenSet[str]              # which of LLM_NAMES it defines
    rope_deinterleaved: Tuple[str, ...] = ()  # rope types the forward de-interleaves


def defines(*names: str, rope_deinterleaved: Tuple[str, ...] = ()) -> LLMFacts:
    """A row's MindSpeed-LLM facts: the names of :data:`LLM_NAMES` its MLA module defines."""
    _known(names, LLM_NAMES)
    return LLMFacts(frozenset(names), tuple(sorted(rope_deinterleaved)))


def has_files(*files: str) -> FrozenSet[str]:
    """A row's MindSpeed facts: the names of :data:`MINDSPEED_FILES` its MindSpeed has."""
    _known(files, MINDSPEED_FILES)
    return frozenset(files)


def _known(names, known) -> None:
    unknown = sorted(set(names) - set(known))
    if unknown:  # a typo in a row would silently never match
        raise ValueError(f"release facts {unknown} are not among {list(known)}")


@dataclass(frozen=True)
class Release:
    """One tested MindSpeed-LLM release with the MindSpeed branch it pairs with."""
    name: str
    mindspeed_llm_commit: str
    mindspeed_branch: str
    mindspeed_commit: str
    cann: Optional[str]  # the CANN and torch_npu the release names (master: none)
    torch_npu: Optional[str]
    # what the host's source shows (mindspeed_llm_facts / mindspeed_facts): together they
    # identify the release (None with ``same_as``: the other's)
    llm_facts: Optional[LLMFacts] = None
    mindspeed_facts: Optional[FrozenSet[str]] = None
    # the release whose facts and differences this one has, all of them (the row gives
    # only its commits and versions; resolved in RELEASES)
    same_as: Optional[str] = None
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
    # the DSA layers may reuse an earlier layer's top-k picks (--index-topk-freq,
    # --index-skip-topk-offset, --index-topk-pattern: its module's _dsa_index_share)
    index_share: bool = False

    def archives(self) -> Tuple[str, str]:
        """The names of its MindSpeed-LLM and MindSpeed source archives (the tests' host
        sources): the release (none for master) and the commit."""
        tag = "" if self.name == "master" else f"{self.name}-"
        return (f"mindspeed-llm-{tag}{self.mindspeed_llm_commit}.tar.gz",
                f"mindspeed-{tag}{self.mindspeed_commit}.tar.gz")

    def label(self) -> str:
        return (f"MindSpeed-LLM {self.name} ({self.mindspeed_llm_commit}) with MindSpeed "
                f"{self.mindspeed_branch} ({self.mindspeed_commit})")

    @property
    def facts_owner(self) -> str:
        """The release that names this one's facts (itself, or the one it is the same as)."""
        return self.same_as or self.name

    def found(self) -> str:
        """What identifying a host as this release can say (the source shows facts, not a
        release): the facts' owner and every tested release that has them."""
        sharing = [r.label() for r in RELEASES if r.facts_owner == self.facts_owner]
        return (f"found a MindSpeed-LLM / MindSpeed pair matching {self.facts_owner}'s MLA facts "
                f"(tested with them: {'; '.join(sharing)})")

    def facts(self) -> str:
        """Its pair of facts in words: what a host identified as it shows (two releases
        with the same facts are the same host to every check)."""
        return (f"MindSpeed-LLM {describe(self.llm_facts)}; MindSpeed "
                f"{', '.join(sorted(self.mindspeed_facts)) or 'none of ' + str(list(MINDSPEED_FILES))}")

    def deinterleaves(self, rope_scaling_type) -> bool:
        return rope_scaling_type in self.rope_deinterleave

    def takes_documents(self, cp_algo: str) -> bool:
        return self.document_algos is None or cp_algo in self.document_algos


ROWS = (
    Release("master", "c77308a1", "master", "028de58c", None, None,
            llm_facts=defines("should_recompute_mla_up_proj", "_dsa_index_share",
                              "mla_scale_kv_lora", "get_mla_self_attn_submodules"),
            mindspeed_facts=has_files("auto_settings", "dist_checkpointing", "hccl_op_mode",
                                      "distill"), index_share=True),
    Release("26.1.0", "ad615b3b", "26.1.0_core_r0.12.1", "57a33053", "9.1.0", "26.1.0",
            llm_facts=defines("_dsa_index_share", "mla_scale_kv_lora", "get_mla_self_attn_submodules"),
            mindspeed_facts=has_files("auto_settings", "dist_checkpointing", "hccl_op_mode"),
            index_share=True),
    Release("26.0.0", "4a035628", "26.0.0_core_r0.12.1", "3c44c134", "9.0.0", "26.0.0",
            llm_facts=defines("mla_scale_kv_lora", "get_mla_self_attn_submodules"),
            mindspeed_facts=has_files("auto_settings", "dist_checkpointing")),
    Release("2.3.0", "62d4640b", "2.3.0_core_r0.12.1", "674226a1", "8.5.0", "7.3.0",
            llm_facts=defines("get_mla_self_attn_submodules", rope_deinterleaved=("plm", "yarn")),
            mindspeed_facts=has_files("auto_settings"),
            lora_scales=False, rope_deinterleave=("yarn", "plm"),
            document_algos=("megatron_cp_algo",),
            documents_refused=(
                "its MindSpeed splits packed documents per document (zigzag, after padding) "
                "for every CP algorithm, which only megatron_cp_algo's attention follows")),
    Release("2.2.0", "337813b0", "2.2.0_core_r0.12.1", "a654440c", "8.3.RC1", "7.2.0",
            llm_facts=defines(rope_deinterleaved=("yarn",)),
            mindspeed_facts=has_files(),
            lora_scales=False, rope_deinterleave=("yarn",), document_algos=(),
            documents_refused=(
                "its MLA forward hands rope packed_seq_params.cu_seqlens_q (a tensor) while "
                "the THD rope its --reset-attention-mask feature installs reads "
                "cu_seqlens.position_ids, so the host itself cannot apply rope to packed "
                "documents")),
)


def _resolved(rows) -> Tuple[Release, ...]:
    """The rows with each ``same_as`` row given its release's facts and differences."""
    by_name = {r.name: r for r in rows}
    out = []
    for row in rows:
        if row.same_as is None:
            if row.llm_facts is None or row.mindspeed_facts is None:
                raise ValueError(f"release {row.name} needs llm_facts and mindspeed_facts, or "
                                 "same_as=<the release whose facts it has>")
            out.append(row)
            continue
        owner = by_name.get(row.same_as)
        if owner is None or owner.same_as is not None:
            raise ValueError(f"release {row.name}: same_as={row.same_as!r} must name a release "
                             f"row that lists its own facts ({[r.name for r in rows if not r.same_as]})")
        if row.llm_facts is not None or row.mindspeed_facts is not None:
            raise ValueError(f"release {row.name} is same_as={row.same_as!r}: it takes that "
                             "release's facts, so it lists none of its own")
        differences = {f.name: getattr(owner, f.name) for f in fields(Release)
                       if f.name not in _OWN_FIELDS}
        out.append(replace(row, **differences))
    return tuple(out)


# what a same_as row gives itself; every other field is its release's
_OWN_FIELDS = ("name", "mindspeed_llm_commit", "mindspeed_branch", "mindspeed_commit", "cann",
               "torch_npu", "same_as")
RELEASES = _resolved(ROWS)
BY_NAME: Dict[str, Release] = {r.name: r for r in RELEASES}


def owners() -> Tuple[Release, ...]:
    """The releases that own their facts: what identification can tell apart."""
    return tuple(r for r in RELEASES if r.same_as is None)


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
    found = {"imports": imported, "assigns": assigned, "defines": top_level}
    return LLMFacts(frozenset(n for n, how in LLM_NAMES.items() if n in found[how]),
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


def mindspeed_facts(mindspeed_package: str) -> FrozenSet[str]:
    return frozenset(name for name, path in MINDSPEED_FILES.items()
                     if os.path.isfile(os.path.join(mindspeed_package, path)))


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
    """The tested release that owns the pair of facts these packages show (a ``same_as``
    release is never the answer: report it with :meth:`Release.found`); raises
    UnknownHostRelease."""
    candidates = _llm_candidates(os.path.join(llm_package, MLA_MODULE))
    first = candidates[0]
    if mindspeed_package is None:
        raise UnknownHostRelease(f"MindSpeed-LLM {_names(candidates)} found but MindSpeed is not "
                                 f"importable; install MindSpeed {first.mindspeed_branch}")
    found = mindspeed_facts(mindspeed_package)
    matching = [r for r in candidates if r.mindspeed_facts == found]
    if not matching:
        paired = [r.mindspeed_branch for r in owners() if r.mindspeed_facts == found]
        raise UnknownHostRelease(
            f"MindSpeed-LLM {_names(candidates)} is tested with MindSpeed "
            f"{' or '.join(r.mindspeed_branch for r in candidates)}, but the "
            f"MindSpeed at {mindspeed_package} is "
            f"{('branch ' + paired[0]) if paired else 'none of the tested branches'}. Install "
            f"the pair (tested: {tested()})")
    if len(matching) > 1:  # rows no fact separates: a test keeps them apart (every pair differs)
        raise UnknownHostRelease(f"the host's facts match MindSpeed-LLM {_names(matching)}; "
                                 f"releases.py needs a fact that separates them")
    return matching[0]


def identify_mindspeed_llm(mla_path: str, mindspeed_package: Optional[str] = None) -> Release:
    """The release whose MLA module is ``mla_path``; where releases share that module, told
    apart by MindSpeed (``mindspeed_package``, else the importable one)."""
    candidates = _llm_candidates(mla_path)
    if len(candidates) == 1:
        return candidates[0]
    llm_package = os.path.realpath(mla_path)[:-len(MLA_MODULE) - 1]
    return identify(llm_package, mindspeed_package or package_dir("mindspeed"))


def _llm_candidates(mla_path: str) -> List[Release]:
    facts = _cached_facts(os.path.realpath(mla_path))
    found = [r for r in owners() if r.llm_facts == facts]
    if not found:
        raise UnknownHostRelease(
            f"the MindSpeed-LLM at {mla_path} is not a tested release (its MLA module shows "
            f"{describe(facts)}); LAGA's adapter is tested with: {tested()}")
    return found


def _names(releases) -> str:
    return " or ".join(r.name for r in releases)


@functools.lru_cache(maxsize=None)
def _cached_facts(mla_path: str) -> Tuple:
    try:
        return mindspeed_llm_facts(mla_path)
    except (OSError, SyntaxError) as exc:
        return (f"unreadable: {exc}",)


def describe(facts: Tuple) -> str:
    if not isinstance(facts, LLMFacts):
        return str(facts)
    parts = [f"{'+' if name in facts.defines else '-'}{name}" for name in LLM_NAMES]
    return ", ".join(parts + [f"rope de-interleave for {list(facts.rope_deinterleaved)}"])


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
