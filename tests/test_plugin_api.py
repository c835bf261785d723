"""The plugin API against the five consumers it was designed for (tests/plugin_sketches.py): each
runs end to end, its extra payload travels in the one exact all-reduce, and its releases are
accounted; an undeclared data segment in a DP run is refused."""

import math

import dp_accounting
import pytest
import torch
from dp_accounting import rdp as dp_rdp
from dp_accounting.privacy_accountant import NeighboringRelation

from dpfl_lightning import ConfigError
from dpfl_lightning.federated.payload import Segment
from dpfl_lightning.plugins import FederatedCallback, GaussianNoise, PrivacyLedger, UpdateClipping
from helpers import Recorder, TinyClassifier, quiet_trainer, tiny_data
from plugin_sketches import AdaptiveClip, Coin, NormSquare, PrivUnitSketch, SecondVector, consumers_run


def _rdp(event, count, delta, relation=NeighboringRelation.ADD_OR_REMOVE_ONE):
    acc = dp_rdp.RdpAccountant(neighboring_relation=relation)
    acc.compose(dp_accounting.SelfComposedDpEvent(event, count))
    return acc.get_epsilon(delta)


def test_second_vector_travels_with_the_update_and_is_noised(log_dir):
    after = Recorder(order=300)
    sv = SecondVector(std=1e-9)
    trainer = quiet_trainer(log_dir, rounds=2, clients_per_round=4,
                            plugins=[sv, UpdateClipping(1.0, segments=["update", "dc"]),
                                     GaussianNoise(std=1e-9, allow_infinite_epsilon=True), after])
    trainer.fit(TinyClassifier(), tiny_data())
    # dc = update / 2 per client, so the aggregated dc is half the aggregated update (the noise is ~0)
    assert torch.allclose(sv.sums[0], after.aggregates[0] / 2, atol=1e-6)
    assert torch.count_nonzero(sv.sums[0]) > 0
    # without noise for dc, the run is refused: dc would leave every client un-noised
    class Silent(SecondVector):
        def privacy_mechanisms(self, *, ctx):
            return []

    bad = quiet_trainer(log_dir, rounds=1, clients_per_round=2,
                        plugins=[Silent(), UpdateClipping(1.0, segments=["update", "dc"]), GaussianNoise(std=1e-9, allow_infinite_epsilon=True)])
    with pytest.raises(ConfigError, match="dc"):
        bad.fit(TinyClassifier(), tiny_data())


def test_coin_changes_the_local_steps_through_the_plan(log_dir):
    class Steps(FederatedCallback):
        def __init__(self):
            self.seen = []

        def on_client_end(self, *, client):
            self.seen.append((client.round_idx, client.steps))

    coin, steps = Coin(0.4), Steps()
    trainer = quiet_trainer(log_dir, rounds=6, clients_per_round=3, plugins=[coin, steps])
    trainer.fit(TinyClassifier(), tiny_data())
    assert len(set(coin.steps)) > 1  # the coin varies
    assert all(s == coin.steps[r] for r, s in steps.seen)  # every client of a round took the drawn steps


def test_norm_square_release_is_noised_and_composed_with_the_update_noise(log_dir):
    ns, ledger = NormSquare(std=2.0), PrivacyLedger(delta=1e-4)
    trainer = quiet_trainer(log_dir, rounds=3, clients_per_round=4, sampling="poisson",
                            plugins=[UpdateClipping(1.0), GaussianNoise(noise_multiplier=1.5), ns, ledger])
    trainer.fit(TinyClassifier(), tiny_data(num_clients=40))
    # two Gaussians on the same Poisson sample: one Gaussian of multiplier (1.5^-2 + (2/1)^-2)^-1/2
    z = (1.5**-2 + 2.0**-2) ** -0.5
    event = dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(z))
    assert trainer.history[-1]["epsilon"] == _rdp(event, 3, 1e-4)
    alone = _rdp(dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(1.5)), 3, 1e-4)
    assert trainer.history[-1]["epsilon"] > alone
    assert "noisy_norm_sq" in trainer.history[-1]


def test_pure_epsilon_local_randomizer_is_accounted_as_randomized_response(log_dir):
    ledger = PrivacyLedger(delta=1e-4)
    trainer = quiet_trainer(log_dir, rounds=3, clients_per_round=4,
                            plugins=[UpdateClipping(1.0), PrivUnitSketch(eps=1.0, C=1.0), ledger])
    trainer.fit(TinyClassifier(), tiny_data())
    busiest = int(ledger.counts["client_local"].max())
    rr = dp_accounting.RandomizedResponseDpEvent(2 / (1 + math.exp(3.0)), 2)
    assert trainer.history[-1]["epsilon"] == min(_rdp(rr, busiest, 1e-4, NeighboringRelation.REPLACE_ONE), 3.0 * busiest)
    assert 0 < trainer.history[-1]["epsilon"] <= 3.0 * busiest  # never worse than basic composition
    tight = ledger._eps(0, 0, 200)  # many compositions: RDP of randomized response beats k * eps
    assert tight == _rdp(rr, 200, 1e-4, NeighboringRelation.REPLACE_ONE) < 3.0 * 200


