"""validate / test / predict on a DP run's model carry the run's privacy statement, the disclosure fit
made, and say when the data they evaluate is drawn from the clients' own data."""

from __future__ import annotations

import os

import pytest

from dpfl_lightning.plugins import GaussianNoise, UpdateClipping
from helpers import TinyClassifier, quiet_trainer, tiny_data

FROM_CLIENTS = "(SyntheticLogistic) is drawn from the clients' own data"


class Evaluated(TinyClassifier):
    def test_step(self, batch, batch_idx):
        return self.validation_step(batch, batch_idx)


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory):
    log_dir = str(tmp_path_factory.mktemp("runs"))
    trainer = quiet_trainer(log_dir, rounds=2, clients_per_round=5, local_steps=1, final_checkpoint=True,
                            plugins=[UpdateClipping(1.0), GaussianNoise(noise_multiplier=1.0)])
    trainer.fit(Evaluated(), tiny_data())
    return trainer


def _privacy_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("privacy:")]


@pytest.mark.parametrize("stage", ["validate", "test", "predict"])
def test_a_stage_on_the_fitted_dp_model_prints_the_fit_s_statement(dp_run, capsys, stage):
    capsys.readouterr()
    kw = {} if stage == "predict" else {"verbose": False}
    getattr(dp_run, stage)(**kw)
    lines = _privacy_lines(capsys)
    assert lines[0] == f"privacy: {stage} evaluates the model of a DP run; its guarantee and what it does not cover:"
    guarantee = dp_run.ledger.describe()[0]  # what fit printed first
    assert lines[1] == f"privacy: {guarantee}" and "client-level DP, central noise" in guarantee
    assert any("simulation: cohorts, batches and noise are keyed by seed" in line for line in lines)
    assert FROM_CLIENTS in lines[-1] and f"this {stage}'s data" in lines[-1]


def test_a_dp_run_s_checkpoint_carries_its_statement_to_another_trainer(dp_run, log_dir, capsys):
    final = os.path.join(dp_run.checkpoint_dir, "final.ckpt")
    capsys.readouterr()
    quiet_trainer(log_dir).test(Evaluated(seed=4), datamodule=tiny_data(), ckpt_path=final, verbose=False)
    lines = _privacy_lines(capsys)
    assert any(dp_run.ledger.describe()[0] in line for line in lines), lines


def test_weights_of_unknown_origin_and_runs_without_dp_print_no_statement(dp_run, log_dir, capsys):
    capsys.readouterr()
    dp_run.validate(TinyClassifier(seed=4), verbose=False)  # the user's own weights: not the DP run's model
    assert _privacy_lines(capsys) == []
    plain = quiet_trainer(log_dir, rounds=1, local_steps=1)
    plain.fit(TinyClassifier(), tiny_data())
    capsys.readouterr()
    plain.validate(verbose=False)
    assert _privacy_lines(capsys) == []
