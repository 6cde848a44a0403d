#!/bin/bash
# DeepSeek-V3 (671B) pretraining on Ascend with context parallelism, with or without LAGA.
#
# MindSpeed-LLM's examples/mcore/deepseek3/pretrain_deepseek3_671b_4k_ptd.sh, flag for
# flag (packed documents with --reset-attention-mask included), except:
#   - CP=2 (CP_TYPE ulysses_cp_algo as upstream; kvallgather_cp_algo and megatron_cp_algo
#     also work with LAGA, and hybrid_cp_algo with ULYSSES_DEGREE=U and RESET_MASK=0),
#     so DP halves at the same world size;
#   - with CP > 1 the DualPipe group (--schedules-method dualpipev --moe-fb-overlap) is
#     left out: MindSpeed rejects dualpipev with context parallelism, and --moe-fb-overlap
#     with --noop-layers then needs a virtual pipeline;
#   - LAGA=1 (default) adds --mla-latent-all-gather and launches through
#     `-m mindspeed_laga.launch`, the one-line change docs/INTEGRATION.md describes.
#
# Run from the MindSpeed-LLM checkout (or set MINDSPEED_LLM_DIR), with mindspeed-laga
# installed (pip install -e <mindspeed-laga>) in the same environment:
#   LAGA=1 bash /path/to/mindspeed-laga/scripts/pretrain_deepseek3_laga.sh
#   LAGA=0 bash ...            # the same run on MindSpeed's own CP attention
#   DRY_RUN=1 bash ...         # print the command (one flag a line) instead of running it
#   bash ... --mla-laga-overlap   # extra arguments go to the launch (a flag the recipe
#                                 # passes is refused, naming the variable that sets it)
# Every environment value is checked before anything launches (DRY_RUN too): LAGA, DRY_RUN
# and the other switches 0 or 1; LAGA_KERNEL, TRANSFORMER_IMPL and CP_TYPE one of their
# choices; the integers (CP, SEQ_LEN, NNODES, NPUS_PER_NODE, NODE_RANK, MASTER_PORT,
# LAGA_BLOCK, ULYSSES_DEGREE) in range, no wrap-around; LAGA_BLOCK with LAGA_RECOMPUTE=1;
# CP dividing the heads (ulysses) and SEQ_LEN, TP*PP*CP the world size; ULYSSES_DEGREE
# with hybrid_cp_algo, 1 < U < CP dividing CP, and (LAGA=1) RESET_MASK=0. A run also
# checks the working directory, torchrun and mindspeed_laga, each in one line. TP, PP,
# EP, GBS and MBS are the recipe's: another value in the environment is refused; the
# paths (DATA_PATH, TOKENIZER_PATH, CKPT_*) are passed as one argument each.
set -eo pipefail

export CPU_AFFINITY_CONF=${CPU_AFFINITY_CONF:-1}
export CUDA_DEVICE_MAX_CONNECTIONS=1
export PYTORCH_NPU_ALLOC_CONF=expandable_segments:True
export TASK_QUEUE_ENABLE=2
export HCCL_OP_BASE_FFTS_MODE=TRUE
export HCCL_CONNECT_TIMEOUT=3600
export HCCL_EXEC_TIMEOUT=3600
export HCCL_ALGO="alltoall=level0:NA;level1:pipeline"
export HCCL_BUFFSIZE=400

NPUS_PER_NODE=${NPUS_PER_NODE:-8}
MASTER_PORT=${MASTER_PORT:-6000}
NNODES=${NNODES:-64}

LAGA_FIXED="TP=4 PP=8 EP=32 GBS=3840 MBS=1"  # the recipe's layout (TP=8 in the environment: refused)
RESET_MASK=${RESET_MASK:-1}          # packed documents, as upstream
SEQ_LEN=${SEQ_LEN:-4096}   # a multiple of 2*CP (zigzag) and of CP (ulysses)
LAGA_SWITCHES="RESET_MASK"  # checked 0 or 1 with LAGA's own (deepseek3_common.sh)
LAGA_DOCUMENTS_SWITCH=RESET_MASK  # packed documents: the CP checks depend on them

# shellcheck source=deepseek3_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/deepseek3_common.sh"

PRETRAIN_ARGS="
    --mla-fa-without-pad \
    --moe-router-dtype fp32 \
    --moe-token-dispatcher-type alltoall \
    --moe-permute-fusion \
    --moe-aux-loss-coeff 0.0001 \
    --expert-tensor-parallel-size 1 \
    --mtp-num-layers 1 \
    --mtp-loss-scaling-factor 0.3 \
    --gemm-gradient-accumulation-fusion \
    --manual-gc \
    --manual-gc-interval 50 \
    --swap-optimizer \
    --swap-optimizer-times 4 \
    --use-ascend-coc \
    --coc-fused-kernel \
    --lr-warmup-iters 500 \
    --handler-name GeneralPretrainHandler
"
[ "$RESET_MASK" = "1" ] && PRETRAIN_ARGS="$PRETRAIN_ARGS --reset-attention-mask"

DUALPIPE_ARGS="
    --moe-fb-overlap \
    --schedules-method dualpipev \
"
[ "$CP" -gt 1 ] && DUALPIPE_ARGS=""  # MindSpeed: dualpipev and context parallelism exclude

# shellcheck disable=SC2086
deepseek3_launch pretrain_gpt.py "pretrain_deepseek3_671b_4k_cp${CP}_laga${LAGA}.log" \
    $PRETRAIN_ARGS $DUALPIPE_ARGS
