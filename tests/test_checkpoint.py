"""Checkpoints: written atomically, and a resumed run ends exactly where an uninterrupted one does."""

import glob
import hashlib
import os

import pytest
import torch

from dpfl_lightning import ConfigError
from dpfl_lightning.run import checkpoint_format as ckpt
from dpfl_lightning.tracking import run_files
from dpfl_lightning.plugins import GaussianNoise, ServerOptimizer, UpdateClipping
from dpfl_lightning.plugins.callback import FederatedCallback
from dpfl_lightning.tracking.run_files import read_metrics
from helpers import TinyClassifier, quiet_trainer, tiny_data


class Participation(FederatedCallback):
    """Per-client state: how often each client trained (lives with the client, not the rank)."""

    keeps_client_state = True

    def on_client_end(self, *, client):
        state = client.state
        state["n"] = state.get("n", 0) + 1


def _plugins():
    return [UpdateClipping(0.5), GaussianNoise(noise_multiplier=0.3), Participation(),
            ServerOptimizer("sgd", lr=0.8, momentum=0.9)]


def _trainer(log_dir, **kw):
    # log_client_metrics: the (un-noised) training loss is logged too, so its history can be compared
    return quiet_trainer(log_dir, rounds=6, clients_per_round=5, plugins=_plugins(), seed=11, log_client_metrics=True, **kw)


@pytest.mark.parametrize("executor", ["sequential", "vmap"])
def test_resume_equals_uninterrupted_run(tmp_path, executor):
    full = _trainer(str(tmp_path / "a"), checkpoint_every=3, executor=executor)
    ref = full.fit(TinyClassifier(), tiny_data())
    first = os.path.join(full.checkpoint_dir, "round-000003.ckpt")
    state = ckpt.load(first)
    assert state["round"] == 3
    momentum = state["plugins"]["ServerOptimizer"]["optimizer"]["state"][0]["momentum_buffer"]
    assert torch.count_nonzero(momentum) > 0  # the server optimizer's state is saved
    assert state["client_states"] and all(isinstance(c, int) for c in state["client_states"])

    resumed = _trainer(str(tmp_path / "b"), executor=executor)
    out = resumed.fit(TinyClassifier(seed=123), tiny_data(), ckpt_path=first)  # different init: overwritten
    assert torch.equal(out.global_params, ref.global_params)
    assert resumed.client_states == full.client_states
    assert [h["my_train_loss"] for h in resumed.history] == [h["my_train_loss"] for h in full.history]
    assert [h["epsilon"] for h in resumed.history] == [h["epsilon"] for h in full.history]
    last = ckpt.load(os.path.join(full.checkpoint_dir, "last.ckpt"))
    assert last["round"] == 6 and torch.equal(last["global_params"], ref.global_params)


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    path = str(tmp_path / "c.ckpt")
    ckpt.save_atomic({"format": ckpt.FORMAT, "v": 1}, path)

    def broken_save(obj, f, *a, **k):
        f.write(b"partial bytes")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError):
        ckpt.save_atomic({"format": ckpt.FORMAT, "v": 2}, path)
    monkeypatch.undo()
    assert ckpt.load(path)["v"] == 1  # the old checkpoint is intact
    assert os.listdir(tmp_path) == ["c.ckpt"]  # no temporary left behind


def test_resume_refuses_a_different_model(tmp_path):
    t = _trainer(str(tmp_path / "a"), checkpoint_every=6)
    t.fit(TinyClassifier(), tiny_data())
    other = _trainer(str(tmp_path / "b"))
    with pytest.raises(ConfigError, match="num_parameters"):
        other.fit(TinyClassifier(in_features=12), tiny_data(dim=12), ckpt_path=os.path.join(t.checkpoint_dir, "last.ckpt"))


def test_resume_from_missing_or_foreign_file(tmp_path):
    t = _trainer(str(tmp_path / "a"))
    with pytest.raises(ConfigError, match="resume"):
        t.fit(TinyClassifier(), tiny_data(), ckpt_path=str(tmp_path / "nope.ckpt"))
    junk = tmp_path / "junk.ckpt"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="resume"):
        t.fit(TinyClassifier(), tiny_data(), ckpt_path=str(junk))


