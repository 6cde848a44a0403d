"""``doctor``'s report: the printed summary and the Markdown a user attaches to an issue on
the project's issue tracker (environment, LAGA paths, exactness, CP and bench tables),
from the JSON document."""
from __future__ import annotations

import sys
from typing import List

from .output import MiB


def _err(value) -> str:
    return "-" if value is None else f"{value:.2e}"


def _ratio(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _peak(value) -> str:
    return "n/a" if value is None else f"{value / MiB:.1f}"


def _opts(options: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in options.items()) or "-"


def _table(header: List[str], rows: List[List[str]]) -> List[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in rows]
    return lines


def exactness_table(rows: List[dict]) -> List[str]:
    return _table(
        ["check", "form", "kernel", "dtype", "shape", "options", "documents", "V", "max rel err",
         "tolerance", "result"],
        [["lse merge" if r["kind"] == "lse_merge" else "vs float64", r["form"], r["kernel"],
          r["dtype"], r["shape"], _opts(r["options"]),
          "/".join(map(str, r["documents"])) if r["documents"] else "-",
          "-" if r["pad_v"] is None else ("padded" if r["pad_v"] else "unpadded"),
          _err(r["max_rel_err"]), f"{r['tolerance']:.1e}",
          r["status"] + (f": {r['error']}" if r.get("error") else "")] for r in rows])


def cp_table(rows: List[dict]) -> List[str]:
    return _table(
        ["variant", "cp_algo", "layout", "dtype", "fwd bytes", "bwd bytes", "explicit/form fwd",
         "explicit/form bwd", "max rel err", "result"],
        [[r["variant"], r["cp_algo"], r["layout"], r["dtype"], f"{r['forward_bytes']:,}",
          f"{r['backward_bytes']:,}", _ratio(r["explicit_over_form_forward"]),
          _ratio(r["explicit_over_form_backward"]), _err(r["max_rel_err"]),
          "pass" if r["passed"] else "FAIL"] for r in rows])


def bench_table(rows: List[dict]) -> List[str]:
    return _table(
        ["variant", "cp_algo", "S", "dtype", "fwd+bwd ms", "peak MiB", "saved MiB", "fwd bytes",
         "bwd bytes", "explicit/form fwd", "explicit/form bwd"],
        [[r["variant"], r["cp_algo"], r["seq_len"], r["dtype"], f"{r['ms']:.2f}", _peak(r["peak_bytes"]),
          f"{r['saved_bytes'] / MiB:.1f}", f"{r['forward_bytes']:,}", f"{r['backward_bytes']:,}",
          _ratio(r["explicit_over_form_forward"]), _ratio(r["explicit_over_form_backward"])]
         for r in rows])


def notes(saved_column: bool) -> str:
    """What the tables' columns are; ``saved_column``: the table has one (the Markdown's
    bench table; the printed one does not)."""
    saved = ("saved: activations autograd keeps in the attention call, rank 0; "
             if saved_column else "")
    return ("bytes: rank 0's payload handed to the collectives, per direction (handshake "
            "excluded); ms: slowest rank's median fwd+bwd; peak: max_memory_allocated during "
            "fwd+bwd above the inputs, worst rank (on CPU the allocator's peak from the torch "
            "profiler's memory events, one extra untimed pass); " + saved + "max rel err: worst "
            "of the output and every grad, max |got - ref| / max |ref|.")


NOTES = notes(saved_column=True)


def markdown(doc: dict) -> str:
    run = doc["run"]
    verdict = "PASS" if doc["passed"] else "FAIL"
    lines = [f"# mindspeed-laga doctor: {verdict}", "",
             f"Exactness on `{run['exactness_device']}`; CP on {run['cp']}; "
             f"{run['seconds']} s.", "", "## Environment", ""]
    lines += _table(["what", "value"], [[k, "-" if v is None else v] for k, v in doc["environment"].items()])
    lines += ["", "## LAGA paths on this node", ""]
    lines += _table(["path", "status"], [[k, v] for k, v in doc["laga_paths"].items()])
    failed = [r for r in doc["exactness"] if not r["passed"]]
    lines += ["", f"## Exactness on the device ({len(doc['exactness']) - len(failed)}/"
              f"{len(doc['exactness'])} pass)", "",
              "Each form, kernel and LAGA option without CP against a float64 CPU reference "
              "(output and every grad); *lse merge*: several key blocks against one.", ""]
    lines += exactness_table(doc["exactness"])
    lines += ["", f"## Context parallelism (S={run['check_seq_len']}, CP={run['cp_size']})", ""]
    lines += cp_table(doc["cp"])
    if doc["bench"]:
        lines += ["", f"## Bench (S={run['bench_seq_len']}, {run['repeat']} timed runs after "
                  f"{run['warmup']} warm-up)", ""]
        lines += bench_table(doc["bench"])
    for phase, text in doc.get("errors", {}).items():
        lines += ["", f"## Error in the {phase} runs", "", "```", text.strip()[-4000:], "```"]
    lines += ["", NOTES, ""]
    return "\n".join(lines)


def print_summary(doc: dict, out=None) -> None:
    out = out or sys.stdout
    env = doc["environment"]
    print("\nenvironment:", file=out)
    for k, v in env.items():
        print(f"  {k:<15} {v if v is not None else '-'}", file=out)
    print("LAGA paths:", file=out)
    for k, v in doc["laga_paths"].items():
        print(f"  {k:<40} {v}", file=out)
    _print_failures("exactness", doc["exactness"], out)
    print(f"\nCP ({doc['run']['cp']}):", file=out)
    print(f"  {'variant':<20} {'cp_algo':<9} {'dtype':<8} {'fwd bytes':>10} {'bwd bytes':>10} "
          f"{'expl/form':>9} {'max rel err':>11}", file=out)
    for r in doc["cp"]:
        print(f"  {r['variant']:<20} {r['cp_algo']:<9} {r['dtype']:<8} {r['forward_bytes']:>10,} "
              f"{r['backward_bytes']:>10,} {_ratio(r['explicit_over_form_forward']):>9} "
              f"{_err(r['max_rel_err']):>11}{'' if r['passed'] else '  FAIL'}", file=out)
    if doc["bench"]:
        print(f"\nbench (S={doc['run']['bench_seq_len']}):", file=out)
        print(f"  {'variant':<20} {'cp_algo':<9} {'ms':>9} {'peak MiB':>9} {'fwd bytes':>12} "
              f"{'bwd bytes':>12}", file=out)
        for r in doc["bench"]:
            print(f"  {r['variant']:<20} {r['cp_algo']:<9} {r['ms']:>9.2f} {_peak(r['peak_bytes']):>9} "
                  f"{r['forward_bytes']:>12,} {r['backward_bytes']:>12,}", file=out)
    for phase, text in doc.get("errors", {}).items():
        print(f"\nERROR in the {phase} runs:\n{text.strip()[-4000:]}", file=out)
    print(f"\n{notes(saved_column=False)}", file=out)
    print("PASS: LAGA is exact on this node" if doc["passed"] else
          "FAIL: see the rows marked FAIL/error above", file=out)


def _print_failures(name: str, rows: List[dict], out) -> None:
    bad = [r for r in rows if not r["passed"]]
    na = [r for r in rows if r["status"] == "n/a"]
    print(f"\n{name}: {len(rows) - len(bad)}/{len(rows)} pass"
          + (f" ({len(na)} n/a: not a path on this device, see the report)" if na else ""), file=out)
    for r in bad:
        print(f"  {r['status']}: {r['label']}: max rel err {_err(r['max_rel_err'])} > "
              f"{r['tolerance']:.1e}" + (f" ({r['error']})" if r.get("error") else ""), file=out)

