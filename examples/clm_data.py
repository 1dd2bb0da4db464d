"""Causal-LM data for the examples: load text, tokenize, pack into fixed-length blocks.

The same steps as Transformers' run_clm example, written for these scripts: a `datasets`
dataset by name or local text files (``load_dataset("text", ...)``), tokenized with
``Dataset.map``, concatenated and cut into ``block_size`` blocks whose labels are their
inputs (the model shifts them).
"""

from __future__ import annotations

from itertools import chain
from typing import Optional

from datasets import DatasetDict, load_dataset


def load_text(dataset_name: Optional[str], dataset_config_name: Optional[str], train_file: Optional[str],
              validation_file: Optional[str], validation_split_percentage: int = 5) -> DatasetDict:
    """A DatasetDict with "train" and "validation" splits of raw text."""
    if dataset_name:
        raw = load_dataset(dataset_name, dataset_config_name)
    elif train_file:
        files = {"train": train_file}
        if validation_file:
            files["validation"] = validation_file
        raw = load_dataset("text", data_files=files, keep_linebreaks=True)
    else:
        raise SystemExit("give --dataset_name or --train_file")
    if "validation" not in raw:
        split = raw["train"].train_test_split(test_size=validation_split_percentage / 100, seed=0)
        raw = DatasetDict(train=split["train"], validation=split["test"])
    return raw


def tokenize_and_pack(raw: DatasetDict, tokenizer, block_size: int, num_proc: Optional[int] = None) -> DatasetDict:
    """Token ids packed into blocks of ``block_size`` with ``labels`` equal to ``input_ids``."""
    column = "text" if "text" in raw["train"].column_names else raw["train"].column_names[0]

    def tokenize(batch):
        return tokenizer(batch[column])

    def pack(batch):
        joined = {k: list(chain(*batch[k])) for k in batch}
        total = (len(joined["input_ids"]) // block_size) * block_size
        blocks = {k: [v[i : i + block_size] for i in range(0, total, block_size)] for k, v in joined.items()}
        blocks["labels"] = [list(b) for b in blocks["input_ids"]]
        return blocks

    tokenized = raw.map(tokenize, batched=True, remove_columns=raw["train"].column_names, num_proc=num_proc,
                        desc="tokenizing")
    return tokenized.map(pack, batched=True, num_proc=num_proc, desc=f"packing into blocks of {block_size}")
