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
#     samples (data made with preprocess_data.py --pack) with --reset-attention-mask.
#
# Run from the MindSpeed-LLM checkout (or set MINDSPEED_LLM_DIR), with mindspeed-laga
# installed (pip install -e <mindspeed-laga>) in the same environment:
#   LAGA=1 bash /path/to/mindspeed-laga/scripts/tune_deepseek3_laga.sh
#   LAGA=0 bash ...            # the same run on MindSpeed's own CP attention
#   DRY_RUN=1 bash ...         # print the command instead of running it
set -eo pipefail

export CUDA_DEVICE_MAX_CONNECTIONS=1
export PYTORCH_NPU_ALLOC_CONF=expandable_segments:True
export HCCL_CONNECT_TIMEOUT=3600
export HCCL_EXEC_TIMEOUT=3600

LAGA=${LAGA:-1}
LAGA_KERNEL=${LAGA_KERNEL:-auto}   # auto = npu_fusion_attention on NPU tensors
MINDSPEED_LLM_DIR=${MINDSPEED_LLM_DIR:-$PWD}

NPUS_PER_NODE=${NPUS_PER_NODE:-16}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6005}
NNODES=${NNODES:-8}
NODE_RANK=${NODE_RANK:-0}

CKPT_SAVE_DIR=${CKPT_SAVE_DIR:-/path/to/save/ckpt}
DATA_PATH=${DATA_PATH:-/path/to/dataset_prefix}
TOKENIZER_PATH=${TOKENIZER_PATH:-/path/to/tokenizer}
CKPT_LOAD_DIR=${CKPT_LOAD_DIR:-/path/to/load/ckpt}

TP=1
PP=8
EP=16
CP=${CP:-2}
CP_TYPE=${CP_TYPE:-ulysses_cp_algo}
NUM_LAYERS=64

SEQ_LEN=${SEQ_LEN:-16384}   # a multiple of 2*CP (zigzag) and of CP (ulysses)
MBS=1
GBS=128
LORA_TARGETS=${LORA_TARGETS:-linear_qkv linear_proj linear_fc1 linear_fc2}
PADDING_SIDE=${PADDING_SIDE:-right}
PACKED=${PACKED:-0}

DISTRIBUTED_ARGS="
    --nproc_per_node $NPUS_PER_NODE \
    --nnodes $NNODES \
    --node_rank $NODE_RANK \
    --master_addr $MASTER_ADDR \
    --master_port $MASTER_PORT
"

MLA_ARGS="
    --multi-latent-attention \
    --qk-pos-emb-head-dim 64 \
    --qk-head-dim 128 \
    --q-lora-rank 1536 \
    --kv-lora-rank 512 \
    --v-head-dim 128 \
    --qk-layernorm \
"

LAUNCHER=""
LAGA_ARGS=""
if [ "$LAGA" = "1" ]; then
    LAUNCHER="-m mindspeed_laga.launch"
    LAGA_ARGS="
    --mla-latent-all-gather \
    --mla-laga-kernel ${LAGA_KERNEL} \
"
fi

SFT_ARGS=""
[ "$PADDING_SIDE" != "right" ] && SFT_ARGS="--tokenizer-padding-side $PADDING_SIDE"
[ "$PACKED" = "1" ] && SFT_ARGS="$SFT_ARGS --reset-attention-mask"

MOE_ARGS="
    --moe-grouped-gemm \
    --moe-alltoall-overlap-comm \
    --moe-permutation-async-comm \
    --moe-token-dispatcher-type alltoall_seq \
    --first-k-dense-replace 3 \
    --moe-layer-freq 1 \
    --n-shared-experts 1 \
    --num-experts 256 \
    --moe-router-topk 8 \
    --moe-ffn-hidden-size 2048 \
    --moe-router-load-balancing-type none \
    --moe-router-group-topk 4 \
    --moe-router-num-groups 8 \
    --moe-router-topk-scaling-factor 2.5 \
    --seq-aux \
    --norm-topk-prob \
    --moe-router-score-function sigmoid \
    --moe-router-enable-expert-bias \
"

ROPE_ARGS="
    --beta-fast 32 \
    --beta-slow 1 \
    --rope-scaling-factor 40 \
    --rope-scaling-mscale 1.0 \
    --rope-scaling-mscale-all-dim  1.0 \
    --rope-scaling-original-max-position-embeddings 4096 \
    --rope-scaling-type yarn
