"""The five plugin-API consumers (a second vector, a coin, a noised scalar, an adaptive clip norm)
give bit-identical results under two ranks and one process."""

import os

import torch

from plugin_sketches import consumers_run


def test_consumers_two_ranks_bit_identical_to_one(shared_tmp, comm):
    two, m2, p2 = consumers_run(os.path.join(shared_tmp, "two"), "auto")
    one, m1, p1 = consumers_run(os.path.join(shared_tmp, f"one{comm.Get_rank()}"), "local")
    assert two.world_size == 2
    assert torch.equal(m2.global_params, m1.global_params)
    assert two.history == one.history
    assert p2[0].sums and all(torch.equal(a, b) for a, b in zip(p2[0].sums, p1[0].sums))  # the dc sums
    assert p2[4].steps == p1[4].steps and p2[5].norms == p1[5].norms  # the coin and the clip norm
