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
#   DRY_RUN=1 bash ...         # print the command instead of running it
set -eo pipefail

export CPU_AFFINITY_CONF=1
export CUDA_DEVICE_MAX_CONNECTIONS=1
export PYTORCH_NPU_ALLOC_CONF=expandable_segments:True
export TASK_QUEUE_ENABLE=2
export HCCL_OP_BASE_FFTS_MODE=TRUE
export HCCL_CONNECT_TIMEOUT=3600
export HCCL_EXEC_TIMEOUT=3600
export HCCL_ALGO="alltoall=level0:NA;level1:pipeline"
export HCCL_BUFFSIZE=400

LAGA=${LAGA:-1}
LAGA_KERNEL=${LAGA_KERNEL:-auto}   # auto = npu_fusion_attention on NPU tensors
# Beyond the paper (docs/BEYOND.md): keep only the latent, rebuild K/V blockwise in
# backward; rebuild only causally visible keys; overlap the latent gather.
LAGA_RECOMPUTE=${LAGA_RECOMPUTE:-0}
LAGA_BLOCK=${LAGA_BLOCK:-}          # keys per rebuilt block (with LAGA_RECOMPUTE=1)
LAGA_TRIM=${LAGA_TRIM:-0}
LAGA_OVERLAP=${LAGA_OVERLAP:-0}
MINDSPEED_LLM_DIR=${MINDSPEED_LLM_DIR:-$PWD}

NPUS_PER_NODE=${NPUS_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
NNODES=${NNODES:-64}
NODE_RANK=${NODE_RANK:-0}

CKPT_SAVE_DIR=${CKPT_SAVE_DIR:-/path/to/save/ckpt}
DATA_PATH=${DATA_PATH:-/path/to/dataset_prefix}
TOKENIZER_PATH=${TOKENIZER_PATH:-/path/to/tokenizer}
CKPT_LOAD_DIR=${CKPT_LOAD_DIR:-/path/to/load/ckpt}

TP=4
PP=8
EP=32
CP=${CP:-2}
CP_TYPE=${CP_TYPE:-ulysses_cp_algo}
ULYSSES_DEGREE=${ULYSSES_DEGREE:-}   # hybrid_cp_algo's --ulysses-degree-in-cp
RESET_MASK=${RESET_MASK:-1}          # packed documents, as upstream
NUM_LAYERS=64
SEQ_LEN=${SEQ_LEN:-4096}   # a multiple of 2*CP (zigzag) and of CP (ulysses)
MBS=1
GBS=3840

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
    --mla-fa-without-pad \
"

CP_ARGS="
    --context-parallel-size ${CP} \
    --context-parallel-algo ${CP_TYPE} \
"
[ -n "$ULYSSES_DEGREE" ] && CP_ARGS="$CP_ARGS --ulysses-degree-in-cp $ULYSSES_DEGREE"
RESET_ARGS=""
[ "$RESET_MASK" = "1" ] && RESET_ARGS="--reset-attention-mask"

LAUNCHER=""
LAGA_ARGS=""
if [ "$LAGA" = "1" ]; then
    LAUNCHER="-m mindspeed_laga.launch"
    LAGA_ARGS="
    --mla-latent-all-gather \
    --mla-laga-kernel ${LAGA_KERNEL} \
"
    [ "$LAGA_RECOMPUTE" = "1" ] && LAGA_ARGS="$LAGA_ARGS --mla-laga-recompute-kv"
    [ -n "$LAGA_BLOCK" ] && LAGA_ARGS="$LAGA_ARGS --mla-laga-kv-block-size $LAGA_BLOCK"
    [ "$LAGA_TRIM" = "1" ] && LAGA_ARGS="$LAGA_ARGS --mla-laga-trim-causal-prefix"
    [ "$LAGA_OVERLAP" = "1" ] && LAGA_ARGS="$LAGA_ARGS --mla-laga-overlap"
fi

MOE_ARGS="
    --moe-router-dtype fp32 \
    --moe-grouped-gemm \
    --moe-permutation-async-comm \
    --moe-token-dispatcher-type alltoall \
    --moe-permute-fusion \
    --first-k-dense-replace 3 \
    --moe-layer-freq 1 \
    --n-shared-experts 1 \
    --num-experts 256 \
    --moe-router-topk 8 \
    --moe-ffn-hidden-size 2048 \
    --moe-router-load-balancing-type none \
    --moe-router-num-groups 8 \
    --moe-router-group-topk 4 \
    --moe-router-topk-scaling-factor 2.5 \
    --moe-aux-loss-coeff 0.0001 \
    --seq-aux \
    --norm-topk-prob \
    --moe-router-score-function sigmoid \
    --moe-router-enable-expert-bias \
    --expert-tensor-parallel-size 1
"

MTP_ARGS="
    --mtp-num-layers 1 \
    --mtp-loss-scaling-factor 0.3 \
    --mtp-mem-efficient-logits \
"

ROPE_ARGS="
    --beta-fast 32 \
    --beta-slow 1 \
    --rope-scaling-factor 40 \
    --rope-scaling-mscale 1.0 \
    --rope-scaling-mscale-all-dim 1.0 \
    --rope-scaling-original-max-position-embeddings 4096 \
    --rope-scaling-type yarn
"

DUALPIPE_ARGS="
    --moe-fb-overlap \
    --schedules-method dualpipev \
"
[ "$CP" -gt 1 ] && DUALPIPE_ARGS=""  # MindSpeed: dualpipev and context parallelism exclude

MEM_ARGS="
    --swap-optimizer \
    --swap-optimizer-times 4 \
    --use-distributed-optimizer \
    --recompute-method uniform \
    --recompute-granularity full \
    --recompute-num-layers 1 \
"

GPT_ARGS="
    --spec mindspeed_llm.tasks.models.spec.deepseek_spec layer_spec \
    $RESET_ARGS \
    --gemm-gradient-accumulation-fusion \
    --noop-layers 61,62,63 \
    --manual-gc \
    --manual-gc-interval 50 \
    --no-shared-storage \
    --use-flash-attn \
    --use-mcore-models \
    --tensor-model-parallel-size ${TP} \
    --pipeline-model-parallel-size ${PP} \
    --expert-model-parallel-size ${EP} \
    --sequence-parallel \
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
    --lr-warmup-iters 500 \
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
    --use-ascend-coc \
    --coc-fused-kernel \
    --distributed-timeout-minutes 120 \
    --ckpt-format torch
"

DATA_ARGS="
    --data-path $DATA_PATH \
    --handler-name GeneralPretrainHandler \
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
    --no-save-rng
"

# word splitting of the *_ARGS strings is intended, as in the upstream script
# shellcheck disable=SC2086
CMD=(python -m torch.distributed.launch $DISTRIBUTED_ARGS $LAUNCHER pretrain_gpt.py
    $GPT_ARGS $CP_ARGS $LAGA_ARGS $DATA_ARGS $OUTPUT_ARGS $MLA_ARGS $ROPE_ARGS $MOE_ARGS
    $MTP_ARGS $DUALPIPE_ARGS $MEM_ARGS $CKPT_ARGS
    --distributed-backend nccl
    --save "$CKPT_SAVE_DIR"
    --load "$CKPT_LOAD_DIR"
    --transformer-impl local)

if [ "${DRY_RUN:-0}" = "1" ]; then
    printf '%q ' "${CMD[@]}"
    echo
    exit 0
fi

cd "$MINDSPEED_LLM_DIR"
mkdir -p logs
LOG=logs/pretrain_deepseek3_671b_4k_cp${CP}_laga${LAGA}.log
"${CMD[@]}" | tee "$LOG"
