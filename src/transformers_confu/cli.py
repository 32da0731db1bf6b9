"""Console scripts."""

from __future__ import annotations


def train_main() -> None:
    """`confu-train`: see `transformers_confu.training.train`."""
    from .training.train import main

    main()


def bench_main() -> None:
    """`confu-bench`: see `transformers_confu.benchmark.bench`."""
    from .benchmark.bench import main

    main()
