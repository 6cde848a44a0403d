# What the DeepSeek-V3 recipes (pretrain_deepseek3_laga.sh, tune_deepseek3_laga.sh and
# pretrain_deepseek3_128k_laga.sh) share,
# sourced by each after it sets its own layout: the model, the settings both stock
# recipes train with, the CP flags, LAGA's switch and flags, and the launch.
#
# The caller sets its fixed layout in LAGA_FIXED ("TP=4 PP=8 ..."; the environment may
# repeat a value, never change it), SEQ_LEN and the node defaults (NPUS_PER_NODE, NNODES,
# MASTER_PORT), may name its own 0/1 switches in LAGA_SWITCHES, and says how it packs
# documents: LAGA_DOCUMENTS_SWITCH names its switch for --reset-attention-mask, or is
# "general" when it always packs under --attention-mask-type general. Each script's test
# compares its launch line with its stock MindSpeed-LLM recipe flag for flag, so a flag
# here is one both stock recipes pass (a recipe of another shape replaces MODEL_ARGS and
# TRAIN_ARGS after sourcing this file). Every environment value is checked here, before
# anything launches (DRY_RUN=1 too): a wrong one stops the script with one line, exit 2.
# The script's own arguments go to the launch after the recipe's flags; one that names a
# flag the recipe passes is refused, naming the variable that sets it.
# The CP checks refuse what MindSpeed(-LLM) refuses at start-up and, with LAGA=1, what
# LAGAFeature refuses (features/laga_checks.py), so a dry run that passes is one they take.

LAGA_EXTRA_ARGS=("$@")  # sourced without arguments: the script's own
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
DRY_RUN=${DRY_RUN:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
NODE_RANK=${NODE_RANK:-0}
# The Python that has mindspeed_laga: it lists the kernels --mla-laga-kernel takes.
LAGA_PYTHON=${LAGA_PYTHON:-python}
# Every integer is at most this: checked as text before any arithmetic, so a value past
# bash's 64-bit integers (CP=18446744073709551618) cannot wrap into a small one.
LAGA_INT_MAX=2147483647

# laga_fail MESSAGE...: one line on stderr naming the script, exit 2.
laga_fail() {
    echo "$(basename "$0"): $*" >&2
    exit 2
}

# laga_int NAME MIN MAX WORDS: the variable NAME holds a decimal integer from MIN to MAX
# (no sign, no leading zero); else one line "NAME=value: must be WORDS".
laga_int() {
    local value=${!1}
    case "$value" in
        0) ;;
        '' | *[!0-9]* | 0*) laga_fail "$1=$value: must be $4" ;;
    esac
    if ((${#value} > ${#3})) || ((value < $2 || value > $3)); then
        laga_fail "$1=$value: must be $4"
    fi
}

laga_positive() {  # laga_positive NAME: the variable NAME holds a positive integer
    laga_int "$1" 1 "$LAGA_INT_MAX" "a positive integer up to $LAGA_INT_MAX"
}

# laga_one_of NAME CHOICES: the variable NAME holds one of the space-separated CHOICES.
laga_one_of() {
    local choice
    for choice in $2; do
        [ "${!1}" != "$choice" ] || return 0
    done
    laga_fail "$1=${!1}: use one of ${2// /, }"
}

# laga_fixed: the caller's LAGA_FIXED layout ("TP=4 PP=8 ..."), each set; a value the
# environment gives must be the recipe's (its layout is what its flags were tested with).
laga_fixed() {
    local pair name value
    for pair in ${LAGA_FIXED:-}; do
        name=${pair%%=*} value=${pair#*=}
        if [ -n "${!name:-}" ] && [ "${!name}" != "$value" ]; then
            laga_fail "$name=${!name}: this recipe trains with $name=$value (its layout is fixed: edit the recipe to change it)"
        fi
        printf -v "$name" '%s' "$value"
    done
}

# laga_check_paths: the paths the launch passes, one argument each (quoted), never empty.
laga_check_paths() {
    local v
    for v in DATA_PATH TOKENIZER_PATH CKPT_SAVE_DIR CKPT_LOAD_DIR MINDSPEED_LLM_DIR; do
        [ -n "${!v}" ] || laga_fail "$v is empty: give a path (one path; it is passed as one argument)"
    done
}

# laga_check_affinity: MindSpeed's CPU_AFFINITY_CONF, when the job gets one: a mode 0-2,
# then optional npuN:FIRST-LAST core ranges.
laga_check_affinity() {
    [ -n "${CPU_AFFINITY_CONF:-}" ] || return 0
    [[ $CPU_AFFINITY_CONF =~ ^[0-2](,npu[0-9]+:[0-9]+-[0-9]+)*$ ]] ||
        laga_fail "CPU_AFFINITY_CONF=$CPU_AFFINITY_CONF: use MODE[,npuN:FIRST-LAST...] with MODE 0, 1 or 2 (e.g. 1,npu0:0-23,npu1:24-47)"
}

# laga_check_env: the values above and the caller's, before anything launches.
laga_check_env() {
    laga_fixed
    TRANSFORMER_IMPL=${TRANSFORMER_IMPL:-local}  # a recipe may fix it (LAGA_FIXED)
    laga_check_switches
    laga_check_affinity
    laga_check_launch_values
    laga_check_laga_options
    laga_check_cp
}

laga_check_switches() {  # every 0/1 switch
    local v
    for v in LAGA LAGA_RECOMPUTE LAGA_TRIM LAGA_OVERLAP DRY_RUN ${LAGA_SWITCHES:-}; do
        case "${!v}" in
            0 | 1) ;;
            *) laga_fail "$v=${!v}: must be 0 or 1" ;;
        esac
    done
}

laga_check_launch_values() {  # what torchrun and the host read
    local v
    for v in CP SEQ_LEN TP NNODES NPUS_PER_NODE; do laga_positive "$v"; done
    laga_int MASTER_PORT 1 65535 "a port number from 1 to 65535"
    laga_int NODE_RANK 0 $((NNODES - 1)) "an integer from 0 to NNODES-1 = $((NNODES - 1))"
    case "$MASTER_ADDR" in
        *[[:space:]]*) laga_fail "MASTER_ADDR=$MASTER_ADDR: one host name or address, no spaces" ;;
    esac
    laga_one_of TRANSFORMER_IMPL "local transformer_engine"
}

