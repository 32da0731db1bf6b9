#!/usr/bin/env bash
# Round-robin, time-boxed regeneration of the prompt pool (runs/regen/pool/prompts_<kind>.jsonl) into
# runs/regen/answers, by kind; resumable: rerun to go on. Stop it with `touch runs/regen/STOP`.
#   PROMPTS=../shared/data/prompts TRAIN=../shared/data/train KINDS="qa chat" MINUTES=12 BATCH=64 THREADS=1 \
#     nohup bash examples/regen_loop.sh &
# On a fresh machine the pool is built first from PROMPTS and TRAIN (the `followup` kind from the dataset's
# answers; `second_turn` and `third_turn`, a next request after each finished first or second answer, again at
# each start as the dataset grows; `fourth_turn` after the third answers with MAX_TURNS=4, `fifth_turn` after the
# fourth with MAX_TURNS=5). Prompts the answers dataset (DATASET) already answers are skipped, never answered twice.
# Rows are refilled as answers end (continuous batching); a piece stops starting prompts after MINUTES.
# On an idle 2-core machine use THREADS=2: 64 rows ran 80 answer tokens/s there (results/regen_throughput_2threads.md);
# or two loops of THREADS=1, each with its own ANSWERS folder, on disjoint KINDS or on disjoint parts of the same
# kinds (PART=1/2 and PART=2/2: every second prompt, so neither answers what the other does).
# Then into the dataset (a new shard, the card rewritten):
#   python -m transformers_confu.training.answers_dataset --dataset data/smollm2-135m-instruct-answers \
#     --answers runs/regen/answers [runs/regen/answers2] --prompts runs/regen/pool/prompts_*.jsonl ../shared/data/regen/prompts.jsonl
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${THREADS:-1}
KINDS=${KINDS:-"translation qa rag summarization chat"}
DATASET=${DATASET:-data/smollm2-135m-instruct-answers}
ANSWERS=${ANSWERS:-runs/regen/answers}
pool=runs/regen/pool
mkdir -p $pool
if [ ! -f $pool/prompts_chat.jsonl ]; then
  .venv/bin/python -m transformers_confu.training.prompt_pool --out $pool \
    --prompts-dir "${PROMPTS:?set PROMPTS to the prompt files folder, e.g. ../shared/data/prompts}" \
    --train-dir "${TRAIN:?set TRAIN to the training files folder, e.g. ../shared/data/train}"
fi
if [[ " $KINDS " == *" followup "* && ! -f $pool/prompts_followup.jsonl ]]; then
  .venv/bin/python -m transformers_confu.training.prompt_pool --out $pool --followups-from "$DATASET" \
    --prompts-dir "${PROMPTS:?set PROMPTS to the prompt files folder}"
fi
if [[ " $KINDS " == *"_turn "* ]]; then  # rebuilt at each start: a next request after every finished answer
  .venv/bin/python -m transformers_confu.training.prompt_pool --out $pool --next-turns-from "$DATASET" --max-turns ${MAX_TURNS:-3}
fi
PART=${PART:-1/1}
[[ $PART =~ ^([0-9]+)/([0-9]+)$ ]] && (( ${BASH_REMATCH[1]} >= 1 && ${BASH_REMATCH[1]} <= ${BASH_REMATCH[2]} )) \
  || { echo "PART must be i/n with 1 <= i <= n, e.g. 1/2, not $PART" >&2; exit 2; }
part=${BASH_REMATCH[1]} parts=${BASH_REMATCH[2]} tag=""
(( parts == 1 )) || tag=.part-$part-of-$parts
for kind in $KINDS; do
  [ -f $pool/prompts_$kind.jsonl ] || { echo "no prompts of kind $kind in $pool" >&2; exit 2; }
  if [ -n "$tag" ]; then  # every parts-th prompt, from the part-th on
    mkdir -p $pool/part-$part-of-$parts
    awk -v i=$part -v n=$parts '(NR - i) % n == 0' $pool/prompts_$kind.jsonl > $pool/part-$part-of-$parts/prompts_$kind.jsonl
  fi
done
[ -z "$tag" ] || pool=$pool/part-$part-of-$parts
for round in $(seq 1 50); do
  for kind in $KINDS; do
    [ -f runs/regen/STOP ] && exit 0
    .venv/bin/confu-train --output-dir $ANSWERS-out --data $pool/prompts_$kind.jsonl --regenerate --regenerate-only \
      --regenerate-dir $ANSWERS --regenerate-reuse "$DATASET" --max-length ${MAX_LENGTH:-768} \
      --regenerate-batch-size ${BATCH:-64} --regenerate-minutes ${MINUTES:-12} >> runs/regen/log_$kind$tag.txt 2>&1
  done
done
