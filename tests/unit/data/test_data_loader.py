"""PromptLoader: seeded order, epochs, and resume at exactly the next batch."""
from __future__ import annotations

import random

import pytest

from megarl.config.errors import ConfigError
from megarl.data import PromptLoader


def _take(loader, k):
    return [loader.next_batch() for _ in range(k)]


def test_same_seed_same_order_independent_of_global_rng():
    data = list(range(23))
    random.seed(0)
    a = _take(PromptLoader(data, 4, shuffle=True, seed=7), 12)
    random.seed(123)
    random.random()
    b = _take(PromptLoader(data, 4, shuffle=True, seed=7), 12)
    c = _take(PromptLoader(data, 4, shuffle=True, seed=8), 12)
    assert a == b and a != c
    assert a[0] != [0, 1, 2, 3]  # shuffled
    assert _take(PromptLoader(data, 4, shuffle=False), 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_epochs_serve_each_prompt_once_and_reshuffle():
    data = list(range(10))
    loader = PromptLoader(data, 3, shuffle=True, seed=1)
    assert loader.steps_per_epoch == len(loader) == 3
    epochs = []
    for e in range(3):
        assert loader.epoch == e and loader.step_in_epoch == 0
        batches = _take(loader, loader.steps_per_epoch)
        served = [x for b in batches for x in b]
        assert all(len(b) == 3 for b in batches)
        assert len(set(served)) == 9  # drop_last: one prompt left out, no repeats
        epochs.append(served)
    assert loader.epoch == 3
    assert epochs[0] != epochs[1]


def test_no_drop_last_serves_short_tail():
    loader = PromptLoader(list(range(7)), 3, shuffle=False, drop_last=False)
    assert loader.steps_per_epoch == 3
    assert _take(loader, 4) == [[0, 1, 2], [3, 4, 5], [6], [0, 1, 2]]
    assert loader.epoch == 1


@pytest.mark.parametrize("k", [0, 1, 3, 5, 6, 11])
def test_resume_continues_exactly(k):
    data = list(range(17))
    original = PromptLoader(data, 4, shuffle=True, seed=3)
    consumed = _take(original, k)
    state = original.state_dict()
    resumed = PromptLoader(data, 4, shuffle=True, seed=3)
    resumed.load_state_dict(state)
    assert (resumed.epoch, resumed.step_in_epoch) == (original.epoch, original.step_in_epoch)
    continuation = _take(resumed, 10)
    assert continuation == _take(original, 10)
    # Saved-before plus resumed-after batches form whole epochs: nothing repeated or skipped.
    served = consumed + continuation
    per_epoch = resumed.steps_per_epoch
    for e in range(len(served) // per_epoch):
        epoch = [x for b in served[e * per_epoch:(e + 1) * per_epoch] for x in b]
        assert len(set(epoch)) == len(epoch) == 16


def test_state_round_trips_through_plain_types():
    import json

    loader = PromptLoader(list(range(9)), 2, seed=5)
    _take(loader, 3)
    state = json.loads(json.dumps(loader.state_dict()))
    other = PromptLoader(list(range(9)), 2, seed=5)
    other.load_state_dict(state)
    assert other.next_batch() == loader.next_batch()


def test_state_from_another_order_is_refused():
    loader = PromptLoader(list(range(9)), 2, seed=5)
    _take(loader, 2)
    state = loader.state_dict()
    for kwargs in (dict(seed=6), dict(shuffle=False)):
        with pytest.raises(ValueError, match="data order would not match"):
            PromptLoader(list(range(9)), 2, **kwargs).load_state_dict(state)
    with pytest.raises(ValueError, match="num_prompts"):
        PromptLoader(list(range(10)), 2, seed=5).load_state_dict(state)


def test_bad_sizes():
    with pytest.raises(ConfigError, match="data.train_batch_size"):
        PromptLoader([1, 2], 3)
    with pytest.raises(ConfigError, match="no usable prompts"):
        PromptLoader([], 1)
    assert sorted(PromptLoader([1, 2], 3, drop_last=False).next_batch()) == [1, 2]
