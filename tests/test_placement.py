"""Which rank trains which client: balanced by local steps unless a plugin keeps per-client state."""

import random

import pytest

from dpfl_lightning.errors import ConfigError
from dpfl_lightning.federated.placement import balanced, owner
from dpfl_lightning.plugins.callback import FederatedCallback
from helpers import TinyClassifier, quiet_trainer, tiny_data


def _check_partition(cohort, parts):
    assert sorted(c for p in parts for c in p) == sorted(cohort)
    for p in parts:  # each rank's clients keep cohort order
        assert p == [c for c in cohort if c in set(p)]


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_equal_work_is_dealt_out_at_most_one_client_apart(ranks):
    rnd = random.Random(ranks)
    for _ in range(50):
        cohort = sorted(rnd.sample(range(1000), 50))
        parts = balanced(cohort, [5] * len(cohort), ranks)
        _check_partition(cohort, parts)
        sizes = [len(p) for p in parts]
        assert max(sizes) - min(sizes) <= 1
        # placing by id, the same cohorts are often further apart (what balancing removes)
        by_id = [sum(1 for c in cohort if owner(c, ranks) == r) for r in range(ranks)]
        assert max(sizes) <= max(by_id)


def test_unequal_work_is_balanced_within_the_largest_client():
    rnd = random.Random(0)
    for ranks in (2, 3, 5):
        for _ in range(50):
            cohort = sorted(rnd.sample(range(10_000), rnd.randint(1, 40)))
            work = [rnd.choice([1, 2, 3, 50, 400]) for _ in cohort]
            parts = balanced(cohort, work, ranks)
            _check_partition(cohort, parts)
            load = [sum(w for c, w in zip(cohort, work) if c in set(p)) for p in parts]
            # longest-processing-time-first: the busiest rank exceeds the average by less than one client
            assert max(load) <= sum(work) / ranks + max(work)
            # Graham's bound for LPT, 4/3 of the optimum, which is at least the average, the largest
            # client, and the two smallest of the ranks + 1 largest (two of them share a rank)
            top = sorted(work, reverse=True)
            optimum_at_least = max(sum(work) / ranks, top[0], top[ranks - 1] + top[ranks] if len(top) > ranks else 0)
            assert max(load) <= 4 / 3 * optimum_at_least


def test_placement_is_a_function_of_the_plan_alone():
    cohort, work = [3, 8, 11, 20, 21], [7, 1, 7, 3, 3]
    assert balanced(cohort, work, 2) == balanced(list(cohort), list(work), 2)
    # most work first, each to the least loaded rank: 7 -> 0, 7 -> 1, 3 -> 0, 3 -> 1, 1 -> 0 (loads 11 and 10)
    assert balanced(cohort, work, 2) == [[3, 8, 20], [11, 21]]
    assert balanced(cohort, work, 1) == [cohort]


def test_a_plugin_that_keeps_undeclared_client_state_is_refused(tmp_path):
    class Counts(FederatedCallback):
        def on_client_end(self, *, client):
            client.state["n"] = client.state.get("n", 0) + 1

    with pytest.raises(ConfigError, match="keeps_client_state"):
        quiet_trainer(str(tmp_path), rounds=1, clients_per_round=2, plugins=[Counts()]).fit(TinyClassifier(), tiny_data())

    class DeclaredCounts(Counts):
        keeps_client_state = True

    trainer = quiet_trainer(str(tmp_path / "ok"), rounds=2, clients_per_round=2, plugins=[DeclaredCounts()])
    trainer.fit(TinyClassifier(), tiny_data())
    assert sum(s["n"] for s in trainer.client_states.values()) == 4


def test_state_the_server_writes_for_its_clients_is_refused_too(tmp_path):
    class ServerSide(FederatedCallback):
        def on_server_update(self, *, server):
            for c in server.my_clients:
                server.client_state(c)["seen"] = True

    with pytest.raises(ConfigError, match="keeps_client_state"):
        quiet_trainer(str(tmp_path), rounds=1, clients_per_round=2, plugins=[ServerSide()]).fit(TinyClassifier(), tiny_data())


def test_a_checkpoints_client_state_without_a_plugin_that_keeps_it_is_dropped_on_resume(tmp_path):
    import os

    class Counts(FederatedCallback):
        keeps_client_state = True

        def on_client_end(self, *, client):
            client.state["n"] = client.state.get("n", 0) + 1

    first = quiet_trainer(str(tmp_path / "a"), rounds=2, clients_per_round=3, plugins=[Counts()], checkpoint_every=1)
    first.fit(TinyClassifier(), tiny_data())
    ckpt = os.path.join(first.checkpoint_dir, "round-000001.ckpt")
    resumed = quiet_trainer(str(tmp_path / "b"), rounds=2, clients_per_round=3)
    with pytest.warns(RuntimeWarning, match="per-client state.*dropped"):
        resumed.fit(TinyClassifier(), tiny_data(), ckpt_path=ckpt)
    assert not any(resumed.client_states.values())


@pytest.mark.parametrize("executor", ["sequential", "vmap"])
def test_only_clients_with_state_are_kept_so_memory_does_not_grow_with_the_clients_seen(tmp_path, executor):
    class EvenClientsCount(FederatedCallback):
        keeps_client_state = True

        def on_client_end(self, *, client):
            if client.client % 2 == 0:
                client.state["n"] = client.state.get("n", 0) + 1

    plain = quiet_trainer(str(tmp_path / "plain"), rounds=4, clients_per_round=5, executor=executor)
    plain.fit(TinyClassifier(), tiny_data())
    assert plain.client_states == {}  # 4 x 5 clients trained, none kept state

    counted = quiet_trainer(str(tmp_path / "counted"), rounds=4, clients_per_round=5, executor=executor,
                            plugins=[EvenClientsCount()])
    counted.fit(TinyClassifier(), tiny_data())
    assert counted.client_states and all(c % 2 == 0 and s["n"] >= 1 for c, s in counted.client_states.items())
