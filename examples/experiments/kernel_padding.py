"""Time per real token of the draft's MLP shapes (bfloat16 forward + backward, batch 8) when each batch length is
rounded up to a multiple of N: how much `confu-train --pad-to-multiple-of` saves on this CPU's kernels.

    OMP_NUM_THREADS=1 python examples/experiments/kernel_padding.py --multiples 1 8 16 32 64 128
"""

from __future__ import annotations

import argparse
import random
import time

import torch


def us_per_token(multiple: int, lengths: list[int], width: int = 576, inner: int = 1536, batch: int = 8) -> float:
    """Microseconds per real (unpadded) token of a gated MLP's forward and backward over `lengths`."""
    gate, up, down = (torch.nn.Linear(*shape, bias=False).bfloat16() for shape in
                      ((width, inner), (width, inner), (inner, width)))
    real = 0
    start = time.perf_counter()
    for length in lengths:
        padded = -(-length // multiple) * multiple
        x = torch.randn(batch * padded, width, dtype=torch.bfloat16, requires_grad=True)
        down(torch.nn.functional.silu(gate(x)) * up(x)).sum().backward()
        real += batch * length
    return (time.perf_counter() - start) / real * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--multiples", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128])
    parser.add_argument("--batches", type=int, default=400, help="random lengths 64-768, one per batch")
    parser.add_argument("--passes", type=int, default=3, help="the last pass is reported (kernels warmed up)")
    args = parser.parse_args()
    draw = random.Random(0)
    lengths = [draw.randint(64, 768) for _ in range(args.batches)]
    for multiple in args.multiples:
        for _ in range(args.passes):
            result = us_per_token(multiple, lengths)
        print(f"multiple {multiple:4d}: {result:6.2f} us per real token")


if __name__ == "__main__":
    main()