def test_noisy_count_moves_the_clip_norm_and_the_noise_follows(log_dir):
    clip = UpdateClipping(10.0)
    adaptive = AdaptiveClip(clip, std=0.5, gamma=0.5, eta=0.5)
    noise = GaussianNoise(noise_multiplier=1.0)
    trainer = quiet_trainer(log_dir, rounds=6, clients_per_round=8, plugins=[adaptive, clip, noise])
    trainer.fit(TinyClassifier(lr=0.05), tiny_data(num_clients=20))
    assert adaptive.norms[-1] < 10.0  # every update is far below 10: the norm shrinks towards the median
    assert [h["noise_std"] for h in trainer.history] == pytest.approx([10.0] + adaptive.norms[:-1])  # sigma = z C_t


def test_all_five_together(log_dir):
    trainer, module, _ = consumers_run(log_dir, "local")
    assert torch.isfinite(module.global_params).all() and math.isfinite(trainer.history[-1]["epsilon"])


class Undeclared(FederatedCallback):
    def payload_segments(self, *, ctx):
        return [Segment("loss_sum", 1, "data", "Undeclared")]


def test_an_undeclared_data_segment_is_refused_in_a_dp_run(log_dir):
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=2,
                            plugins=[UpdateClipping(1.0), GaussianNoise(noise_multiplier=1.0), Undeclared()])
    with pytest.raises(ConfigError, match="loss_sum"):
        trainer.fit(TinyClassifier(), tiny_data())
    free = quiet_trainer(log_dir, rounds=1, clients_per_round=2, plugins=[Undeclared()])  # no DP: fine
    free.fit(TinyClassifier(), tiny_data())


def test_two_noise_plugins_on_different_segments_draw_independent_noise(log_dir):
    # dc is a copy of the update, each noised by its own GaussianNoise: if both drew the same
    # numbers, update - dc would be exactly zero and the noise would cancel in any difference.
    class Copy(FederatedCallback):
        order = 10

        def payload_segments(self, *, ctx):
            return [Segment("dc", ctx.module.num_parameters, "model", "Copy")]

        def on_client_end(self, *, client):
            client.payload["dc"].copy_(client.payload["update"])

    class Seen(FederatedCallback):
        order = 300

        def __init__(self):
            self.pairs = []

        def on_client_end(self, *, client):
            self.pairs.append((client.payload["update"].clone(), client.payload["dc"].clone()))

    seen = Seen()
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=3,
                            plugins=[Copy(), UpdateClipping(1.0, segments=["update", "dc"]),
                                     GaussianNoise(noise_multiplier=1.0, placement="local", segments=["update"]),
                                     GaussianNoise(noise_multiplier=1.0, placement="local", segments=["dc"]), seen])
    trainer.fit(TinyClassifier(), tiny_data())
    for update, dc in seen.pairs:
        diff = update - dc  # n1 - n2: N(0, 2) per coordinate when independent
        assert diff.std().item() == pytest.approx(math.sqrt(2.0), rel=0.25)


def test_the_order_constants_come_with_the_plugin_api():
    import dpfl_lightning.plugins as api
    from dpfl_lightning.plugins import (ORDER_ADD_NOISE, ORDER_BOUND_SENSITIVITY, ORDER_DEFAULT, ORDER_LEDGER,
                                        ORDER_LOCAL_TRAINING, ORDER_SERVER_OPTIMIZER, ORDER_SERVER_STEP,
                                        MetricRelease, ServerOptimizer)

    names = [n for n in api.__all__ if n.startswith("ORDER_")]
    assert sorted(names) == ["ORDER_ADD_NOISE", "ORDER_BOUND_SENSITIVITY", "ORDER_DEFAULT", "ORDER_LEDGER",
                             "ORDER_LOCAL_TRAINING", "ORDER_SERVER_OPTIMIZER", "ORDER_SERVER_STEP"]
    assert set(names) <= set(dir(api))
    assert (ORDER_LOCAL_TRAINING < ORDER_BOUND_SENSITIVITY < ORDER_ADD_NOISE < ORDER_DEFAULT < ORDER_SERVER_STEP
            < ORDER_SERVER_OPTIMIZER < ORDER_LEDGER)
    assert FederatedCallback.order == ORDER_DEFAULT
    assert (UpdateClipping(1.0).order, GaussianNoise(noise_multiplier=1.0).order, ServerOptimizer().order,
            PrivacyLedger().order) == (ORDER_BOUND_SENSITIVITY, ORDER_ADD_NOISE, ORDER_SERVER_OPTIMIZER, ORDER_LEDGER)
    assert MetricRelease("x", "public", "Mine").matches("x")