# laga_kernels: the kernels --mla-laga-kernel takes, from the installed package's registry
# (features/laga_args.py, KERNEL_CHOICES; importing it imports no torch).
laga_kernels() {
    "$LAGA_PYTHON" -c 'from mindspeed_laga.features.laga_args import KERNEL_CHOICES as k; print(*k)' \
        2>/dev/null ||
        laga_fail "LAGA_KERNEL=$LAGA_KERNEL: LAGA_PYTHON=$LAGA_PYTHON cannot import mindspeed_laga, whose registry lists the kernels: install it (pip install --no-deps -e <mindspeed-laga>) or set LAGA_PYTHON"
}

laga_check_laga_options() {  # LAGA's kernel and options, as LAGAFeature checks them
    if [ "$LAGA_KERNEL" != auto ]; then
        [ "$LAGA" = 1 ] ||
            laga_fail "LAGA_KERNEL=$LAGA_KERNEL needs LAGA=1 (LAGA=0 runs MindSpeed's own attention)"
        local kernels
        kernels=$(laga_kernels) || exit 2  # its one line is printed: stop here too
        laga_one_of LAGA_KERNEL "$kernels"
    fi
    [ -z "$LAGA_BLOCK" ] || laga_positive LAGA_BLOCK
    if [ -n "$LAGA_BLOCK" ] && [ "$LAGA_RECOMPUTE" != 1 ]; then
        laga_fail "LAGA_BLOCK=$LAGA_BLOCK needs LAGA_RECOMPUTE=1 (blockwise rebuild keeps no K/V for backward)"
    fi
    [ "$LAGA" = 0 ] || return 0
    # LAGA=0 runs MindSpeed's own attention, which none of these reach
    local v
    for v in LAGA_RECOMPUTE LAGA_TRIM LAGA_OVERLAP; do
        [ "${!v}" = 0 ] || laga_fail "$v=${!v} needs LAGA=1 (LAGA=0 runs MindSpeed's own attention)"
    done
    [ -z "$LAGA_BLOCK" ] || laga_fail "LAGA_BLOCK=$LAGA_BLOCK needs LAGA=1 (LAGA=0 runs MindSpeed's own attention)"
}

# laga_documents: LAGA_DOCUMENTS, the recipe's packed documents, from the caller's
# LAGA_DOCUMENTS_SWITCH: the name of its 0/1 switch for --reset-attention-mask ("packed"
# when it is 1, else ""), or "general" for a recipe that always packs under
# --attention-mask-type general.
laga_documents() {
    LAGA_DOCUMENTS=
    case "${LAGA_DOCUMENTS_SWITCH:-}" in
        '') ;;
        general) LAGA_DOCUMENTS=general ;;
        *) [ "${!LAGA_DOCUMENTS_SWITCH}" != 1 ] || LAGA_DOCUMENTS=packed ;;
    esac
}

