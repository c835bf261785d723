"""Control variates under two ranks: the same bits as one process, sum h_i = 0 and c = mean c_i
over the clients of both ranks, and client states that resume across rank counts."""

import os

import torch

from dpfl_lightning.data import QuadraticClients
from dpfl_lightning.models import QuadraticModel
from dpfl_lightning.plugins import GaussianNoise, UpdateClipping
from dpfl_lightning.plugins.scaffnew import ScaffNew
from dpfl_lightning.plugins.scaffold import SCAFFOLD
from helpers import quiet_trainer

N, D, K = 8, 5, 10


def _fit(log_dir, communicator, plugins, ckpt_path=None, **kw):
    trainer = quiet_trainer(log_dir, rounds=6, local_steps=5, batch_size=None, communicator=communicator, seed=3,
                            plugins=plugins, eval_every=10**9, **kw)
    return trainer, trainer.fit(QuadraticModel(N, D, K, 0, lr=0.5), QuadraticClients(N, D, K, 0), ckpt_path=ckpt_path)


def _all_states(trainer, comm):
    states = {}
    for part in comm.allgather(trainer.client_states):
        states.update(part)
    return states


def test_scaffnew_two_ranks_bit_identical_and_h_sums_to_zero(shared_tmp, comm):
    plugins = lambda: [ScaffNew(p=0.3), UpdateClipping(1.0), GaussianNoise(noise_multiplier=0.3, placement="local")]  # noqa: E731
    two, m2 = _fit(os.path.join(shared_tmp, "sn2"), "auto", plugins())
    one, m1 = _fit(os.path.join(shared_tmp, f"sn1-{comm.Get_rank()}"), "local", plugins())
    assert two.world_size == 2 and torch.equal(m2.global_params, m1.global_params)
    states = _all_states(two, comm)
    assert sorted(states) == list(range(N))
    total = sum(s["h"] for s in states.values())
    assert float(total.abs().max()) <= 1e-12 * max(float(s["h"].abs().max()) for s in states.values())
    assert all(torch.equal(states[c]["h"], one.client_states[c]["h"]) for c in range(N))


def test_scaffold_two_ranks_and_resume_with_another_rank_count(shared_tmp, comm):
    sc2 = SCAFFOLD()
    two, m2 = _fit(os.path.join(shared_tmp, "sc2"), "auto", [sc2], clients_per_round=4, checkpoint_every=3)
    sc1 = SCAFFOLD()
    one, m1 = _fit(os.path.join(shared_tmp, f"sc1-{comm.Get_rank()}"), "local", [sc1], clients_per_round=4)
    assert torch.equal(m2.global_params, m1.global_params) and torch.equal(sc2.c, sc1.c)
    states = _all_states(two, comm)
    mean = sum(s["c_i"] for s in states.values()) / N
    assert torch.allclose(sc2.c, mean, rtol=0, atol=1e-9 * float(sc2.c.abs().max()))
    # the 2-rank checkpoint of round 3, resumed by one process, ends where the uninterrupted run ended
    mid = os.path.join(two.checkpoint_dir, "round-000003.ckpt")
    sc_r = SCAFFOLD()
    resumed, mr = _fit(os.path.join(shared_tmp, f"scr-{comm.Get_rank()}"), "local", [sc_r], clients_per_round=4,
                       ckpt_path=mid)
    assert torch.equal(mr.global_params, m2.global_params) and torch.equal(sc_r.c, sc2.c)
    assert all(torch.equal(resumed.client_states[c]["c_i"], states[c]["c_i"]) for c in states)


def test_scaffold_client_dp_two_ranks_c_is_the_mean_of_c_i_held_on_their_ranks(shared_tmp, comm):
    # distributed noise on (update, dc): each c_i carries the client's noise share and is held by the
    # rank that trains the client (never checkpointed); the two ranks together keep c = mean(c_i), and
    # every draw is the same as in one process
    def plugins():
        scaffold = SCAFFOLD()
        return scaffold, [scaffold, scaffold.commit, UpdateClipping(1.0, segments=["update", "dc"]),
                          GaussianNoise(noise_multiplier=0.5, placement="distributed", segments=["update", "dc"])]

    sc2, p2 = plugins()
    two, m2 = _fit(os.path.join(shared_tmp, "dp2"), "auto", p2, clients_per_round=4)
    sc1, p1 = plugins()
    one, m1 = _fit(os.path.join(shared_tmp, f"dp1-{comm.Get_rank()}"), "local", p1, clients_per_round=4)
    assert torch.equal(m2.global_params, m1.global_params) and torch.equal(sc2.c, sc1.c)
    held = {}
    for part in comm.allgather(sc2.control_variates):
        held.update(part)
    assert not any("c_i" in s for s in _all_states(two, comm).values())  # nothing for a checkpoint to hold
    assert sorted(held) == sorted(sc1.control_variates) and all(torch.equal(held[c], sc1.control_variates[c])
                                                               for c in held)
    mean = sum(held.values()) / N
    assert torch.allclose(sc2.c, mean, rtol=0, atol=1e-9 * float(sc2.c.abs().max()))


def test_scaffold_warm_start_partition_is_the_same_on_two_ranks(shared_tmp, comm):
    # 8 clients, cohorts of 3: warm rounds of 3, 3 and 2 clients, keyed by the seed, not the rank
    sc2, sc1 = SCAFFOLD(warm_start=True), SCAFFOLD(warm_start=True)
    two, m2 = _fit(os.path.join(shared_tmp, "w2"), "auto", [sc2], clients_per_round=3)
    one, m1 = _fit(os.path.join(shared_tmp, f"w1-{comm.Get_rank()}"), "local", [sc1], clients_per_round=3)
    assert sc2.warm_start_rounds == 3 and torch.equal(m2.global_params, m1.global_params) and torch.equal(sc2.c, sc1.c)
    met = [c for part in comm.allgather(sorted(sc2.control_variates)) for c in part]
    assert sorted(met) == list(range(N))
