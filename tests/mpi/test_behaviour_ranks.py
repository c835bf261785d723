"""Two ranks reach one rank's model and epsilon bit for bit (tests/behaviour.py's rank-invariance run,
one rank's run made on each rank with the local communicator: the same environment, no table), and
the recorded ones of tests/data/behaviour_hashes.json (bit for bit in the recorded environment,
within tolerance elsewhere)."""

import pytest

import behaviour


@pytest.mark.parametrize("placement", behaviour.PLACEMENTS)
def test_the_rank_invariance_run_on_two_ranks_is_one_rank_s_and_the_recorded_one(comm, placement):
    two = behaviour.fresh_run_rank_invariance(placement)
    one = behaviour.fresh_run_rank_invariance(placement, communicator="local")
    assert two == one
    assert comm.allgather(two["sha256"]) == [two["sha256"]] * 2
    found = behaviour.check(f"rank_invariance/{placement}", two)
    assert not found, "\n".join(found) + "\nIf meant to change behaviour: python tests/behaviour.py --record"
