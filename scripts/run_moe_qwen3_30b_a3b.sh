#!/usr/bin/env bash
# Qwen3-30B-A3B (MoE: 128 experts, top-8 on every layer) on one node of 8 GPUs with Megatron-LM +
# megatron-dynbatch: expert parallel 8, dp=8, FLOPs-balanced dynamic micro-batches under a hard per-GPU token
# budget. Layout and budget follow configs/runs/qwen3-30b-a3b-grpo.yaml (tests/test_scripts.py checks it).
#
#   MEGATRON_LM_DIR=/path/to/Megatron-LM TOKENIZER=/path/to/Qwen3-30B-A3B DATA_PATH=samples.jsonl \
#       bash scripts/run_moe_qwen3_30b_a3b.sh [extra Megatron flags...]
#   DRY_RUN=1 bash scripts/run_moe_qwen3_30b_a3b.sh   # print the command instead of running it
#
# MoE notes: the token dispatcher must be alltoall (or flex): allgather needs the same token count on every
# rank of its group, which dynamic micro-batches do not have, and megatron-dynbatch refuses it with an error.
# With ep=8 on 8 GPUs each expert lives on one GPU, so Adam state cannot be sharded: it is offloaded to the host.
#
# Environment knobs: GPUS_PER_NODE (8), MAX_TOKENS_PER_GPU (16384), LOG_PROBS_MAX_TOKENS_PER_GPU (16384),
# GLOBAL_BATCH_SIZE (256), TRAIN_ITERS (100), SEQ_LENGTH (the longest sample; default MAX_TOKENS_PER_GPU, since
# it must fit the budget: checked at start-up), DATA_PATH, LOAD / SAVE, MASTER_PORT (29500).
# PYTHON (default: the active venv, else the project's .venv, else python3; see scripts/_env.sh) runs
# torchrun as `$PYTHON -m torch.distributed.run`; TORCHRUN=... replaces that launcher.
#
# Attention backend: NVTE_FLASH_ATTN=1 (NVTE_FUSED_ATTN=0, NVTE_UNFUSED_ATTN=0) with --attention-backend flash;
# megatron-core asserts that the NVTE_* variables match --attention-backend. With CP, SP or FP8 alignment
# (padding between packed sequences) switch to ATTN_BACKEND=fused (cuDNN FusedAttention, NVTE_FUSED_ATTN=1).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$REPO_ROOT/scripts/_env.sh"   # PYTHON: $PYTHON, the active venv, the project's .venv, or python3
MEGATRON_LM_DIR=${MEGATRON_LM_DIR:-/workspace/Megatron-LM}
TOKENIZER=${TOKENIZER:-Qwen/Qwen3-30B-A3B}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_PORT=${MASTER_PORT:-29500}
MAX_TOKENS_PER_GPU=${MAX_TOKENS_PER_GPU:-16384}
LOG_PROBS_MAX_TOKENS_PER_GPU=${LOG_PROBS_MAX_TOKENS_PER_GPU:-16384}
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-256}
TRAIN_ITERS=${TRAIN_ITERS:-100}
SEQ_LENGTH=${SEQ_LENGTH:-$MAX_TOKENS_PER_GPU}  # the longest sample; must fit the budget (checked at start-up)
ATTN_BACKEND=${ATTN_BACKEND:-flash}

case "$ATTN_BACKEND" in
  flash) ATTN_ENV=(NVTE_FLASH_ATTN=1 NVTE_FUSED_ATTN=0 NVTE_UNFUSED_ATTN=0) ;;
  fused) ATTN_ENV=(NVTE_FLASH_ATTN=0 NVTE_FUSED_ATTN=1 NVTE_UNFUSED_ATTN=0) ;;
  *) echo "run_moe_qwen3_30b_a3b.sh: ATTN_BACKEND must be flash or fused, got '$ATTN_BACKEND'" >&2; exit 2 ;;
esac

MODEL_ARGS=(
  --num-layers 48 --hidden-size 2048 --ffn-hidden-size 6144
  --num-attention-heads 32 --group-query-attention --num-query-groups 4 --kv-channels 128
  --qk-layernorm --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --disable-bias-linear
  --position-embedding-type rope --rotary-base 1000000 --untie-embeddings-and-output-weights
  --num-experts 128 --moe-ffn-hidden-size 768 --moe-router-topk 8
  --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3 --moe-grouped-gemm
  --seq-length "$SEQ_LENGTH" --max-position-embeddings 40960
  --attention-dropout 0.0 --hidden-dropout 0.0
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER"
  --bf16 --transformer-impl transformer_engine --attention-backend "$ATTN_BACKEND"
)
PARALLEL_ARGS=(
  --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --context-parallel-size 1
  --expert-model-parallel-size 8 --moe-token-dispatcher-type alltoall
  --use-distributed-optimizer --optimizer-cpu-offload --use-precision-aware-optimizer
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
)
DYNBATCH_ARGS=(
  --use-dynamic-batch-size --balance-by-flops
  --max-tokens-per-gpu "$MAX_TOKENS_PER_GPU" --log-probs-max-tokens-per-gpu "$LOG_PROBS_MAX_TOKENS_PER_GPU"
  --dynbatch-max-seq-length "$SEQ_LENGTH"
  --micro-batch-size 1 --global-batch-size "$GLOBAL_BATCH_SIZE" --dynbatch-samples-per-step "$GLOBAL_BATCH_SIZE"
  --dataloader-type external --eval-iters 0
)
if [ -n "${DATA_PATH:-}" ]; then DATA_ARGS=(--dynbatch-train-data "$DATA_PATH"); else DATA_ARGS=(--dynbatch-mock-data); fi
TRAIN_ARGS=(
  --train-iters "$TRAIN_ITERS" --lr 1e-6 --lr-decay-style constant --weight-decay 0.1
  --adam-beta1 0.9 --adam-beta2 0.98 --clip-grad 1.0 --log-interval 1
)
[ -n "${LOAD:-}" ] && TRAIN_ARGS+=(--load "$LOAD")
[ -n "${SAVE:-}" ] && TRAIN_ARGS+=(--save "$SAVE" --save-interval 50)

# torchrun of the chosen Python (TORCHRUN=... overrides it, e.g. TORCHRUN=torchrun).
if [ -n "${TORCHRUN:-}" ]; then read -r -a LAUNCHER <<< "$TORCHRUN"; else LAUNCHER=("$PYTHON" -m torch.distributed.run); fi
CMD=(
  env CUDA_DEVICE_MAX_CONNECTIONS=1 "${ATTN_ENV[@]}" "PYTHONPATH=$MEGATRON_LM_DIR:$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
  "${LAUNCHER[@]}" --nproc-per-node "$GPUS_PER_NODE" --nnodes 1 --master-addr 127.0.0.1 --master-port "$MASTER_PORT"
  "$REPO_ROOT/scripts/pretrain_gpt_dynbatch.py"
  "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DYNBATCH_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAIN_ARGS[@]}" "$@"
)
if [ "${DRY_RUN:-0}" = 1 ]; then
  printf '%q ' "${CMD[@]}"; echo
  exit 0
fi
exec "${CMD[@]}"