# laga_check_cp: the CP algorithm, its Ulysses degree and the sequence length, as
# MindSpeed(-LLM) checks them at start-up and, with LAGA=1, as LAGAFeature does.
laga_check_cp() {
    local heads=$((NUM_HEADS / TP))
    laga_documents
    laga_one_of CP_TYPE "ulysses_cp_algo kvallgather_cp_algo megatron_cp_algo hybrid_cp_algo"
    if [ "$LAGA_DOCUMENTS" = general ] && [ "$CP_TYPE" = kvallgather_cp_algo ]; then
        laga_fail "CP_TYPE=kvallgather_cp_algo takes causal masks only, and this recipe trains with --attention-mask-type general: use ulysses_cp_algo, megatron_cp_algo or hybrid_cp_algo"
    fi
    if [ -n "$ULYSSES_DEGREE" ]; then
        laga_check_ulysses_degree "$heads"
    elif [ "$CP_TYPE" = hybrid_cp_algo ]; then
        laga_fail "CP_TYPE=hybrid_cp_algo needs ULYSSES_DEGREE=U, a divisor of CP=$CP"
    fi
    if [ "$CP_TYPE" = ulysses_cp_algo ]; then
        ((heads % CP == 0)) ||
            laga_fail "CP=$CP must divide the $heads attention heads per TP rank (ulysses_cp_algo splits them)"
        ((SEQ_LEN % CP == 0)) || laga_fail "SEQ_LEN=$SEQ_LEN must be a multiple of CP=$CP"
    elif [ "$CP_TYPE" = kvallgather_cp_algo ] && [ -n "$LAGA_DOCUMENTS" ]; then
        ((SEQ_LEN % CP == 0)) ||
            laga_fail "SEQ_LEN=$SEQ_LEN must be a multiple of CP=$CP (kvallgather_cp_algo cuts packed documents into CP slices)"
    else
        ((SEQ_LEN % (2 * CP) == 0)) ||
            laga_fail "SEQ_LEN=$SEQ_LEN must be a multiple of 2*CP=$((2 * CP)) ($CP_TYPE cuts it into 2*CP chunks)"
    fi
    local world=$((NNODES * NPUS_PER_NODE)) model=$((TP * PP * CP))
    ((world % model == 0)) ||
        laga_fail "CP=$CP: TP*PP*CP = $TP*$PP*$CP = $model must divide the world size NNODES*NPUS_PER_NODE = $world"
}

# laga_check_ulysses_degree HEADS: hybrid_cp_algo's U, U ranks a Ulysses group and
# CP/U > 1 rings (MindSpeed); LAGA=1 also needs U > 1 and no packed documents there.
laga_check_ulysses_degree() {
    laga_positive ULYSSES_DEGREE
    [ "$CP_TYPE" = hybrid_cp_algo ] ||
        laga_fail "ULYSSES_DEGREE=$ULYSSES_DEGREE goes with CP_TYPE=hybrid_cp_algo, not $CP_TYPE"
    ((CP % ULYSSES_DEGREE == 0)) || laga_fail "ULYSSES_DEGREE=$ULYSSES_DEGREE must divide CP=$CP"
    ((ULYSSES_DEGREE < CP)) ||
        laga_fail "ULYSSES_DEGREE=$ULYSSES_DEGREE must be less than CP=$CP (hybrid_cp_algo needs two rings or more: use CP_TYPE=ulysses_cp_algo)"
    (($1 % ULYSSES_DEGREE == 0)) ||
        laga_fail "ULYSSES_DEGREE=$ULYSSES_DEGREE must divide the $1 attention heads per TP rank"
    [ "$LAGA" = 1 ] || return 0
    ((ULYSSES_DEGREE > 1)) ||
        laga_fail "ULYSSES_DEGREE=1 with LAGA=1: hybrid_cp_algo needs U > 1 (use CP_TYPE=megatron_cp_algo for a ring alone)"
    [ "$LAGA_DOCUMENTS" != packed ] ||
        laga_fail "CP_TYPE=hybrid_cp_algo with packed documents ($LAGA_DOCUMENTS_SWITCH=1) is not covered by LAGA: set $LAGA_DOCUMENTS_SWITCH=0, use ulysses_cp_algo, kvallgather_cp_algo or megatron_cp_algo, or LAGA=0"
}
CKPT_SAVE_DIR=${CKPT_SAVE_DIR-/path/to/save/ckpt}
DATA_PATH=${DATA_PATH-/path/to/dataset_prefix}
TOKENIZER_PATH=${TOKENIZER_PATH-/path/to/tokenizer}
CKPT_LOAD_DIR=${CKPT_LOAD_DIR-/path/to/load/ckpt}
laga_check_env
laga_check_paths

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
# (--data-path and --tokenizer-name-or-path: quoted in the launch, deepseek3_launch)
DATA_LOG_ARGS="
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
    --seq-length ${SEQ_LEN} \
    --micro-batch-size ${MBS} \
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

