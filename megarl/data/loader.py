"""The prompt loader: epochs, a seeded per-epoch shuffle, and a checkpointable position.

This module owns *which prompts come next*. Its whole state is ``(epoch, offset)``: the
order of an epoch is a pure function of ``(seed, epoch)``, so saving those two numbers is
enough to resume with exactly the batch that would have come next, with no prompt of the
epoch repeated or skipped. The shuffle uses its own ``random.Random`` (never the global RNG),
so model code that draws random numbers cannot change the data order.

Left out: expanding a prompt into ``rollout.n`` samples and the buffer of generated samples
(the controller and the sample buffer own those).
"""
from __future__ import annotations

import logging
import random
from typing import Sequence

from megarl.utils.errors import ConfigError

logger = logging.getLogger(__name__)

_STATE_VERSION = 1


def epoch_order(num_prompts: int, epoch: int, *, shuffle: bool, seed: int) -> list[int]:
    """Indices of one epoch, in the order they are served."""
    order = list(range(num_prompts))
    if shuffle:
        # A string seed is hashed with SHA-512 by `random`, stable across Python versions.
        random.Random(f"megarl.data:{seed}:{epoch}").shuffle(order)
    return order


class PromptLoader:
    """Serves batches of prompts forever, epoch after epoch.

    With ``drop_last`` the tail of each epoch that cannot fill a batch is not served (with
    shuffling, a different tail each epoch); without it the last batch of an epoch is short.
    After each batch the position moves eagerly to the next batch, so ``epoch`` is always the
    epoch the *next* batch comes from.
    """

    def __init__(self, dataset: Sequence, batch_size: int, *, shuffle: bool = True,
                 seed: int = 1, drop_last: bool = True):
        if batch_size <= 0:
            raise ConfigError(f"data.train_batch_size: must be positive, got {batch_size}")
        if len(dataset) == 0:
            raise ConfigError("data.train_files: the dataset has no usable prompts")
        if drop_last and len(dataset) < batch_size:
            raise ConfigError(
                f"data.train_batch_size: {batch_size} is larger than the dataset "
                f"({len(dataset)} prompts), so no full batch exists")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self._epoch = 0
        self._offset = 0
        self._order = self._make_order(0)

    def _make_order(self, epoch: int) -> list[int]:
        return epoch_order(len(self.dataset), epoch, shuffle=self.shuffle, seed=self.seed)

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from (0-based)."""
        return self._epoch

    @property
    def step_in_epoch(self) -> int:
        """Batches already served in the current epoch."""
        return -(-self._offset // self.batch_size)

    @property
    def steps_per_epoch(self) -> int:
        n, b = len(self.dataset), self.batch_size
        return n // b if self.drop_last else -(-n // b)

    def __len__(self) -> int:
        return self.steps_per_epoch

    def _epoch_end(self) -> int:
        n = len(self.dataset)
        return n - n % self.batch_size if self.drop_last else n

    def next_batch(self) -> list:
        """The next batch; rolls over to a new epoch when the current one is used up."""
        end = min(self._offset + self.batch_size, self._epoch_end())
        batch = [self.dataset[i] for i in self._order[self._offset:end]]
        self._offset = end
        if self._offset >= self._epoch_end():
            self._epoch += 1
            self._offset = 0
            self._order = self._make_order(self._epoch)
            logger.debug("data loader: starting epoch %d", self._epoch)
        return batch

    def state_dict(self) -> dict:
        """Everything needed to serve the same next batch after a restart."""
        return {"version": _STATE_VERSION, "epoch": self._epoch, "offset": self._offset,
                "seed": self.seed, "shuffle": self.shuffle, "drop_last": self.drop_last,
                "batch_size": self.batch_size, "num_prompts": len(self.dataset)}

    def load_state_dict(self, state: dict) -> None:
        """Resume at a saved position; refuses a state from a different data set or order."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"data loader state: unknown version {state.get('version')!r}")
        # These decide the order of every epoch: resuming under others would silently
        # repeat or skip prompts, so a mismatch is an error, not a warning.
        for key, mine in (("num_prompts", len(self.dataset)), ("seed", self.seed),
                          ("shuffle", self.shuffle), ("drop_last", self.drop_last),
                          ("batch_size", self.batch_size)):
            if state[key] != mine:
                raise ValueError(f"data loader state: saved {key}={state[key]!r} but this run "
                                 f"has {mine!r}; the data order would not match")
        if not 0 <= state["offset"] < self._epoch_end():
            raise ValueError(f"data loader state: offset {state['offset']} out of range")
        self._epoch = int(state["epoch"])
        self._offset = int(state["offset"])
        self._order = self._make_order(self._epoch)
