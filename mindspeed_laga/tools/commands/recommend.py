"""``plan``'s answer: one CP algorithm (and U for hybrid) and one set of LAGA options for the
configuration asked, with what it saves against the host's explicit path (bytes sent, saved
activations, time) and why.

Chosen from the cost model's per-layer fwd+bwd time (fused kernel, worst rank) on the link
the output names; among the candidates that fit the device (with --device-memory and
--num-layers); ties go to fewer options. The absorbed form is Megatron's inference form, not
a training option, so it is never recommended. Pure Python (no torch).
"""
from __future__ import annotations

import textwrap
from dataclasses import replace
from typing import Callable, List, Optional

from .. import costmodel as cm
from ..runspec import RunSpec

# The MindSpeed-LLM flags that turn each choice on (features/laga_args.py); the
# --context-parallel-algo value is the algorithm's own (``CPAlgo.host_algo``).
OPTION_FLAGS = {"trim_causal_prefix": "--mla-laga-trim-causal-prefix",
                "recompute_kv": "--mla-laga-recompute-kv",
                "kv_block_size": "--mla-laga-kv-block-size {}",
                "overlap": "--mla-laga-overlap"}
LAGA_FLAG = "--mla-latent-all-gather"
# The same choices as the variables the recipes read (scripts/deepseek3_common.sh).
OPTION_ENV = {"trim_causal_prefix": "LAGA_TRIM", "recompute_kv": "LAGA_RECOMPUTE",
              "kv_block_size": "LAGA_BLOCK", "overlap": "LAGA_OVERLAP"}


def validate(cfg: cm.Config) -> None:
    """The cost model's checks, then what MindSpeed with LAGA refuses at start-up of the
    flags this configuration would be trained with: no row plan recommends is refused."""
    cm.validate(cfg)
    if cfg.algo.takes_ulysses_degree and cfg.doc_lens:
        raise ValueError("hybrid CP with packed documents is not covered: under "
                         "--reset-attention-mask MindSpeed splits documents per ring, a layout "
                         "LAGA refuses; use allgather or ulysses")


def _label(cfg: cm.Config) -> str:
    return f"hybrid U={cfg.ulysses_degree}" if cfg.algo.takes_ulysses_degree else cfg.cp_algo


def training_flags(cfg: cm.Config, spec: RunSpec) -> str:
    """The pretrain script's flags for ``spec`` under ``cfg``'s algorithm."""
    if not cfg.algo.host_algo:
        return f"none (no MindSpeed --context-parallel-algo runs {cfg.cp_algo})"
    flags = [f"--context-parallel-algo {cfg.algo.host_algo}"]
    if cfg.algo.takes_ulysses_degree:
        flags.append(f"--ulysses-degree-in-cp {cfg.ulysses_degree}")
    if spec.form == "laga":
        flags.append(LAGA_FLAG)
        flags += [OPTION_FLAGS[k].format(v) for k, v in spec.option_items()]
    return " ".join(flags)


def recipe_env(cfg: cm.Config, spec: RunSpec) -> Optional[str]:
    """The same choice as the recipes' environment variables (``CP=16 CP_TYPE=... LAGA=1
    ...``), None for an algorithm no MindSpeed --context-parallel-algo runs."""
    if not cfg.algo.host_algo:
        return None
    env = [f"CP={cfg.cp_size}", f"CP_TYPE={cfg.algo.host_algo}"]
    if cfg.algo.takes_ulysses_degree:
        env.append(f"ULYSSES_DEGREE={cfg.ulysses_degree}")
    env += [f"SEQ_LEN={cfg.seq_len}", f"LAGA={int(spec.form == 'laga')}"]
    if spec.form == "laga":
        env += [f"{OPTION_ENV[k]}={int(v) if isinstance(v, bool) else v}" for k, v in spec.option_items()]
    return " ".join(env)


def _option(cfg: cm.Config, spec: RunSpec, timer: Callable) -> dict:
    summary = cm.summarize(cfg, spec)
    t = timer(cfg, summary)
    return {"cfg": cfg, "spec": spec, "total_s": t.total_s, "compute_s": t.compute_s,
            "comm_s": t.comm_s, "hidden_s": t.hidden_s,
            "wire_bytes": summary.comm_bytes("forward", "wire") + summary.comm_bytes("backward", "wire"),
            "saved_bytes": summary.saved_worst, "peak_bytes": summary.peak_worst}


