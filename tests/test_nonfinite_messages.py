"""A non-finite update stops the run with a message that names the clients only without DP: in a
DP run (any declared mechanism) it says what failed and how many, never which client."""

import pytest
import torch

from dpfl_lightning import FederatedDataModule, NonFiniteUpdateError
from dpfl_lightning.plugins import DPSGD, GaussianNoise, UpdateClipping
from dpfl_lightning.plugins.callback import FederatedCallback
from helpers import TinyClassifier, quiet_trainer

ONE_BAD = "round 1: 1 client produced a non-finite (NaN/inf) update; nothing of this round was applied"


def _data_with_a_bad_client():
    x = torch.randn(40, 10, generator=torch.Generator().manual_seed(0))
    x[8] = float("nan")
    data = FederatedDataModule.from_tensors(x, torch.arange(40) % 10, x[:8], torch.arange(8) % 10, num_clients=4,
                                            partition="iid")
    data.setup()
    bad = [c for c in range(4) if 8 in data.client_indices(c).tolist()]
    return data, bad


def _failure(log_dir, plugins):
    data, bad = _data_with_a_bad_client()
    with pytest.raises(NonFiniteUpdateError) as caught:
        # (ten records a client: the public count DP-SGD accounts)
        quiet_trainer(log_dir, rounds=2, plugins=plugins, records_per_client=10).fit(TinyClassifier(), data)
    return str(caught.value), bad


def test_without_dp_the_message_names_the_client(log_dir):
    message, bad = _failure(log_dir, [UpdateClipping(1.0)])
    assert len(bad) == 1
    assert message.startswith(f"round 1: client(s) {bad} produced a non-finite (NaN/inf) update")


@pytest.mark.parametrize("mechanism", [
    lambda: [UpdateClipping(1.0), GaussianNoise(noise_multiplier=1.0, placement="central")],
    lambda: [UpdateClipping(1.0), GaussianNoise(noise_multiplier=1.0, placement="local")],
    lambda: [DPSGD(noise_multiplier=1.0, max_grad_norm=1.0)],
], ids=["central", "local", "dpsgd"])
def test_in_a_dp_run_the_message_says_how_many_not_which(log_dir, mechanism):
    message, bad = _failure(log_dir, mechanism())
    assert message.startswith(ONE_BAD)
    assert "client(s)" not in message and f"client {bad[0]}" not in message


class NonFiniteAfterNoise(FederatedCallback):
    """A broken plugin: writes NaN into the zero update that replaces a non-finite one."""

    order = 10_000

    def on_client_end(self, *, client) -> None:
        if client.skipped:
            client.payload["update"][0] = float("nan")


@pytest.mark.parametrize("private", [False, True])
def test_a_plugin_that_breaks_the_zero_update_is_named_without_the_client_in_a_dp_run(log_dir, private):
    plugins = [UpdateClipping(1.0), NonFiniteAfterNoise()]
    if private:
        plugins.append(GaussianNoise(noise_multiplier=1.0, placement="central"))
    data, bad = _data_with_a_bad_client()
    with pytest.raises(NonFiniteUpdateError) as caught:
        quiet_trainer(log_dir, rounds=1, plugins=plugins).fit(TinyClassifier(), data)
    who = "a client" if private else f"client {bad[0]}"
    assert str(caught.value).startswith(f"round 1: the plugins turned {who}'s zero update into a non-finite one")


def test_the_finite_check_is_exact_also_when_a_finite_update_s_sum_overflows():
    from dpfl_lightning.run.client_phase import all_finite

    assert all_finite(torch.randn(1000))
    assert all_finite(torch.tensor([3e38, 3e38, -1.0]))  # the float32 sum overflows; every entry is finite
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.randn(1000)
        x[417] = bad
        assert not all_finite(x)
    assert not all_finite(torch.tensor([float("inf"), -float("inf")]))  # sum NaN
