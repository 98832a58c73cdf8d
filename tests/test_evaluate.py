"""eval_batches: which validation rows each rank evaluates, by hand."""

from __future__ import annotations

import pytest

from gpt4all_training.training.evaluate import eval_batches


def test_each_rank_takes_every_world_size_th_row_of_each_global_batch():
    """10 rows, batch 2 per rank, 3 ranks: global batches of 6 rows, [0..5] and [6..9]."""
    assert [eval_batches(10, 2, 3, rank, None) for rank in range(3)] == [
        [([0, 3], True), ([6, 9], True)],
        [([1, 4], True), ([7], True)],
        [([2, 5], True), ([8], True)],
    ]


def test_a_rank_with_nothing_left_rereads_the_first_row_and_does_not_count_it():
    """7 rows on 3 ranks: the last global batch is row 6 alone; ranks 1 and 2 still run a forward on it."""
    assert [eval_batches(7, 2, 3, rank, None)[-1] for rank in range(3)] == [([6], True), ([6], False), ([6], False)]


def test_max_batches_caps_the_number_of_global_batches():
    assert eval_batches(10, 2, 1, 0, 2) == [([0, 1], True), ([2, 3], True)]
    assert eval_batches(10, 2, 1, 0, None)[-1] == ([8, 9], True)
    assert eval_batches(0, 2, 2, 1, None) == []


@pytest.mark.parametrize("n_examples, batch_size, world_size", [(1, 1, 1), (5, 2, 2), (13, 4, 3), (16, 2, 8)])
def test_every_row_is_counted_once_and_every_rank_runs_as_many_batches(n_examples, batch_size, world_size):
    shares = [eval_batches(n_examples, batch_size, world_size, rank, None) for rank in range(world_size)]
    assert len({len(batches) for batches in shares}) == 1
    counted = sorted(i for batches in shares for indices, real in batches if real for i in indices)
    assert counted == list(range(n_examples))