def _order(o: dict):
    """Fastest first; equal times: fewer options (laga+trim where trimming changes nothing)."""
    return (round(o["total_s"], 12), len(o["spec"].option_items()))


def recommend(candidates: List[cm.Config], variants: List[RunSpec], timer: Callable, basis: str,
              device_bytes: Optional[float] = None, layers: Optional[int] = None) -> dict:
    """The recommendation over ``candidates`` (validated configs, one per algorithm and U),
    timed by ``timer(cfg, summary)`` on ``basis`` (the link's description)."""
    kinds = [replace(v, query_projection=False) for v in variants if v.form != "absorbed"]
    options = [_option(replace(c, kernel=cm.FUSED), v, timer) for c in candidates for v in kinds]
    fits = [o for o in options if device_bytes is None or o["saved_bytes"] * layers <= device_bytes]
    pool = fits or options
    best = min(pool, key=_order)
    same_algo = [o for o in options if o["cfg"] == best["cfg"]]
    explicit = next(o for o in same_algo if o["spec"].form == "explicit")
    host_best = min((o for o in options if o["spec"].form == "explicit"), key=_order)
    others = [min((o for o in pool if o["cfg"] == c), key=_order, default=None) for c in candidates
              if c != best["cfg"]]
    lean = min(same_algo, key=lambda o: (o["saved_bytes"], o["total_s"]))
    return {"basis": basis, "best": best, "explicit": explicit, "host_best": host_best,
            "runner_up": min((o for o in others if o), key=_order, default=None),
            "lean": lean if lean["saved_bytes"] < best["saved_bytes"] else None,
            "fits": bool(fits), "layers": layers, "device_bytes": device_bytes,
            "cp_size": best["cfg"].cp_size}


def as_json(rec: dict) -> dict:
    def row(o):
        if o is None:
            return None
        return {"cp_algo": o["cfg"].cp_algo, "ulysses_degree": o["cfg"].ulysses_degree,
                "variant": o["spec"].name, "flags": training_flags(o["cfg"], o["spec"]),
                "recipe_env": recipe_env(o["cfg"], o["spec"]),
                **{k: o[k] for k in ("total_s", "compute_s", "comm_s", "hidden_s", "wire_bytes",
                                     "saved_bytes", "peak_bytes")}}
    return {"basis": rec["basis"], "fits": rec["fits"], "layers": rec["layers"],
            **{k: row(rec[k]) for k in ("best", "explicit", "host_best", "runner_up", "lean")}}


# ---------------------------------------------------------------- why, in words

def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.2f} ms"


def _gain(old_s: float, new_s: float) -> str:
    return f"{'saves' if new_s <= old_s else 'costs'} {_ms(abs(old_s - new_s))}"


def _fit(rec: dict, o: dict, fmt_bytes: Callable) -> str:
    """'' without a fit check, else what ``o`` needs for the layers and whether it fits."""
    if rec["device_bytes"] is None:
        return ""
    need = o["saved_bytes"] * rec["layers"]
    return f", {fmt_bytes(need)} for {rec['layers']} layers: {'fits' if need <= rec['device_bytes'] else 'DOES NOT FIT'}"


def _say(text: str, indent: str, width: int) -> None:
    print(textwrap.fill(text, width, initial_indent=indent, subsequent_indent=indent + "  ",
                        break_on_hyphens=False))


def _split(o: dict) -> str:
    hidden = f", {_ms(o['hidden_s'])} of it hidden" if o["hidden_s"] else ""
    return f"compute {_ms(o['compute_s'])} + comm {_ms(o['comm_s'])}{hidden}"


def _why_algo(best: dict, other: Optional[dict]) -> Optional[str]:
    if other is None:
        return None
    b, o = best, other
    comm_gain = (o["comm_s"] - o["hidden_s"]) - (b["comm_s"] - b["hidden_s"])
    compute_gain = o["compute_s"] - b["compute_s"]
    if _order(o)[0] == _order(b)[0]:  # the same time: neither decides
        decides = "a tie, the same time; the one with fewer options, then the first listed, is shown"
    else:
        decides = "less communication" if comm_gain >= compute_gain else "less compute on its worst rank"
    return (f"{_label(b['cfg'])} over {_label(o['cfg'])} ({o['spec'].name}, {_ms(o['total_s'])}): "
            f"{decides} ({_split(b)}; {_label(o['cfg'])}: {_split(o)})")


