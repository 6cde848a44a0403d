# What the DeepSeek-V3 recipes (pretrain_deepseek3_laga.sh, tune_deepseek3_laga.sh) share,
# sourced by each after it sets its own layout: the model, the settings both stock
# recipes train with, the CP flags, LAGA's switch and flags, and the launch.
#
# The caller sets TP, PP, EP, SEQ_LEN, GBS and the node defaults (NPUS_PER_NODE, NNODES,
# MASTER_PORT), and may name its own 0/1 switches in LAGA_SWITCHES. Each script's test
# compares its launch line with its stock MindSpeed-LLM recipe flag for flag, so a flag
# here is one both stock recipes pass (a recipe of another shape replaces MODEL_ARGS and
# TRAIN_ARGS after sourcing this file). Every environment value is checked here, before
# anything launches (DRY_RUN=1 too): a wrong one stops the script with one line, exit 2.

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
NUM_HEADS=128                        # DeepSeek-V3's attention heads
TRANSFORMER_IMPL=${TRANSFORMER_IMPL:-local}

# laga_fail MESSAGE...: one line on stderr naming the script, exit 2.
laga_fail() {
    echo "$(basename "$0"): $*" >&2
    exit 2
}

laga_positive() {  # laga_positive NAME: the variable NAME holds a positive integer
    case "${!1}" in
        '' | *[!0-9]* | 0*) laga_fail "$1=${!1}: must be a positive integer" ;;
    esac
}

# laga_check_env: the values above and the caller's, before anything launches.
laga_check_env() {
    local v heads
    for v in LAGA LAGA_RECOMPUTE LAGA_TRIM LAGA_OVERLAP ${LAGA_SWITCHES:-}; do
        case "${!v}" in
            0 | 1) ;;
            *) laga_fail "$v=${!v}: must be 0 or 1" ;;
        esac
    done
    for v in CP SEQ_LEN TP; do laga_positive "$v"; done
    [ -z "$LAGA_BLOCK" ] || laga_positive LAGA_BLOCK
    case "$CP_TYPE" in
        ulysses_cp_algo | kvallgather_cp_algo | megatron_cp_algo | hybrid_cp_algo) ;;
        *) laga_fail "CP_TYPE=$CP_TYPE: use ulysses_cp_algo, kvallgather_cp_algo, megatron_cp_algo or hybrid_cp_algo" ;;
    esac
    heads=$((NUM_HEADS / TP))
    if [ -n "$ULYSSES_DEGREE" ]; then
        laga_positive ULYSSES_DEGREE
        [ "$CP_TYPE" = hybrid_cp_algo ] ||
            laga_fail "ULYSSES_DEGREE=$ULYSSES_DEGREE goes with CP_TYPE=hybrid_cp_algo, not $CP_TYPE"
        ((CP % ULYSSES_DEGREE == 0)) || laga_fail "ULYSSES_DEGREE=$ULYSSES_DEGREE must divide CP=$CP"
        ((heads % ULYSSES_DEGREE == 0)) ||
            laga_fail "ULYSSES_DEGREE=$ULYSSES_DEGREE must divide the $heads attention heads per TP rank"
    elif [ "$CP_TYPE" = hybrid_cp_algo ]; then
        laga_fail "CP_TYPE=hybrid_cp_algo needs ULYSSES_DEGREE=U, a divisor of CP=$CP"
    fi
    if [ "$CP_TYPE" = ulysses_cp_algo ]; then
        ((heads % CP == 0)) ||
            laga_fail "CP=$CP must divide the $heads attention heads per TP rank (ulysses_cp_algo splits them)"
        ((SEQ_LEN % CP == 0)) || laga_fail "SEQ_LEN=$SEQ_LEN must be a multiple of CP=$CP"
    else
        ((SEQ_LEN % (2 * CP) == 0)) ||
            laga_fail "SEQ_LEN=$SEQ_LEN must be a multiple of 2*CP=$((2 * CP)) ($CP_TYPE cuts it into 2*CP chunks)"
    fi
}
laga_check_env

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

# DeepSeek-V3's MLA and its YaRN rope, as every DeepSeek-V3 recipe passes them.
MLA_ARGS="
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
    --rope-scaling-type yarn
"

# DeepSeek-V3's widths, vocabulary, norm and rope base, shared by every DeepSeek-V3 recipe.
V3_SIZE_ARGS="
    --hidden-size 7168 \
    --ffn-hidden-size 18432 \
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

# DeepSeek-V3 itself: MLA, YaRN rope, the MoE router, the dense sizes.
MODEL_ARGS="
    --spec mindspeed_llm.tasks.models.spec.deepseek_spec layer_spec \
    $MLA_ARGS \
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
    --num-attention-heads ${NUM_HEADS} \
    $V3_SIZE_ARGS
"

# The data, its split and the logging/saving cadence every DeepSeek-V3 recipe passes.
DATA_LOG_ARGS="
    --data-path $DATA_PATH \
    --split 100,0,0 \
    --log-interval 1 \
    --save-interval 2000 \
    --eval-interval 2000 \
    --eval-iters 0
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
    $DATA_LOG_ARGS \
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

# laga_print_command ARGS...: the command, one flag (with its values) per line, each line
# continued with a backslash so that the whole can be pasted back into a shell.
laga_print_command() {
    local out="" tok q
    for tok in "$@"; do
        printf -v q '%q' "$tok"
        if [[ -n $out && ($tok == -[-a-zA-Z]* || $tok == *.py) ]]; then
            out+=$' \\\n    '"$q"
        else
            out+="${out:+ }$q"
        fi
    done
    printf '%s\n' "$out"
}

# laga_check_launch ENTRY: what a launch needs, checked before any rank starts.
laga_check_launch() {
    [ -f "$MINDSPEED_LLM_DIR/$1" ] ||
        laga_fail "$MINDSPEED_LLM_DIR/$1 not found: run from the MindSpeed-LLM checkout or set MINDSPEED_LLM_DIR"
    command -v torchrun >/dev/null ||
        laga_fail "torchrun not found: activate the MindSpeed-LLM environment first"
    if [ "$LAGA" = "1" ]; then
        python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('mindspeed_laga') is None)" ||
            laga_fail "LAGA=1 but mindspeed_laga is not installed here: pip install --no-deps -e <mindspeed-laga>"
    fi
}

# deepseek3_launch ENTRY LOG RECIPE_ARGS...: run ENTRY (pretrain_gpt.py, posttrain_gpt.py)
# with the shared flags and the recipe's own, teeing into LOG under MINDSPEED_LLM_DIR;
# DRY_RUN=1 prints the command instead, one flag per line.
deepseek3_launch() {
    local entry=$1 log=$2
    shift 2
    # word splitting of the *_ARGS strings is intended, as in the upstream scripts
    # shellcheck disable=SC2086
    local cmd=(torchrun $DISTRIBUTED_ARGS $LAUNCHER "$entry"
        $MODEL_ARGS $TRAIN_ARGS $CP_ARGS $LAGA_ARGS "$@"
        --save "$CKPT_SAVE_DIR"
        --load "$CKPT_LOAD_DIR"
        --transformer-impl "$TRANSFORMER_IMPL"
        --distributed-backend nccl)
    if [ "${DRY_RUN:-0}" = "1" ]; then
        laga_print_command "${cmd[@]}"
        return 0
    fi
    laga_check_launch "$entry"
    cd "$MINDSPEED_LLM_DIR"
    mkdir -p logs
    "${cmd[@]}" 2>&1 | tee "logs/$log"
}