# The variable that sets a flag the recipe passes (what a refused extra argument names).
LAGA_FLAG_VARS="--context-parallel-size=CP --context-parallel-algo=CP_TYPE --seq-length=SEQ_LEN
    --ulysses-degree-in-cp=ULYSSES_DEGREE --mla-laga-kernel=LAGA_KERNEL --data-path=DATA_PATH
    --mla-laga-recompute-kv=LAGA_RECOMPUTE --mla-laga-kv-block-size=LAGA_BLOCK
    --mla-laga-trim-causal-prefix=LAGA_TRIM --mla-laga-overlap=LAGA_OVERLAP
    --mla-latent-all-gather=LAGA --tokenizer-name-or-path=TOKENIZER_PATH --save=CKPT_SAVE_DIR
    --load=CKPT_LOAD_DIR --transformer-impl=TRANSFORMER_IMPL --micro-batch-size=MBS
    --global-batch-size=GBS --tensor-model-parallel-size=TP --pipeline-model-parallel-size=PP
    --expert-model-parallel-size=EP"

# laga_check_extra_args RECIPE_FLAGS...: the script's own arguments (LAGA_EXTRA_ARGS) go to
# the launch; a flag the recipe passes is refused naming what sets it, and LAGA's flags
# need LAGA=1 (LAGA=0 launches without LAGA's launcher, whose flags the host rejects).
laga_check_extra_args() {
    local arg flag pair known by
    for arg in "${LAGA_EXTRA_ARGS[@]}"; do
        [[ $arg == --* ]] || continue
        flag=${arg%%=*}
        if [ "$LAGA" = 0 ] && [[ $flag == --mla-laga-* || $flag == --mla-latent-all-gather ]]; then
            laga_fail "extra argument $flag needs LAGA=1 (LAGA=0 runs MindSpeed's own attention)"
        fi
        for pair in "$@"; do
            [ "$pair" = "$flag" ] || continue
            by="edit the recipe to change it"
            for known in $LAGA_FLAG_VARS; do
                [ "${known%%=*}" != "$flag" ] || by="set ${known#*=} instead"
            done
            laga_fail "extra argument $flag: the recipe passes $flag already ($by)"
        done
    done
}

# deepseek3_launch ENTRY LOG RECIPE_ARGS...: run ENTRY (pretrain_gpt.py, posttrain_gpt.py)
# with the shared flags, the recipe's own and the script's arguments, teeing into LOG under
# MINDSPEED_LLM_DIR; DRY_RUN=1 prints the command instead, one flag per line.
deepseek3_launch() {
    local entry=$1 log=$2
    shift 2
    # word splitting of the *_ARGS strings is intended, as in the upstream scripts
    # shellcheck disable=SC2086
    local recipe=($MODEL_ARGS $TRAIN_ARGS $CP_ARGS $LAGA_ARGS "$@"
        --data-path "$DATA_PATH"
        --tokenizer-name-or-path "$TOKENIZER_PATH"
        --save "$CKPT_SAVE_DIR"
        --load "$CKPT_LOAD_DIR"
        --transformer-impl "$TRANSFORMER_IMPL"
        --distributed-backend nccl)
    laga_check_extra_args "${recipe[@]}"
    # shellcheck disable=SC2086
    local cmd=(torchrun $DISTRIBUTED_ARGS $LAUNCHER "$entry" "${recipe[@]}" "${LAGA_EXTRA_ARGS[@]}")
    if [ "$DRY_RUN" = "1" ]; then
        laga_print_command "${cmd[@]}"
        return 0
    fi
    laga_check_launch "$entry"
    cd "$MINDSPEED_LLM_DIR"
    mkdir -p logs
    "${cmd[@]}" 2>&1 | tee "logs/$log"
}