def _why_variant(best: dict, explicit: dict, limited: bool) -> str:
    spec = best["spec"]
    if spec.form == "explicit":
        return ("LAGA does not pay here: rebuilding K/V for every gathered key costs more compute "
                f"than the bytes it saves ({_split(best)}; best LAGA is slower)")
    parts = [f"the latent crosses the link instead of per-head K/V ({_split(best)}; explicit: "
             f"{_split(explicit)})"]
    if spec.overlap:
        parts.append("overlap hides the latent gather behind the query projection")
    if spec.trim_causal_prefix:
        parts.append("trimming rebuilds only the keys a rank's queries see")
    if spec.recompute_kv:
        parts.append("recomputing K/V in backward keeps only the latent"
                     + (", which the memory limit needs" if limited else ""))
    return "; ".join(parts)


def _per_iteration(rec: dict, b: dict, ex: dict, fmt_bytes: Callable) -> str:
    """The per-layer figures times the layers one device holds (--num-layers)."""
    n = rec["layers"]
    return (f"per iteration ({n} layers, fwd+bwd, one micro-batch): {_ms(n * b['total_s'])}, "
            f"{fmt_bytes(n * b['wire_bytes'])} sent, {fmt_bytes(n * b['saved_bytes'])} of "
            f"saved activations (explicit: {_ms(n * ex['total_s'])}, "
            f"{fmt_bytes(n * ex['wire_bytes'])}, {fmt_bytes(n * ex['saved_bytes'])})")


def print_recommendation(rec: dict, fmt_bytes: Callable, width: int) -> None:
    b, ex, host = rec["best"], rec["explicit"], rec["host_best"]

    def say(text, indent):
        _say(text, indent, width)
    print()
    if rec["cp_size"] == 1:
        say("recommendation: CP=1 exchanges nothing, so LAGA has nothing to save: keep the host's "
            "attention (leave --mla-latent-all-gather off).", "")
        return
    say(f"recommendation ({rec['basis']}): {b['spec'].name} with cp_algo={_label(b['cfg'])}", "")
    say(f"flags: {training_flags(b['cfg'], b['spec'])}", "  ")
    env = recipe_env(b["cfg"], b["spec"])
    if env:
        say(f"recipe variables (scripts/pretrain_deepseek3_laga.sh reads them): {env}", "  ")
    if rec["layers"]:
        say(_per_iteration(rec, b, ex, fmt_bytes), "  ")
    if b["spec"].form == "laga":
        dt = ex["total_s"] - b["total_s"]
        say(f"against the host's explicit path ({_label(ex['cfg'])}): time {_ms(b['total_s'])} vs "
            f"{_ms(ex['total_s'])} per layer fwd+bwd ({_gain(ex['total_s'], b['total_s'])}, "
            f"{100 * abs(dt) / ex['total_s']:.0f}%); bytes sent "
            f"{fmt_bytes(b['wire_bytes'])} vs {fmt_bytes(ex['wire_bytes'])} "
            f"({ex['wire_bytes'] / b['wire_bytes']:.2f}x fewer); saved activations "
            f"{fmt_bytes(b['saved_bytes'])} vs {fmt_bytes(ex['saved_bytes'])} "
            f"({'saves' if b['saved_bytes'] <= ex['saved_bytes'] else 'adds'} "
            f"{fmt_bytes(abs(ex['saved_bytes'] - b['saved_bytes']))}{_fit(rec, b, fmt_bytes)}"
            f"{'; explicit' + _fit(rec, ex, fmt_bytes) if rec['device_bytes'] else ''})", "  ")
        if host is not ex:
            say(f"the host's fastest explicit setting here is cp_algo={_label(host['cfg'])} "
                f"({_ms(host['total_s'])}{_fit(rec, host, fmt_bytes)}): the recommendation "
                f"{_gain(host['total_s'], b['total_s'])} against it", "  ")
    say(f"why: {_why_variant(b, ex, rec['device_bytes'] is not None)}", "  ")
    algo = _why_algo(b, rec["runner_up"])
    if algo:
        say(f"why {algo}", "  ")
    if rec["lean"] is not None:
        le = rec["lean"]
        say(f"short of memory: {le['spec'].name} keeps {fmt_bytes(le['saved_bytes'])} of activations "
            f"({fmt_bytes(b['saved_bytes'] - le['saved_bytes'])} less) at {_ms(le['total_s'])} "
            f"(+{_ms(le['total_s'] - b['total_s'])})", "  ")
    if not rec["fits"]:
        say(f"nothing fits {rec['layers']} layers in the device memory: the row above is the fastest; "
            "the fit lines above list each form's share", "  ")
