#!/usr/bin/env bash
# CPU demo: a tiny megatron-core MLA GPT trained with torchrun over gloo.
#
#   LAGA=1 scripts/train_tiny_cpu.sh                  # LAGA patch, allgather CP, 2 ranks
#   LAGA=0 scripts/train_tiny_cpu.sh                  # megatron's own MLA forward
#   LAGA=1 NPROC=4 CP_ALGO=ulysses scripts/train_tiny_cpu.sh
#   LAGA=1 FORM=explicit scripts/train_tiny_cpu.sh    # explicit core through the same patch
#   LAGA=1 NPROC=4 CP_ALGO=hybrid ULYSSES_DEGREE=2 scripts/train_tiny_cpu.sh
#
# Extra arguments go to train_tiny_cpu.py (e.g. --steps 10 --tp 2).
set -euo pipefail

LAGA=${LAGA:-1}
NPROC=${NPROC:-2}
CP_ALGO=${CP_ALGO:-allgather}
FORM=${FORM:-laga}
PYTHON=${PYTHON:-python}

fail() { echo "train_tiny_cpu: error: $*" >&2; exit 2; }
case "$LAGA" in 0 | 1) ;; *) fail "LAGA=$LAGA: must be 0 or 1" ;; esac
case "$NPROC" in '' | *[!0-9]* | 0*) fail "NPROC=$NPROC: must be a positive integer" ;; esac
command -v "$PYTHON" >/dev/null || fail "PYTHON=$PYTHON: not a command (the Python with torch and megatron-core)"
# CP_ALGO, FORM and ULYSSES_DEGREE are checked by train_tiny_cpu.py's parser (--check-world)

args=(--cp-algo "$CP_ALGO" --form "$FORM")
if [[ "$LAGA" == "1" ]]; then
    args+=(--laga)
fi
if [[ -n "${ULYSSES_DEGREE:-}" ]]; then
    args+=(--ulysses-degree "$ULYSSES_DEGREE")
fi

# The configuration is checked first (one line naming the problem), before torchrun starts.
"$PYTHON" "$(dirname "$0")/train_tiny_cpu.py" --check-world "$NPROC" "${args[@]}" "$@"
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
    "$(dirname "$0")/train_tiny_cpu.py" "${args[@]}" "$@"
