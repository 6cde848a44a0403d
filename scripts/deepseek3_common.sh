# What the DeepSeek-V3 recipes (pretrain_deepseek3_laga.sh, tune_deepseek3_laga.sh) share,
# sourced by each after it sets its own layout: the model, the settings both stock
# recipes train with, the CP flags, LAGA's switch and flags, and the launch.
#
# The caller sets TP, PP, EP, SEQ_LEN, GBS and the node defaults (NPUS_PER_NODE, NNODES,
# MASTER_PORT). Each script's test compares its launch
# line with its stock MindSpeed-LLM recipe flag for flag, so a flag here is one both
# stock recipes pass.

LAGA=${LAGA:-1}
LAGA_KERNEL=${LAGA_KERNEL:-auto}   # auto = npu_fusion_attention on NPU tensors
# Beyond the paper (docs/BEYOND.md): keep only the latent, rebuild K/V blockwise in
# backward; rebuild only causally visible keys; overlap the latent gather.
LAGA_RECOMPUTE=${LAGA_RECOMPUTE:-0}
LAGA_BLOCK=${LAGA_BLOCK:-}          # keys per rebuilt block (with LAGA_RECOMPUTE=1)
LAGA_TRIM=${LAGA_TRIM:-0}
LAGA_OVERLAP=${LAGA_OVERLAP:-0}
CP=${CP:-2}
CP_TYPE=${CP_TYPE:-ulysses_cp_algo}
ULYSSES_DEGREE=${ULYSSES_DEGREE:-}   # hybrid_cp_algo's --ulysses-degree-in-cp
MINDSPEED_LLM_DIR=${MINDSPEED_LLM_DIR:-$PWD}

MASTER_ADDR=${MASTER_ADDR:-localhost}
NODE_RANK=${NODE_RANK:-0}
CKPT_SAVE_DIR=${CKPT_SAVE_DIR:-/path/to/save/ckpt}
DATA_PATH=${DATA_PATH:-/path/to/dataset_prefix}
TOKENIZER_PATH=${TOKENIZER_PATH:-/path/to/tokenizer}
CKPT_LOAD_DIR=${CKPT_LOAD_DIR:-/path/to/load/ckpt}

DISTRIBUTED_ARGS="
    --nproc_per_node $NPUS_PER_NODE \
    --nnodes $NNODES \
    --node_rank $NODE_RANK \
    --master_addr $MASTER_ADDR \
    --master_port $MASTER_PORT
"

# DeepSeek-V3 itself: MLA, YaRN rope, the MoE router, the dense sizes.
MODEL_ARGS="
    --spec mindspeed_llm.tasks.models.spec.deepseek_spec layer_spec \
    --multi-latent-attention \
    --qk-pos-emb-head-dim 64 \
    --qk-head-dim 128 \
    --q-lora-rank 1536 \
    --kv-lora-rank 512 \
    --v-head-dim 128 \
    --qk-layernorm \
    --beta-fast 32 \
    --beta-slow 1 \
    --rope-scaling-factor 40 \
    --rope-scaling-mscale 1.0 \
    --rope-scaling-mscale-all-dim 1.0 \
    --rope-scaling-original-max-position-embeddings 4096 \
    --rope-scaling-type yarn \
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
    --seq-aux \
    --norm-topk-prob \
    --moe-router-score-function sigmoid \
    --moe-router-enable-expert-bias \
    --num-layers 64 \
    --noop-layers 61,62,63 \
    --hidden-size 7168 \
    --ffn-hidden-size 18432 \
    --num-attention-heads 128 \
    --max-position-embeddings 163840 \
    --make-vocab-size-divisible-by 1 \
    --vocab-size 129280 \
    --padded-vocab-size 129280 \
    --rotary-base 10000 \
    --norm-epsilon 1e-6 \
    --untie-embeddings-and-output-weights \
    --disable-bias-linear \
    --position-embedding-type rope \
    --use-rotary-position-embeddings \
    --normalization RMSNorm \
    --swiglu \
    --init-method-std 0.02 \
    --attention-dropout 0.0 \
    --hidden-dropout 0.0
"

# What both stock recipes train with: parallel layout, fused ops, optimizer, memory.
TRAIN_ARGS="
    --use-mcore-models \
    --tensor-model-parallel-size ${TP} \
    --pipeline-model-parallel-size ${PP} \
    --expert-model-parallel-size ${EP} \
    --sequence-parallel \
    --use-distributed-optimizer \
    --recompute-granularity full \
    --recompute-method uniform \
    --recompute-num-layers 1 \
    --no-shared-storage \
    --use-flash-attn \
    --use-fused-rotary-pos-emb \
    --use-fused-swiglu \
    --use-fused-rmsnorm \
    --no-masked-softmax-fusion \
    --attention-softmax-in-fp32 \
    --moe-grouped-gemm \
    --moe-permutation-async-comm \
    --mtp-mem-efficient-logits \
    --tokenizer-type PretrainedFromHF \
    --tokenizer-name-or-path ${TOKENIZER_PATH} \
    --seq-length ${SEQ_LEN} \
    --micro-batch-size 1 \
    --global-batch-size ${GBS} \
    --lr 1.0e-5 \
    --min-lr 1.0e-7 \
    --lr-decay-style cosine \
    --train-iters 2000 \
    --weight-decay 1e-2 \
    --clip-grad 1.0 \
    --adam-beta1 0.9 \
    --adam-beta2 0.999 \
    --initial-loss-scale 65536 \
    --bf16 \
    --no-load-optim \
    --no-load-rng \
    --distributed-timeout-minutes 120 \
    --ckpt-format torch \
    --enable-hf2mg-convert \
    --model-type-hf deepseek3 \
    --data-path $DATA_PATH \
    --split 100,0,0 \
    --log-interval 1 \
    --save-interval 2000 \
    --eval-interval 2000 \
    --eval-iters 0 \
    --no-save-optim \
    --no-save-rng
"

CP_ARGS="
    --context-parallel-size ${CP} \
    --context-parallel-algo ${CP_TYPE} \
"
[ -n "$ULYSSES_DEGREE" ] && CP_ARGS="$CP_ARGS --ulysses-degree-in-cp $ULYSSES_DEGREE"

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

# deepseek3_launch ENTRY LOG RECIPE_ARGS...: run ENTRY (pretrain_gpt.py, posttrain_gpt.py)
# with the shared flags and the recipe's own, teeing into LOG under MINDSPEED_LLM_DIR;
# DRY_RUN=1 prints the command instead.
deepseek3_launch() {
    local entry=$1 log=$2
    shift 2
    # word splitting of the *_ARGS strings is intended, as in the upstream scripts
    # shellcheck disable=SC2086
    local cmd=(python -m torch.distributed.launch $DISTRIBUTED_ARGS $LAUNCHER "$entry"
        $MODEL_ARGS $TRAIN_ARGS $CP_ARGS $LAGA_ARGS "$@"
        --save "$CKPT_SAVE_DIR"
        --load "$CKPT_LOAD_DIR"
        --transformer-impl local
        --distributed-backend nccl)
    if [ "${DRY_RUN:-0}" = "1" ]; then
        printf '%q ' "${cmd[@]}"
        echo
        return 0
    fi
    cd "$MINDSPEED_LLM_DIR"
    mkdir -p logs
    "${cmd[@]}" 2>&1 | tee "logs/$log"
}
