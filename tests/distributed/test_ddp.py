"""accelerate DDP on CPU: `accelerate launch --config_file configs/accelerate/multi_gpu_8.yaml --num_processes 2`
runs two gloo ranks (backends/accelerate.py sets ACCELERATE_USE_CPU when there is no CUDA), and they reproduce one
process with the same global batch. Tolerances are justified in runs.py."""

from __future__ import annotations

import pytest

from .runs import assert_same_training

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]


def test_ddp_matches_one_process(single_run, ddp_run, initial_weights):
    """Losses, gradient norms and final weights; accumulation 2 per rank against batch 4 in one process."""
    assert_same_training(ddp_run, single_run, initial_weights)


def test_ddp_ranks_end_with_bitwise_identical_weights(ddp_run):
    """Checked in the run itself: each rank's per-tensor bit checksum against rank 0's (backends/replicas.py)."""
    assert ddp_run.last("replica_mismatches") == 0