"

GPT_ARGS="
    --spec mindspeed_llm.tasks.models.spec.deepseek_spec layer_spec \
    --noop-layers 61,62,63 \
    --prompt-type deepseek3 \
    --recompute-granularity full \
    --recompute-method uniform \
    --recompute-num-layers 1 \
    --no-shared-storage \
    --reuse-fp32-param \
    --mtp-mem-efficient-logits \
    --use-distributed-optimizer \
    --use-flash-attn \
    --shape-order BNSD \
    --use-mcore-models \
    --tensor-model-parallel-size ${TP} \
    --pipeline-model-parallel-size ${PP} \
    --expert-model-parallel-size ${EP} \
    --sequence-parallel \
    --context-parallel-size ${CP} \
    --context-parallel-algo  ${CP_TYPE} \
    --num-layers ${NUM_LAYERS} \
    --hidden-size 7168 \
    --ffn-hidden-size 18432 \
    --num-attention-heads 128 \
    --tokenizer-type PretrainedFromHF  \
    --tokenizer-name-or-path ${TOKENIZER_PATH} \
    --seq-length ${SEQ_LEN} \
    --max-position-embeddings 163840 \
    --micro-batch-size ${MBS} \
    --global-batch-size ${GBS} \
    --make-vocab-size-divisible-by 1 \
    --lr 1.0e-5 \
    --train-iters 2000 \
    --lr-decay-style cosine \
    --untie-embeddings-and-output-weights \
    --disable-bias-linear \
    --attention-dropout 0.0 \
    --init-method-std 0.02 \
    --hidden-dropout 0.0 \
    --position-embedding-type rope \
    --normalization RMSNorm \
    --use-fused-rotary-pos-emb \
    --use-rotary-position-embeddings \
    --use-fused-swiglu \
    --use-fused-rmsnorm \
    --swiglu \
    --no-masked-softmax-fusion \
    --attention-softmax-in-fp32 \
    --min-lr 1.0e-7 \
    --weight-decay 1e-2 \
    --lr-warmup-iters 1 \
    --clip-grad 1.0 \
    --adam-beta1 0.9 \
    --adam-beta2 0.999 \
    --initial-loss-scale 65536 \
    --vocab-size 129280 \
    --padded-vocab-size 129280 \
    --rotary-base 10000 \
    --norm-epsilon 1e-6 \
    --no-load-optim \
    --no-load-rng \
    --bf16 \
    --distributed-timeout-minutes 120 \
    --ckpt-format torch
"

DATA_ARGS="
    --data-path $DATA_PATH \
    --handler-name AlpacaStyleInstructionHandler \
    --split 100,0,0
"

CKPT_ARGS="
    --enable-hf2mg-convert \
    --model-type-hf deepseek3
"

OUTPUT_ARGS="
    --log-interval 1 \
    --save-interval 2000 \
    --eval-interval 2000 \
    --eval-iters 0 \
    --no-save-optim \
    --no-save-rng \
    --log-throughput
"

FINETUNE_ARGS="
    --finetune \
    --stage sft \
    --is-instruction-dataset \
    --lora-r 8 \
    --lora-alpha 16 \
    --lora-fusion \
    --lora-target-modules ${LORA_TARGETS} \
    --prompt-type deepseek3
"

# word splitting of the *_ARGS strings is intended, as in the upstream script
# shellcheck disable=SC2086
CMD=(python -m torch.distributed.launch $DISTRIBUTED_ARGS $LAUNCHER posttrain_gpt.py
    $GPT_ARGS $LAGA_ARGS $SFT_ARGS $DATA_ARGS $OUTPUT_ARGS $MLA_ARGS $ROPE_ARGS $MOE_ARGS
    $FINETUNE_ARGS $CKPT_ARGS
    --save "$CKPT_SAVE_DIR"
    --load "$CKPT_LOAD_DIR"
    --transformer-impl local
    --distributed-backend nccl)

if [ "${DRY_RUN:-0}" = "1" ]; then
    printf '%q ' "${CMD[@]}"
    echo
    exit 0
fi

cd "$MINDSPEED_LLM_DIR"
mkdir -p logs
LOG=logs/tune_deepseek3_671b_16k_lora_cp${CP}_laga${LAGA}.log
"${CMD[@]}" 2>&1 | tee "$LOG"
