"""Prompt data: verl-convention datasets (jsonl/parquet), the seeded checkpointable loader,
and the quickstart's synthetic task."""
from megarl.data.dataset import (BadRowError, Prompt, RLDataset, check_row, load_split,
                                 read_rows, scan_split)
from megarl.data.loader import PromptLoader, epoch_order
from megarl.data.synthetic import make_quickstart_task, make_synthetic_task

__all__ = ["BadRowError", "Prompt", "PromptLoader", "RLDataset", "check_row", "epoch_order",
           "load_split", "make_quickstart_task", "make_synthetic_task", "read_rows",
           "scan_split"]
