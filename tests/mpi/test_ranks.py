"""Under two ranks: bit-identical to one process, client state by owner, rank-0-only logs."""

import os

import pytest
import torch

from dpfl_lightning.run import checkpoint_format as ckpt
from dpfl_lightning.plugins import GaussianNoise, ServerOptimizer, UpdateClipping, UpdateNormalization
from dpfl_lightning.plugins.callback import FederatedCallback
from helpers import TinyClassifier, quiet_trainer, tiny_data


class Participation(FederatedCallback):
    keeps_client_state = True

    def on_client_end(self, *, client):
        state = client.state
        state["n"] = state.get("n", 0) + 1


def _fit(log_dir, communicator, placement="central", bound=UpdateClipping, ckpt_path=None, **kw):
    plugins = [bound(0.5), GaussianNoise(noise_multiplier=0.4, placement=placement), Participation(),
               ServerOptimizer("sgd", lr=1.0, momentum=0.5)]
    trainer = quiet_trainer(log_dir, rounds=4, clients_per_round=7, communicator=communicator, seed=4, plugins=plugins,
                            log_client_metrics=True, **kw)
    module = trainer.fit(TinyClassifier(), tiny_data(num_clients=15), ckpt_path=ckpt_path)
    return trainer, module


@pytest.mark.parametrize("placement", ["local", "central", "distributed"])
@pytest.mark.parametrize("bound", [UpdateClipping, UpdateNormalization])
def test_two_ranks_bit_identical_to_one(shared_tmp, comm, placement, bound):
    two, m2 = _fit(os.path.join(shared_tmp, "two"), "auto", placement, bound)
    assert two.world_size == 2
    one, m1 = _fit(os.path.join(shared_tmp, f"one{comm.Get_rank()}"), "local", placement, bound)
    assert one.world_size == 1
    assert torch.equal(m2.global_params, m1.global_params)
    assert [h["my_train_loss"] for h in two.history] == [h["my_train_loss"] for h in one.history]
    assert [h["epsilon"] for h in two.history] == [h["epsilon"] for h in one.history]
    everyone = comm.allgather(m2.global_params.numpy().tobytes())
    assert everyone[0] == everyone[1]


def test_gloo_communicator_matches(shared_tmp, comm):
    _, ref = _fit(os.path.join(shared_tmp, f"ref{comm.Get_rank()}"), "local")
    trainer, mod = _fit(os.path.join(shared_tmp, "gloo"), "gloo")
    trainer.comm.close()
    assert torch.equal(mod.global_params, ref.global_params)


def test_client_state_lives_on_its_owner_and_resumes_across_world_sizes(shared_tmp, comm):
    full, ref = _fit(os.path.join(shared_tmp, "full"), "auto", checkpoint_every=2)
    rank = comm.Get_rank()
    assert full.client_states and all(c % 2 == rank for c in full.client_states)
    mid = os.path.join(full.checkpoint_dir, "round-000002.ckpt")
    state = ckpt.load(mid)
    assert {c % 2 for c in state["client_states"]} == {0, 1}  # gathered by client id from both ranks
    # a 2-rank checkpoint resumed by one process reaches the same model
    resumed, out = _fit(os.path.join(shared_tmp, f"resumed{rank}"), "local", ckpt_path=mid)
    assert torch.equal(out.global_params, ref.global_params)
    everyone = {}
    for part in comm.allgather(full.client_states):
        everyone.update(part)
    assert resumed.client_states == everyone


def test_only_rank_zero_logs(shared_tmp, comm):
    log_dir = os.path.join(shared_tmp, "logs")
    trainer, _ = _fit(log_dir, "auto")
    files = [os.path.join(d, f) for d, _, fs in os.walk(log_dir) for f in fs if f == "metrics.csv"]
    comm.Barrier()
    assert len(files) == 1
    assert hasattr(trainer, "csv_log_dir") == (comm.Get_rank() == 0)


