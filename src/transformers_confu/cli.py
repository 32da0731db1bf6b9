"""Console scripts."""

from __future__ import annotations


def train_main() -> None:
    """`confu-train`: see `transformers_confu.train`."""
    from .train import main

    main()


def bench_main() -> None:
    """`confu-bench`: see `transformers_confu.bench`."""
    from .bench import main

    main()
