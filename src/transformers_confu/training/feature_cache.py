"""The target's outputs for EAGLE-3 draft training, computed once and kept on disk.

One frozen target forward per conversation gives all that EAGLE-3 training needs of the target: the fused
features (3H) and the final hidden state (H), from which the teacher's logits over any draft vocabulary
(`teacher_logits`) are derived, plus the target's greedy token over its full vocabulary. They are stored in
half precision as memory-mapped Arrow files through `datasets`, in shards: each shard is written by
`Dataset.map` to its own cache file (which `datasets` writes to a temporary file and moves into place), so a
stopped build resumes at the first missing shard and later epochs run the draft only. `settings.json` pins
the target, feature layers, data and dtype: a cache made for anything else is refused, never reused.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from time import monotonic

import datasets
import numpy as np
import pyarrow.compute as pc
import torch
from tqdm.auto import tqdm

from ..utils.atomic import pin_settings
from .data import DataCollatorForDraft
from .regenerate import migrate_fingerprint, target_fingerprint
from .ttt import target_argmax, target_hidden

logger = logging.getLogger(__name__)

def _data_key(dataset: datasets.Dataset) -> str:
    table = dataset.with_format("arrow")[:]
    digest = hashlib.sha256()
    for column in ("input_ids", "loss_mask"):
        flat = table[column].combine_chunks()
        digest.update(pc.list_value_length(flat).to_numpy().tobytes())
        digest.update(pc.list_flatten(flat).to_numpy().astype(np.int64).tobytes())
    return digest.hexdigest()[:16]



def shard_problem(path: Path, rows: int) -> str | None:
    """Why the shard file at `path` is not a whole shard of `rows` rows, or None (missing files are not
    a problem: they are built). Arrow streams have no footer, so a cut file is found by its row count."""
    if not path.exists():
        return None
    try:
        found = len(datasets.Dataset.from_file(str(path)))
    except Exception as error:  # pyarrow raises several types for torn or foreign files
        return f"unreadable ({type(error).__name__}: {error})"
    return None if found == rows else f"{found} rows instead of {rows}"


def _compute(target, feature_layers: list[int], dtype: torch.dtype):
    device, collate = target.device, DataCollatorForDraft(pad_token_id=0)

    def compute(batch: dict) -> dict:
        lengths = [len(ids) for ids in batch["input_ids"]]
        padded = collate([{"input_ids": i, "loss_mask": m} for i, m in zip(batch["input_ids"], batch["loss_mask"])])
        features, last_hidden = target_hidden(target, padded["input_ids"].to(device),
                                              padded["attention_mask"].to(device), feature_layers)
        greedy = target_argmax(target, last_hidden)
        features, last_hidden = features.to(dtype).cpu().numpy(), last_hidden.to(dtype).cpu().numpy()
        greedy = greedy.to(torch.int32).cpu().numpy()
        return {"features": [f[:n] for f, n in zip(features, lengths)],
                "last_hidden": [h[:n] for h, n in zip(last_hidden, lengths)],
                "target_ids": [g[:n] for g, n in zip(greedy, lengths)]}

    return compute


def build_feature_cache(
    dataset: datasets.Dataset,
    target,
    feature_layers: list[int],
    directory: str | Path,
    batch_size: int = 8,
    shard_rows: int = 512,
    dtype: str = "float16",
    max_minutes: float | None = None,
) -> datasets.Dataset:
    """`dataset` (tokenized: `input_ids`, `loss_mask`, ...) with the target's `features` (T, 3H),
    `last_hidden` (T, H) and `target_ids` (T,) added, from the cache in `directory` (built where missing).

    With `max_minutes`, stops after the shard in progress once that time has passed and returns the rows of
    the finished shards (logged); rerun to go on."""
    if dtype not in ("float16", "bfloat16", "float32"):
        raise ValueError(f"dtype must be float16, bfloat16 or float32, not {dtype!r}")
    directory = Path(directory)
    settings = {"target": target_fingerprint(target), "feature_layers": list(feature_layers),
                "data": _data_key(dataset), "rows": len(dataset), "dtype": dtype, "shard_rows": shard_rows}
    migrate_fingerprint(directory, settings["target"])
    pin_settings(directory, settings, f"The feature cache in {directory} was built for something else",
                 "Pass another --feature-cache directory, or delete this one to rebuild it.")
    hidden = target.config.hidden_size
    arrow_dtype = "float32" if dtype == "bfloat16" else dtype  # Arrow has no bfloat16: stored as float32
    features = datasets.Features({
        **dataset.features,
        "features": datasets.Array2D((None, len(feature_layers) * hidden), arrow_dtype),
        "last_hidden": datasets.Array2D((None, hidden), arrow_dtype),
        "target_ids": datasets.Sequence(datasets.Value("int32")),
    })
    compute = _compute(target, feature_layers, getattr(torch, dtype))
    num_shards = max(1, -(-len(dataset) // shard_rows))
    shards, start = [], monotonic()
    done_bytes = 0
    for index in tqdm(range(num_shards), desc="Caching target features"):
        path = directory / f"shard-{index:05d}-of-{num_shards:05d}.arrow"
        if not path.exists() and max_minutes is not None and monotonic() - start > max_minutes * 60:
            logger.info("feature cache: time box reached after %d of %d shards; rerun to go on", index, num_shards)
            break
        shard = dataset.select(range(index * shard_rows, min((index + 1) * shard_rows, len(dataset))))
        problem = shard_problem(path, len(shard))
        if problem is not None:
            logger.warning("rebuilding feature-cache shard %s: %s (a kill or a full disk?)", path.name, problem)
            path.unlink()
        shards.append(shard.map(
            compute, batched=True, batch_size=batch_size, writer_batch_size=batch_size, features=features,
            cache_file_name=str(path), new_fingerprint=f"{settings['target']}-{settings['data']}-{dtype}-{index}",
            load_from_cache_file=True, desc=f"shard {index + 1}/{num_shards}",
        ))
        done_bytes += path.stat().st_size
    logger.info("feature cache %s: %d of %d shards, %.2f GB", directory, len(shards), num_shards, done_bytes / 1e9)
    return datasets.concatenate_datasets(shards) if shards else dataset.select([])
