#!/bin/bash
# DeepSeek-V3 long-context pretraining (128k tokens, CP 8 ulysses_cp_algo) on Ascend, with
# or without LAGA.
#
# MindSpeed-LLM's own 128k recipe (master: tests/poc/deepseek3_671b_64p_perf/
# pretrain_deepseek3_75.9b_128k_bf16_A5_ptd.sh: 6 layers of DeepSeek-V3's MLA and MoE on
# 8 nodes of 8, TP 1, PP 1, EP 64, CP 8, packed documents with --reset-attention-mask
# --attention-mask-type general --fix-sub-seq-length 16384, --shape-order BNSD,
# --mla-mm-split, --transformer-impl transformer_engine), flag for flag, except:
#   - LAGA=1 (default) adds --mla-latent-all-gather and launches through
#     `-m mindspeed_laga.launch`, the one-line change docs/INTEGRATION.md describes;
#     LAGAFeature checks the flags at start-up and names any it does not take;
#   - torchrun launches it (the recipe uses python -m torch.distributed.launch);
#   - CP, CP_TYPE, SEQ_LEN and LAGA's options (LAGA_RECOMPUTE, LAGA_BLOCK, LAGA_TRIM,
#     LAGA_OVERLAP, ULYSSES_DEGREE) work as in pretrain_deepseek3_laga.sh
#     (scripts/deepseek3_common.sh), their values checked before anything launches.
#
# Run from the MindSpeed-LLM checkout (or set MINDSPEED_LLM_DIR), with mindspeed-laga
# installed (pip install --no-deps -e <mindspeed-laga>) in the same environment:
#   LAGA=1 bash /path/to/mindspeed-laga/scripts/pretrain_deepseek3_128k_laga.sh
#   LAGA=0 bash ...            # the same run on MindSpeed's own CP attention
#   DRY_RUN=1 bash ...         # print the command (one flag a line) instead of running it
# Extra arguments, the layout (TP, PP, EP, GBS, MBS) and the paths are handled as in
# pretrain_deepseek3_laga.sh; CPU_AFFINITY_CONF is checked (MODE[,npuN:FIRST-LAST...]).
set -eo pipefail

export CUDA_DEVICE_MAX_CONNECTIONS=1
export CPU_AFFINITY_CONF=${CPU_AFFINITY_CONF:-1,npu0:192-215,npu1:216-239,npu2:0-23,npu3:24-47,npu4:48-71,npu5:72-95,npu6:240-263,npu7:264-287}
export TASK_QUEUE_ENABLE=2
export PYTORCH_NPU_ALLOC_CONF=expandable_segments:True
export HCCL_CONNECT_TIMEOUT=3600
export STREAMS_PER_DEVICE=32

NPUS_PER_NODE=${NPUS_PER_NODE:-8}
MASTER_PORT=${MASTER_PORT:-6001}
NNODES=${NNODES:-8}

# the recipe's layout (another value in the environment: refused)
LAGA_FIXED="TP=1 PP=1 EP=64 GBS=16 MBS=1 NUM_LAYERS=6 TRANSFORMER_IMPL=transformer_engine"
CP=${CP:-8}
SEQ_LEN=${SEQ_LEN:-131072}   # a multiple of 2*CP (zigzag) and of CP (ulysses)
LAGA_DOCUMENTS_SWITCH=general  # packed, --attention-mask-type general, always

# shellcheck source=deepseek3_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/deepseek3_common.sh"

# The recipe's own model and training flags replace the 671B recipes' shared ones; the CP
# flags, --save/--load, --transformer-impl and the backend come from deepseek3_launch.
MODEL_ARGS="
    --spec mindspeed_llm.tasks.models.spec.deepseek_spec layer_spec \
    $MLA_ARGS \
    --mla-fa-without-pad \
    --mla-mm-split \
    --moe-grouped-gemm \
    --moe-permutation-async-comm \
    --moe-token-dispatcher-type alltoall \
    --first-k-dense-replace 1 \
    --moe-layer-freq 1 \
    --moe-shared-expert-intermediate-size 2048 \
    --num-experts 128 \
    --moe-router-topk 8 \
    --moe-ffn-hidden-size 2048 \
    --moe-router-load-balancing-type seq_aux_loss \
    --moe-router-num-groups 8 \
    --moe-router-group-topk 4 \
    --moe-router-topk-scaling-factor 2.5 \
    --moe-aux-loss-coeff 0.0001 \
    --moe-router-score-function sigmoid \
    --moe-router-enable-expert-bias \
    --moe-router-dtype fp32 \
    --fix-router \
    --num-layers ${NUM_LAYERS} \
    --num-attention-heads ${NUM_HEADS} \
    $V3_SIZE_ARGS
"

TRAIN_ARGS="
    --disable-gloo-group \
    --hccl-op-mode cp:5;ep:2;tp_ep_mp:2;dp:2;tp_cp:2;dp_cp:2;default_group:2 \
    --no-check-for-nan-in-loss-and-grad \
    --fix-sub-seq-length 16384 \
    --reset-attention-mask \
    --attention-mask-type general \
    --manual-gc \
    --manual-gc-interval 50 \
    --use-distributed-optimizer \
    --use-flash-attn \
    --use-mcore-models \
    --tensor-model-parallel-size ${TP} \
    --pipeline-model-parallel-size ${PP} \
    --expert-model-parallel-size ${EP} \
    --sequence-parallel \
    --expert-tensor-parallel-size 1 \
    --tokenizer-type PretrainedFromHF \
    --seq-length ${SEQ_LEN} \
    --use-fused-swiglu \
    --use-fused-rmsnorm \
    --use-fused-rotary-pos-emb \
    --shape-order BNSD \
    --no-masked-softmax-fusion \
    --attention-softmax-in-fp32 \
    --distributed-timeout-minutes 120 \
    --no-gradient-accumulation-fusion \
    --initial-loss-scale 65536 \
    --recompute-granularity full \
    --recompute-method uniform \
    --recompute-num-layers 1 \
    --swap-optimizer \
    --no-load-optim \
    --no-load-rng \
    --no-save-optim \
    --no-save-rng \
    --seed 1234 \
    --micro-batch-size ${MBS} \
    --global-batch-size ${GBS} \
    --lr 1.0e-5 \
    --train-iters 2000 \
    --lr-decay-style cosine \
    --min-lr 1.0e-7 \
    --weight-decay 1e-2 \
    --lr-warmup-iters 0 \
    --clip-grad 1.0 \
    --adam-beta1 0.9 \
    --adam-beta2 0.999 \
    --bf16 \
    --handler-name GeneralPretrainHandler \
    $DATA_LOG_ARGS \
    --no-shared-storage
"

deepseek3_launch pretrain_gpt.py "pretrain_deepseek3_128k_cp${CP}_laga${LAGA}.log"