def test_no_checkpoint_files_unless_asked(tmp_path):
    t = _trainer(str(tmp_path / "a"))
    t.fit(TinyClassifier(), tiny_data())
    assert not glob.glob(str(tmp_path / "**" / "*.ckpt"), recursive=True)


class Counter(FederatedCallback):
    """A stateful server-side plugin: counts rounds."""

    def __init__(self):
        self.n = 0

    def on_round_end(self, *, server, metrics):
        self.n += 1

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


class Logger(FederatedCallback):
    """A stateless plugin added on resume."""

    def on_round_end(self, *, server, metrics):
        metrics["logger_round"] = float(server.round_idx)


def test_state_is_keyed_so_a_stateless_plugin_can_be_added_on_resume(tmp_path):
    def trainer(log_dir, plugins, **kw):
        return quiet_trainer(log_dir, rounds=4, clients_per_round=3, plugins=plugins, seed=5, **kw)

    a_counter, a_part = Counter(), Participation()
    a = trainer(str(tmp_path / "a"), [a_counter, a_part, ServerOptimizer("sgd", lr=1.0, momentum=0.5)], checkpoint_every=2)
    ref = a.fit(TinyClassifier(), tiny_data())
    mid = os.path.join(a.checkpoint_dir, "round-000002.ckpt")
    b_counter = Counter()
    b = trainer(str(tmp_path / "b"), [b_counter, Logger(), Participation(), ServerOptimizer("sgd", lr=1.0, momentum=0.5)])
    out = b.fit(TinyClassifier(), tiny_data(), ckpt_path=mid)
    assert torch.equal(out.global_params, ref.global_params)
    assert b_counter.n == a_counter.n == 4
    # a stateful plugin missing from the new run is refused: its state would be lost silently
    c = trainer(str(tmp_path / "c"), [Participation(), ServerOptimizer("sgd", lr=1.0, momentum=0.5)])
    with pytest.raises(ConfigError, match="Counter"):
        c.fit(TinyClassifier(), tiny_data(), ckpt_path=mid)


def test_two_stateful_plugins_of_one_class_need_distinct_keys(tmp_path):
    trainer = quiet_trainer(str(tmp_path), rounds=1, clients_per_round=2, plugins=[Counter(), Counter()])
    with pytest.raises(ConfigError, match="state_key"):
        trainer.fit(TinyClassifier(), tiny_data())


