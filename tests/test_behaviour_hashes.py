"""Behaviour kept to the bit: every shipped config and the rank-invariance run reach the final model
and epsilon recorded in tests/data/behaviour_hashes.json (see tests/behaviour.py)."""

import pytest

import behaviour

TABLE = behaviour.recorded()


def test_the_table_covers_every_shipped_config():
    assert sorted(k for k in TABLE if k.startswith("configs/")) == behaviour.shipped_configs()


@pytest.mark.parametrize("config", behaviour.shipped_configs())
def test_a_shipped_config_reaches_the_recorded_model_and_epsilon(config):
    assert behaviour.run_config(config) == TABLE[config]


@pytest.mark.parametrize("placement", behaviour.PLACEMENTS)
def test_the_rank_invariance_run_reaches_the_recorded_model_on_one_rank(placement):
    assert behaviour.run_rank_invariance(placement) == TABLE[f"rank_invariance/{placement}"]
