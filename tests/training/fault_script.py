"""Run by test_faults.py: a long job that kills itself (SIGKILL) at a chosen point, as a machine that stops does.

    python fault_script.py train <point> <confu-train arguments...>
    python fault_script.py regenerate <point> <target folder> <answers folder>
    python fault_script.py target write <tiny target folder>     (the copy goes to $CONFU_CACHE)

Training points: `step:K` (after step K), `save-weights:K` (checkpoint-K's model.safetensors half written),
`save-rename:K` (checkpoint-K complete in its staging folder, not renamed yet), `final` (final/'s
model.safetensors half written). Regeneration points: `answer:K` (the K-th answer of this run made, not written), `write:K`
(this run's K-th record half written to disk, the ones before it flushed). Target point: `write` (the
de-quantized copy's model.safetensors half written; the tiny target stands in for the GGUF). Exits with 1
if the point is never reached.
"""

from __future__ import annotations

import os
import signal
import sys
from contextlib import contextmanager
from pathlib import Path

import datasets

PROMPTS = [f"What is {i} + {i * 7}? Say it in words, then in digits{'!' * i}" for i in range(8)]
REGENERATION = dict(batch_size=2, max_new_tokens=4, temperature=0.7, seed=3)


def regeneration_dataset() -> datasets.Dataset:
    """Eight one-turn prompts."""
    return datasets.Dataset.from_list([{"messages": [{"role": "user", "content": p}], "source": "test"}
                                       for p in PROMPTS])


def die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def cut_in_half(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def train(point: str, argv: list[str]) -> None:
    from transformers import TrainerCallback

    from transformers_confu.training import train as train_module
    from transformers_confu.training import trainer as trainer_module

    kind, _, k = point.partition(":")
    step = int(k) if k else None

    class KillAfterStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == step:
                die()

    class FaultyTrainer(trainer_module.ConFuTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if kind == "step":
                self.add_callback(KillAfterStep())

        def _save(self, output_dir=None, state_dict=None):
            super()._save(output_dir, state_dict)
            if kind == "save-weights" and self.state.global_step == step:
                cut_in_half(Path(output_dir) / "model.safetensors")
                die()

    publish_dir, atomic_dir = trainer_module.publish_dir, train_module.atomic_dir

    def publish_or_die(staged, path):
        if kind == "save-rename" and Path(path).name == f"checkpoint-{step}":
            die()
        publish_dir(staged, path)

    @contextmanager
    def atomic_dir_or_die(path):
        with atomic_dir(path) as folder:
            yield folder
            if kind == "final":
                cut_in_half(folder / "model.safetensors")
                die()

    train_module.ConFuTrainer, trainer_module.publish_dir = FaultyTrainer, publish_or_die
    train_module.atomic_dir = atomic_dir_or_die
    train_module.main(argv)


class _KillOnWrite:
    """A text file whose `count`-th `write` stops halfway, flushes (as a full buffer would) and dies."""

    def __init__(self, file, count: int) -> None:
        self.file, self.count = file, count

    def write(self, text: str) -> int:
        self.count -= 1
        if self.count == 0:
            self.file.write(text[: len(text) // 2])
            self.file.flush()
            die()
        return self.file.write(text)

    def __getattr__(self, name: str):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()


def regenerate(point: str, target: str, directory: str) -> None:
    from transformers_confu.models.target import load_target
    from transformers_confu.training import regenerate as module

    kind, _, k = point.partition(":")
    count = int(k)
    if kind == "answer":
        stream = module.stream_answers

        def stream_or_die(*args, **kwargs):
            for number, answer in enumerate(stream(*args, **kwargs), start=1):
                if number == count:
                    die()
                yield answer

        module.stream_answers = stream_or_die
    else:
        open_path = Path.open

        def open_or_tear(self, *args, **kwargs):
            file = open_path(self, *args, **kwargs)
            return _KillOnWrite(file, count) if self.name == module.RESPONSES_FILE and "a" in args else file

        Path.open = open_or_tear
    model, tokenizer = load_target(target)
    module.regenerate_responses(regeneration_dataset(), model, tokenizer, directory, **REGENERATION)


def dequantized_copy(point: str, tiny_target: str) -> None:
    from transformers_confu.models import target as module

    atomic_dir = module.atomic_dir

    @contextmanager
    def atomic_dir_or_die(path):
        with atomic_dir(path) as folder:
            yield folder
            cut_in_half(folder / "model.safetensors")
            die()

    module._dequantize_gguf = lambda: module.load_target(tiny_target)[::-1]
    module.atomic_dir = atomic_dir_or_die
    module.load_target()


if __name__ == "__main__":
    job, point, *rest = sys.argv[1:]
    if job == "train":
        train(point, rest)
    elif job == "regenerate":
        regenerate(point, *rest)
    else:
        dequantized_copy(point, *rest)
    sys.exit(f"{job} finished without reaching the fault point {point}")