# ---------------------------------------------------------------------------------------- one version per fit
def _hash(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _versioned(log_dir, rounds, **kw):
    return quiet_trainer(log_dir, rounds=rounds, clients_per_round=3, run_name="run", checkpoint_every=1, **kw)


def test_a_second_run_of_the_same_name_keeps_the_first_runs_checkpoints(tmp_path):
    first = _versioned(str(tmp_path), 2, final_checkpoint=True)
    first.fit(TinyClassifier(), tiny_data())
    v0 = str(tmp_path / "run" / "version_0" / "checkpoints")
    assert first.checkpoint_dir == v0 and first.csv_log_dir == os.path.dirname(v0)
    kept = {name: _hash(os.path.join(v0, name)) for name in os.listdir(v0)}
    assert set(kept) == {"round-000001.ckpt", "round-000002.ckpt", "last.ckpt", "final.ckpt"}

    second = _versioned(str(tmp_path), 3, final_checkpoint=True)
    second.fit(TinyClassifier(seed=4), tiny_data())
    assert second.checkpoint_dir == str(tmp_path / "run" / "version_1" / "checkpoints")
    assert {name: _hash(os.path.join(v0, name)) for name in os.listdir(v0)} == kept  # untouched
    assert ckpt.load(os.path.join(second.checkpoint_dir, "last.ckpt"))["round"] == 3
    assert _hash(os.path.join(second.checkpoint_dir, "final.ckpt")) != kept["final.ckpt"]


def test_resume_last_continues_the_newest_version_in_place(tmp_path):
    ref = _versioned(str(tmp_path / "ref"), 4).fit(TinyClassifier(), tiny_data())
    _versioned(str(tmp_path), 3).fit(TinyClassifier(), tiny_data())  # version_0: 3 rounds
    _versioned(str(tmp_path), 2).fit(TinyClassifier(), tiny_data())  # version_1: 2 rounds, newest
    v0_last = _hash(str(tmp_path / "run" / "version_0" / "checkpoints" / "last.ckpt"))
    resumed = _versioned(str(tmp_path), 4)
    out = resumed.fit(TinyClassifier(), tiny_data(), ckpt_path="last")
    v1 = tmp_path / "run" / "version_1"
    assert resumed.checkpoint_dir == str(v1 / "checkpoints") and resumed.csv_log_dir == str(v1)
    assert torch.equal(out.global_params, ref.global_params)  # it went on from version_1's round 2
    assert sorted(os.listdir(tmp_path / "run")) == ["version_0", "version_1"]  # no new version
    assert [row["round"] for row in read_metrics(str(v1 / "metrics.csv"))] == [1, 2, 3, 4]
    assert _hash(str(tmp_path / "run" / "version_0" / "checkpoints" / "last.ckpt")) == v0_last


def test_a_named_checkpoint_continues_its_own_version_and_another_runs_starts_a_new_one(tmp_path):
    _versioned(str(tmp_path), 3).fit(TinyClassifier(), tiny_data())  # version_0
    _versioned(str(tmp_path), 3).fit(TinyClassifier(), tiny_data())  # version_1
    mid = str(tmp_path / "run" / "version_0" / "checkpoints" / "round-000002.ckpt")
    again = _versioned(str(tmp_path), 3)
    again.fit(TinyClassifier(), tiny_data(), ckpt_path=mid)
    assert again.checkpoint_dir == os.path.dirname(mid)
    other = _versioned(str(tmp_path / "other"), 3)
    other.fit(TinyClassifier(), tiny_data(), ckpt_path=mid)  # another run's checkpoint: a version of its own
    assert other.checkpoint_dir == str(tmp_path / "other" / "run" / "version_0" / "checkpoints")
    assert [row["round"] for row in read_metrics(os.path.join(other.csv_log_dir, "metrics.csv"))] == [3]


def test_checkpoints_of_older_runs_in_the_shared_directory_still_resume(tmp_path):
    shared = str(tmp_path / "run" / "checkpoints")  # where runs kept them before they were per version
    _versioned(str(tmp_path), 2, checkpoint_dir=shared).fit(TinyClassifier(), tiny_data())
    state = ckpt.load(os.path.join(shared, "last.ckpt"))
    del state["log_version"]  # as an older version wrote it
    ckpt.save_atomic(state, os.path.join(shared, "last.ckpt"))
    resumed = _versioned(str(tmp_path), 3)
    resumed.fit(TinyClassifier(), tiny_data(), ckpt_path="last")
    assert resumed.history[0]["round"] == 1 and len(resumed.history) == 3  # restored rounds 1-2, then round 3
    assert resumed.csv_log_dir == str(tmp_path / "run" / "version_0")  # the run's version, continued
    assert os.path.isfile(str(tmp_path / "run" / "version_0" / "checkpoints" / "round-000003.ckpt"))


def test_a_version_is_claimed_once(tmp_path):
    root = str(tmp_path / "run")
    os.makedirs(os.path.join(root, "version_4"))
    os.makedirs(os.path.join(root, "version_x"))
    assert [run_files.claim_version(root) for _ in range(3)] == [5, 6, 7]
    assert run_files.versions(root) == [4, 5, 6, 7]


def test_a_run_directory_names_its_newest_version_with_a_checkpoint(tmp_path):
    from dpfl_lightning.run.lightning_eval import resolve_run

    root = tmp_path / "quickstart"
    for version, files in ((0, ["config.yaml", "checkpoints/last.ckpt"]),
                           (1, ["config.yaml", "checkpoints/final.ckpt", "checkpoints/last.ckpt"]),
                           (2, ["config.yaml"])):  # the newest stopped before its first checkpoint
        for name in files:
            (root / f"version_{version}" / name).parent.mkdir(parents=True, exist_ok=True)
            (root / f"version_{version}" / name).write_text("x")
    v1 = root / "version_1"
    assert resolve_run(str(root)) == (str(v1 / "config.yaml"), str(v1 / "checkpoints" / "final.ckpt"))
    v0 = root / "version_0"
    assert resolve_run(str(v0)) == (str(v0 / "config.yaml"), str(v0 / "checkpoints" / "last.ckpt"))
    assert resolve_run(str(v0 / "checkpoints" / "last.ckpt"))[0] == str(v0 / "config.yaml")
    assert resolve_run(str(root / "version_2")) == (str(root / "version_2" / "config.yaml"), None)


class _StepDecay(TinyClassifier):
    """A learning rate stepped every local optimizer step: where each client starts a round follows its
    own steps per round (its batches), which a resumed run recomputes from the data."""

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.7),
                                                   "interval": "step"}}


