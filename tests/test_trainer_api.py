"""FederatedTrainer as a lightning.Trainer user calls it: lightning.Trainer's arguments are refused with
their federated counterpart, and validate / test / predict return what lightning.Trainer's return on
the same trained weights."""

import inspect
import os

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from dpfl_lightning import ConfigError, FederatedTrainer
from dpfl_lightning.cli.parse_errors import unknown_option
from helpers import TinyClassifier, quiet_trainer, tiny_data


class Classifier(TinyClassifier):
    """TinyClassifier with a test_step and a predict_step of its own."""

    def test_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("my_test_loss", F.cross_entropy(logits, y))
        self.log("my_test_acc", (logits.argmax(-1) == y).float().mean())

    def predict_step(self, batch, batch_idx):
        return torch.softmax(self(batch[0]), dim=-1)


# ---------------------------------------------------------------------------------------- arguments
@pytest.mark.parametrize("name,value,says", [
    ("max_epochs", 3, "set trainer.rounds"),
    ("max_steps", 100, "trainer.local_steps"),
    ("devices", 2, "mpiexec -n N"),
    ("strategy", "ddp", "trainer.communicator"),
    ("logger", False, "trainer.loggers"),
    ("enable_model_summary", False, "trainer.enable_summary"),
])
def test_a_lightning_trainer_argument_names_its_federated_counterpart(name, value, says):
    with pytest.raises(ConfigError) as err:
        FederatedTrainer(**{name: value})
    assert isinstance(err.value, TypeError)  # what Python raises for an unexpected keyword, for code catching that
    message = str(err.value)
    assert message.startswith(f"trainer.{name}={value!r}: FederatedTrainer has no {name} (a lightning.Trainer")
    assert says in message
    # the command line gives the same counterpart (one table)
    assert says in unknown_option(f"trainer.{name}", ["trainer.rounds"], "fit", str(value))


def test_other_unknown_arguments_get_the_closest_one_and_the_signature_is_kept():
    with pytest.raises(ConfigError, match=r"trainer.roundz=3: FederatedTrainer takes no argument roundz\. "
                                          r"Fix: the closest argument is rounds"):
        FederatedTrainer(roundz=3)
    with pytest.raises(ConfigError, match=r"no benchmark \(a lightning.Trainer argument with no counterpart"):
        FederatedTrainer(benchmark=True)
    params = inspect.signature(FederatedTrainer).parameters
    assert "rounds" in params and "self" not in params
    assert not any(p.kind == p.VAR_KEYWORD for p in params.values())
    assert FederatedTrainer(rounds=3, accelerator="cpu", precision="32").rounds == 3  # its own still work


# ---------------------------------------------------------------------------------------- validate / test / predict
def _eval_sets(data):
    """The fit's validation and test sets as plain DataLoaders (batch size 7: not the one dpfl uses)."""
    data.setup()
    out = []
    for batches in (data.val_batches(), data.test_batches()):
        xs, ys = zip(*batches)
        out.append(DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=7))
    return out


def _lightning():
    return L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     accelerator="cpu", devices=1)


def _same_metrics(got, want):
    assert isinstance(got, list) and len(got) == len(want) == 1 and set(got[0]) == set(want[0])
    for key in want[0]:
        assert got[0][key] == pytest.approx(want[0][key], abs=1e-6), key


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    L.seed_everything(0, verbose=False)
    trainer = quiet_trainer(str(tmp_path_factory.mktemp("runs")), rounds=3, clients_per_round=5, checkpoint_every=1,
                            final_checkpoint=True, run_name="api")
    module = trainer.fit(Classifier(), tiny_data())
    return trainer, module


def test_validate_test_and_predict_return_what_lightning_returns_on_the_trained_weights(trained):
    trainer, module = trained
    val, test = _eval_sets(tiny_data())
    final = os.path.join(trainer.checkpoint_dir, "final.ckpt")
    reference = Classifier.load_from_checkpoint(final)  # Lightning's own loader, a fresh module
    assert not torch.equal(reference.net[0].weight, Classifier().net[0].weight)  # trained weights
    _same_metrics(trainer.validate(verbose=False), _lightning().validate(reference, val, verbose=False))
    _same_metrics(trainer.test(verbose=False), _lightning().test(reference, test, verbose=False))
    got = trainer.predict()
    want = _lightning().predict(reference, test)
    assert isinstance(got, list) and all(isinstance(p, torch.Tensor) for p in got)
    torch.testing.assert_close(torch.cat(got), torch.cat(want), rtol=0, atol=1e-6)
    # the module fit returned, given explicitly, with the data given as Lightning takes it
    want = _lightning().test(reference, test, verbose=False)
    _same_metrics(trainer.test(module, dataloaders=test, verbose=False), want)


def test_ckpt_path_loads_a_round_checkpoint_last_or_a_file(trained):
    trainer, _ = trained
    val, _ = _eval_sets(tiny_data())
    first = os.path.join(trainer.checkpoint_dir, "round-000001.ckpt")
    want = _lightning().validate(Classifier.load_from_checkpoint(first, weights_only=False), val, verbose=False)
    model = Classifier(seed=5)
    _same_metrics(trainer.validate(model, datamodule=tiny_data(), ckpt_path=first, verbose=False), want)
    final = _lightning().validate(Classifier.load_from_checkpoint(os.path.join(trainer.checkpoint_dir, "final.ckpt")),
                                  val, verbose=False)
    assert want[0]["my_val_loss"] != pytest.approx(final[0]["my_val_loss"], abs=1e-6)  # round 1 is not the end
    _same_metrics(trainer.validate(Classifier(seed=5), ckpt_path="last", verbose=False), final)
    with pytest.raises(ConfigError, match="ckpt_path='best': no ModelCheckpoint callback saved a best model"):
        trainer.validate(ckpt_path="best")
    with pytest.raises(ConfigError, match="no such checkpoint file"):
        trainer.validate(ckpt_path="missing.ckpt")


def test_best_is_the_model_checkpoint_callbacks_best(tmp_path):
    L.seed_everything(0, verbose=False)
    saver = ModelCheckpoint(monitor="my_val_loss", mode="max", save_top_k=1)  # max: the worst round, not the last
    trainer = quiet_trainer(str(tmp_path), rounds=3, clients_per_round=5, callbacks=[saver])
    trainer.fit(Classifier(), tiny_data())
    losses = [row["my_val_loss"] for row in trainer.history]
    assert saver.best_model_path and max(losses) != losses[-1]
    got = trainer.validate(ckpt_path="best", verbose=False)
    assert got[0]["my_val_loss"] == pytest.approx(max(losses), abs=1e-6)
    assert trainer.validate(verbose=False) == got  # no model given: the best, as in Lightning


def test_without_a_fit_a_model_and_data_are_needed(tmp_path):
    trainer = quiet_trainer(str(tmp_path))
    with pytest.raises(ConfigError, match="model=None: not given, and this trainer has not fit a model"):
        trainer.validate()
    model = Classifier(seed=3)
    val, _ = _eval_sets(tiny_data())
    want = _lightning().validate(Classifier(seed=3), val, verbose=False)
    _same_metrics(trainer.validate(model, datamodule=tiny_data(), verbose=False), want)
    with pytest.raises(ConfigError, match="defines no test_step"):
        trainer.test(TinyClassifier(), datamodule=tiny_data())