def test_a_plugin_ordered_by_the_exported_constants_runs_between_noise_and_server_step(log_dir):
    from dpfl_lightning.plugins import ORDER_ADD_NOISE, ORDER_SERVER_OPTIMIZER, ServerOptimizer

    seen = []

    class Between(FederatedCallback):
        order = ORDER_ADD_NOISE + 1

        def on_server_update(self, *, server):
            seen.append(float(server.update.norm()))

    class After(FederatedCallback):
        order = ORDER_SERVER_OPTIMIZER + 1

        def on_server_update(self, *, server):
            seen.append(-1.0)

    # listed in reverse: the trainer runs them by order, the noise's sums before either
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=2,
                            plugins=[After(), Between(), ServerOptimizer(), UpdateClipping(1.0),
                                     GaussianNoise(std=1e-9, allow_infinite_epsilon=True)])
    trainer.fit(TinyClassifier(), tiny_data())
    assert len(seen) == 2 and seen[0] > 0 and seen[1] == -1.0


class Chatty(FederatedCallback):
    """Logs one declared metric, two undeclared ones (one only under a data condition) and a family."""

    def released_metrics(self, *, ctx):
        from dpfl_lightning.plugins import MetricRelease

        return [MetricRelease("declared_one", "public", "Chatty")]

    def on_round_end(self, *, server, metrics):
        metrics["declared_one"] = 1.0
        metrics["plain_stat"] = 2.0
        if server.aggregate is not None and float(server.aggregate["update"].sum()) > 1e9:
            metrics.update({"rare_stat": 3.0})  # never reached: the warning must name it anyway
        for i in range(2):
            metrics[f"per_group_{i}"] = float(i)


def _undeclared_warnings(log_dir, plugins, **kw):
    import warnings

    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=3, plugins=plugins, **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyClassifier(), tiny_data())
    return trainer, [str(w.message) for w in caught if "without declaring them in released_metrics" in str(w.message)
                     or "unless released_metrics declares them" in str(w.message)]


def test_a_dp_run_names_each_undeclared_plugin_metric_once_at_set_up(log_dir):
    dp = [UpdateClipping(1.0), GaussianNoise(noise_multiplier=1.0)]
    trainer, said = _undeclared_warnings(log_dir, [*dp, Chatty()])
    assert len(said) == 1, said
    (line,) = said
    assert "Chatty logs 'plain_stat', 'rare_stat', 'per_group_*' in on_round_end without declaring them" in line
    assert "'declared_one'" not in line
    assert "Fix: return MetricRelease('plain_stat', kind, 'Chatty') from Chatty.released_metrics" in line
    assert {"plain_stat", "per_group_0"} <= trainer.run.releases.withheld and "declared_one" in trainer.history[0]
    assert "rare_stat" not in trainer.run.releases.withheld  # it was never logged, and is named all the same
    withheld = trainer.run.releases.withheld_line()
    assert all(k in withheld for k in ("plain_stat", "rare_stat", "per_group_*"))
    # the built-in plugins declare what they log: nothing to say about them, whatever the placement
    for placement in ("central", "local"):
        _, quiet = _undeclared_warnings(log_dir, [UpdateClipping(1.0), GaussianNoise(noise_multiplier=1.0,
                                                                                     placement=placement)])
        assert quiet == []
    # a run that releases client metrics knowingly, or one without DP, withholds nothing: no warning
    assert _undeclared_warnings(log_dir, [*dp, Chatty()], log_client_metrics=True)[1] == []
    assert _undeclared_warnings(log_dir, [Chatty()])[1] == []


def test_the_undeclared_warning_depends_on_the_code_not_the_data(log_dir):
    dp = lambda: [UpdateClipping(1.0), GaussianNoise(noise_multiplier=1.0)]  # noqa: E731
    import warnings

    said = []
    for data in (tiny_data(), tiny_data(num_clients=12)):
        trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=3, plugins=[*dp(), Chatty()])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(TinyClassifier(), data)
        said.append([str(w.message) for w in caught if "released_metrics" in str(w.message)])
    assert said[0] == said[1] and len(said[0]) == 1


def test_a_metric_written_under_a_computed_key_is_said_without_a_name(log_dir):
    class Computed(FederatedCallback):
        def on_round_end(self, *, server, metrics):
            key = "x" + str(server.round_idx % 1)
            metrics[key] = 1.0

    _, said = _undeclared_warnings(log_dir, [UpdateClipping(1.0), GaussianNoise(noise_multiplier=1.0), Computed()])
    assert len(said) == 1 and "keys written by Computed.on_round_end (" in said[0]
    assert "a key the code computes" in said[0] and "'x0'" not in said[0]


class LoudNoise(GaussianNoise):
    """A user's subclass of a built-in plugin that changes nothing it logs."""


def test_a_subclass_keeps_the_metrics_its_base_declares(log_dir):
    """released_metrics inherited from GaussianNoise declares noise_std and snr with the base's name as
    source: the subclass's run logs them and says nothing (they were withheld, with a warning)."""
    trainer, said = _undeclared_warnings(log_dir, [UpdateClipping(1.0), LoudNoise(noise_multiplier=1.0)])
    assert said == []
    assert "noise_std" in trainer.history[0] and "noise_std" not in trainer.run.releases.withheld