def _uneven_clients():
    """Clients of 5, 9 and 14 records: 2, 3 and 4 batches of 4 a local epoch."""
    from dpfl_lightning import FederatedDataModule

    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(40, 10, generator=g), torch.arange(40) % 10
    clients = [list(range(0, 5)), list(range(5, 14)), list(range(14, 28))]
    return FederatedDataModule.from_tensors(x, y, x[28:], y[28:], client_indices=clients)


def test_a_dp_run_under_local_epochs_writes_the_rounds_as_global_step_and_resumes_exactly(tmp_path):
    """A DP run whose clients' steps per round follow their sizes writes ``global_step`` = rounds done
    (the largest client's 4 batches x rounds would speak about one client's data); nothing reads it
    back: the resumed run recomputes each client's schedule from the data and ends bit-identical to
    the uninterrupted one, and its Lightning checkpoint loads in ``lightning.Trainer``."""
    import lightning

    def trainer(log_dir, rounds, **kw):
        return quiet_trainer(log_dir, rounds=rounds, local_epochs=1, seed=5, checkpoint_every=1,
                             plugins=[UpdateClipping(0.5), GaussianNoise(noise_multiplier=0.3)], **kw)

    full = trainer(str(tmp_path / "a"), 4, final_checkpoint=True)
    ref = full.fit(_StepDecay(), _uneven_clients())
    assert [ckpt.load(os.path.join(full.checkpoint_dir, f"round-{r:06d}.ckpt"))["global_step"]
            for r in (1, 2, 3, 4)] == [1, 2, 3, 4]
    first = trainer(str(tmp_path / "b"), 2)
    first.fit(_StepDecay(), _uneven_clients())
    resumed = trainer(str(tmp_path / "b"), 4)
    out = resumed.fit(_StepDecay(seed=9), _uneven_clients(), ckpt_path="last")
    assert torch.equal(out.global_params, ref.global_params)
    assert ckpt.load(os.path.join(resumed.checkpoint_dir, "last.ckpt"))["global_step"] == 4

    final = os.path.join(full.checkpoint_dir, "final.ckpt")
    g = torch.Generator().manual_seed(4)
    test_set = torch.utils.data.TensorDataset(torch.randn(8, 10, generator=g), torch.arange(8) % 10)
    pl = lightning.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False,
                           enable_checkpointing=False, default_root_dir=str(tmp_path / "pl"))
    model = _StepDecay(seed=9)
    checked = pl.validate(model, dataloaders=torch.utils.data.DataLoader(test_set, batch_size=4), ckpt_path=final,
                          verbose=False)
    saved = torch.load(final, weights_only=False)
    assert checked and (saved["epoch"], saved["global_step"]) == (4, 4)
    assert all(torch.equal(v, saved["state_dict"][k]) for k, v in model.state_dict().items())