def test_dpsgd_two_ranks_bit_identical_to_one(shared_tmp, comm):
    from dpfl_lightning.plugins import DPSGD

    def fit(log_dir, communicator):
        trainer = quiet_trainer(log_dir, rounds=3, clients_per_round=5, communicator=communicator, seed=9,
                                plugins=[DPSGD(noise_multiplier=0.9, max_grad_norm=0.7)])
        return trainer, trainer.fit(TinyClassifier(), tiny_data(num_clients=10, samples=16))

    two, m2 = fit(os.path.join(shared_tmp, "dpsgd2"), "auto")
    one, m1 = fit(os.path.join(shared_tmp, f"dpsgd1-{comm.Get_rank()}"), "local")
    assert two.world_size == 2
    assert torch.equal(m2.global_params, m1.global_params)
    assert [h["epsilon"] for h in two.history] == [h["epsilon"] for h in one.history]


def test_vmap_executor_two_ranks_bit_identical_to_one(shared_tmp, comm):
    def fit(log_dir, communicator):
        trainer = quiet_trainer(log_dir, rounds=3, clients_per_round=7, communicator=communicator, seed=2,
                                executor="vmap", plugins=[UpdateClipping(0.5), GaussianNoise(noise_multiplier=0.3)])
        return trainer.fit(TinyClassifier(), tiny_data(num_clients=15))

    two = fit(os.path.join(shared_tmp, "vmap2"), "auto")
    one = fit(os.path.join(shared_tmp, f"vmap1-{comm.Get_rank()}"), "local")
    assert torch.equal(two.global_params, one.global_params)


def test_ranks_start_from_rank_zeros_initial_model(shared_tmp, comm):
    def fit(log_dir, communicator, init_seed):
        trainer = quiet_trainer(log_dir, rounds=2, clients_per_round=6, communicator=communicator, seed=1)
        return trainer.fit(TinyClassifier(seed=init_seed), tiny_data(num_clients=12))

    two = fit(os.path.join(shared_tmp, "init2"), "auto", init_seed=comm.Get_rank())  # different inits per rank
    one = fit(os.path.join(shared_tmp, f"init1-{comm.Get_rank()}"), "local", init_seed=0)
    assert torch.equal(two.global_params, one.global_params)


def test_stateless_clients_are_placed_by_work_and_give_the_bits_of_one_rank(shared_tmp, comm):
    """Without per-client state the ranks split every cohort by local steps (placement.balanced):
    the busier rank's steps stay within one client of an even split, and the model is the same."""
    from dpfl_lightning import FederatedDataModule

    sizes = [4 + (7 * c) % 29 for c in range(16)]  # 4 to 32 records: 1 to 8 batches of 4
    starts = [sum(sizes[:c]) for c in range(16)]
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(sum(sizes), 10, generator=g), torch.randint(0, 3, (sum(sizes),), generator=g)
    data = FederatedDataModule.from_tensors(x, y, client_indices=[range(s, s + n) for s, n in zip(starts, sizes)])

    class Loads(FederatedCallback):
        def __init__(self):
            self.steps = []

        def on_aggregate(self, *, server):
            self.steps.append(sum(server.plan.steps_for(sizes[c]) for c in server.my_clients))
            by_id = [c for c in server.plan.cohort if c % 2 == comm.Get_rank()]
            self.placed_by_id = getattr(self, "placed_by_id", 0) + (server.my_clients == by_id)

    def fit(log_dir, communicator):
        loads = Loads()
        trainer = quiet_trainer(log_dir, rounds=4, clients_per_round=9, communicator=communicator, seed=3,
                                plugins=[UpdateClipping(0.5), GaussianNoise(noise_multiplier=0.4), loads])
        return trainer, trainer.fit(TinyClassifier(), data), loads

    two, m2, loads = fit(os.path.join(shared_tmp, "placed2"), "auto")
    one, m1, ref = fit(os.path.join(shared_tmp, f"placed1-{comm.Get_rank()}"), "local")
    assert torch.equal(m2.global_params, m1.global_params)
    mine, everyone = loads.steps, ref.steps
    assert loads.placed_by_id < 4  # not (only) client % ranks
    other = comm.allgather(mine)[1 - comm.Get_rank()]
    for r, total in enumerate(everyone):
        assert mine[r] + other[r] == total
        assert abs(mine[r] - other[r]) <= 8  # within one client's steps (the largest has 8)
