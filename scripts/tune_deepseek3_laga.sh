#!/bin/bash
# DeepSeek-V3 (671B) LoRA fine-tuning (SFT, 16k) on Ascend with context parallelism, with or
# without LAGA.
#
# MindSpeed-LLM's examples/mcore/deepseek3/tune_deepseek3_671b_16k_lora_A3_ptd.sh (the stock
# recipe that ships with CP > 1: TP 1, PP 8, EP 16, CP 2 ulysses_cp_algo, --finetune
# --stage sft --is-instruction-dataset, LoRA r 8 / alpha 16 --lora-fusion, full
# recompute), flag for flag, except:
#   - LAGA=1 (default) adds --mla-latent-all-gather and launches through
#     `-m mindspeed_laga.launch`, the one-line change docs/INTEGRATION.md describes;
#   - CP_TYPE may be kvallgather_cp_algo or megatron_cp_algo too (CP=1: the flag is a
#     logged no-op);
#   - LORA_TARGETS replaces --lora-target-modules (every MLA linear works with LAGA,
#     linear_kv_up_proj included: LAGA rebuilds K/V from base + LoRA delta);
#   - PADDING_SIDE=left adds --tokenizer-padding-side left; PACKED=1 trains packed
#     samples (data made with preprocess_data.py --pack) with --reset-attention-mask;
#   - LAGA's options (LAGA_RECOMPUTE, LAGA_BLOCK, LAGA_TRIM, LAGA_OVERLAP) and
#     ULYSSES_DEGREE work as in pretrain_deepseek3_laga.sh (scripts/deepseek3_common.sh).
#
# Run from the MindSpeed-LLM checkout (or set MINDSPEED_LLM_DIR), with mindspeed-laga
# installed (pip install -e <mindspeed-laga>) in the same environment:
#   LAGA=1 bash /path/to/mindspeed-laga/scripts/tune_deepseek3_laga.sh
#   LAGA=0 bash ...            # the same run on MindSpeed's own CP attention
#   DRY_RUN=1 bash ...         # print the command (one flag a line) instead of running it
# Environment values and extra arguments are checked before anything launches, as in
# pretrain_deepseek3_laga.sh.
set -eo pipefail

export CUDA_DEVICE_MAX_CONNECTIONS=1
export PYTORCH_NPU_ALLOC_CONF=expandable_segments:True
export HCCL_CONNECT_TIMEOUT=3600
export HCCL_EXEC_TIMEOUT=3600

NPUS_PER_NODE=${NPUS_PER_NODE:-16}
MASTER_PORT=${MASTER_PORT:-6005}
NNODES=${NNODES:-8}

LAGA_FIXED="TP=1 PP=8 EP=16 GBS=128 MBS=1"  # the recipe's layout (another value: refused)
SEQ_LEN=${SEQ_LEN:-16384}   # a multiple of 2*CP (zigzag) and of CP (ulysses)
LORA_TARGETS=${LORA_TARGETS-linear_qkv linear_proj linear_fc1 linear_fc2}
PADDING_SIDE=${PADDING_SIDE:-right}
PACKED=${PACKED:-0}
LAGA_SWITCHES="PACKED"  # checked 0 or 1 with LAGA's own (deepseek3_common.sh)
LAGA_DOCUMENTS_SWITCH=PACKED  # packed documents: the CP checks depend on them

# shellcheck source=deepseek3_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/deepseek3_common.sh"
case "$PADDING_SIDE" in
    left | right) ;;
    *) laga_fail "PADDING_SIDE=$PADDING_SIDE: must be left or right" ;;
esac
# module names, space-separated (--lora-target-modules takes one name an argument)
[[ $LORA_TARGETS =~ ^[A-Za-z_][A-Za-z0-9_.]*( +[A-Za-z_][A-Za-z0-9_.]*)*$ ]] ||
    laga_fail "LORA_TARGETS='$LORA_TARGETS': give module names separated by spaces (letters, digits, _ and .), e.g. 'linear_qkv linear_proj'"

# --prompt-type twice, as the stock recipe passes it
TUNE_ARGS="
    --finetune \
    --stage sft \
    --is-instruction-dataset \
    --handler-name AlpacaStyleInstructionHandler \
    --prompt-type deepseek3 \
    --prompt-type deepseek3 \
    --lora-r 8 \
    --lora-alpha 16 \
    --lora-fusion \
    --lora-target-modules ${LORA_TARGETS} \
    --moe-token-dispatcher-type alltoall_seq \
    --moe-alltoall-overlap-comm \
    --reuse-fp32-param \
    --shape-order BNSD \
    --lr-warmup-iters 1 \
    --log-throughput
"
[ "$PADDING_SIDE" != "right" ] && TUNE_ARGS="$TUNE_ARGS --tokenizer-padding-side $PADDING_SIDE"
[ "$PACKED" = "1" ] && TUNE_ARGS="$TUNE_ARGS --reset-attention-mask"

# shellcheck disable=SC2086
deepseek3_launch posttrain_gpt.py "tune_deepseek3_671b_16k_lora_cp${CP}_laga${LAGA}.log" $TUNE_ARGS
