"""Two ranks reach the same recorded model and epsilon as one (tests/behaviour.py's rank-invariance
run, the values in tests/data/behaviour_hashes.json)."""

import pytest

import behaviour


@pytest.mark.parametrize("placement", behaviour.PLACEMENTS)
def test_the_rank_invariance_run_reaches_the_recorded_model_on_two_ranks(placement):
    assert behaviour.run_rank_invariance(placement) == behaviour.recorded()[f"rank_invariance/{placement}"]
