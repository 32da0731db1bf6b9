#!/usr/bin/env bash
# Round-robin, time-boxed regeneration of the prompt pool (runs/regen/prompts_<kind>.jsonl) into
# runs/regen/answers, by kind; resumable: rerun to go on. Stop it with `touch runs/regen/STOP`.
#   KINDS="qa chat" MINUTES=12 BATCH=64 THREADS=1 nohup bash examples/regen_loop.sh &
# Rows are refilled as answers end (continuous batching); a piece stops starting prompts after MINUTES.
# On an idle 2-core machine use THREADS=2: 64 rows ran 80 answer tokens/s there (results/regen_throughput_2threads.md).
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${THREADS:-1}
KINDS=${KINDS:-"translation qa rag summarization chat"}
for round in $(seq 1 50); do
  for kind in $KINDS; do
    [ -f runs/regen/STOP ] && exit 0
    [ -f runs/regen/prompts_$kind.jsonl ] || continue
    .venv/bin/confu-train --output-dir runs/regen/out --data runs/regen/prompts_$kind.jsonl --regenerate --regenerate-only \
      --regenerate-dir runs/regen/answers --max-length 768 --regenerate-batch-size ${BATCH:-64} \
      --regenerate-minutes ${MINUTES:-12} >> runs/regen/log_$kind.txt 2>&1
  done
done
