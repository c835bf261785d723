"""FederatedCallback.on_client_released: what each client sent, after every plugin's on_client_end and
before the row is summed, read-only; in both executors."""

import os

import pytest
import torch

from dpfl_lightning.cli import command as cli
from dpfl_lightning.errors import ReleaseWriteError
from dpfl_lightning.federated.payload import Segment
from dpfl_lightning.plugins import FederatedCallback, GaussianNoise, UpdateClipping
from helpers import TinyClassifier, quiet_trainer, tiny_data

ROUNDS, COHORT = 2, 4
QUICKSTART = os.path.join(os.path.dirname(__file__), "..", "configs", "quickstart.yaml")


class Stamp(FederatedCallback):
    """Last on_client_end of all: writes client + 1 into its own segment."""

    order = 999

    def __init__(self, log):
        self.log = log

    def payload_segments(self, *, ctx):
        return [Segment("stamp", 1, "released", "Stamp")]

    def on_client_end(self, *, client):
        client.payload["stamp"].fill_(client.client + 1)
        self.log.append(("end", client.round_idx, client.client))


class Reader(FederatedCallback):
    """First plugin of all: records what each client released and the cohort's sums."""

    order = 0

    def __init__(self, log):
        self.log, self.released, self.sums = log, {}, {}

    def on_client_released(self, *, client, released):
        self.log.append(("released", client.round_idx, client.client))
        self.released.setdefault(client.round_idx, []).append({k: v.clone() for k, v in released.items()})

    def on_aggregate(self, *, server):
        self.sums[server.round_idx] = {k: server.aggregate[k].clone() for k in ("stamp", "update")}


class Writer(FederatedCallback):
    """Tries to change what is summed from on_client_released."""

    def __init__(self):
        self.refused = 0

    def on_client_released(self, *, client, released):
        released["update"].add_(1e3)
        client.payload["update"].mul_(-7.0)
        try:
            released["update"] = torch.zeros(1)
        except TypeError:
            self.refused += 1


def _fit(log_dir, executor, plugins):
    t = quiet_trainer(log_dir, rounds=ROUNDS, clients_per_round=COHORT, seed=0, executor=executor, plugins=plugins)
    torch.manual_seed(0)
    return t.fit(TinyClassifier(), tiny_data(num_clients=8)).global_params.clone()


@pytest.mark.parametrize("executor", ["sequential", "vmap"])
def test_released_is_the_row_summed_after_every_on_client_end(log_dir, executor):
    log = []
    reader = Reader(log)
    _fit(log_dir, executor, [reader, Stamp(log), UpdateClipping(0.5),
                             GaussianNoise(noise_multiplier=0.5, placement="local")])
    for r in range(ROUNDS):
        ends = [e for e in log if e[1] == r and e[0] == "end"]
        seen = [e for e in log if e[1] == r and e[0] == "released"]
        assert len(ends) == len(seen) == COHORT  # once per client, each after that client's last on_client_end
        assert all(log.index(("end", r, c)) < log.index(("released", r, c)) for _, _, c in ends)
        rows = reader.released[r]
        stamps = sorted(int(row["stamp"].item()) for row in rows)
        assert stamps == sorted(c + 1 for _, _, c in ends)  # written by the order-999 plugin, seen by order 0
        assert float(reader.sums[r]["stamp"].item()) == sum(stamps)
        summed = torch.stack([row["update"] for row in rows]).sum(0)
        torch.testing.assert_close(reader.sums[r]["update"], summed.to(reader.sums[r]["update"]), rtol=0, atol=1e-5)
        assert max(float(row["update"].norm()) for row in rows) > 0.5  # the local noise is in the release


@pytest.mark.parametrize("executor", ["sequential", "vmap"])
def test_writing_to_the_release_is_refused_or_changes_nothing_summed(log_dir, executor):
    plain = _fit(log_dir, executor, [UpdateClipping(0.5)])
    writer = Writer()
    written = _fit(log_dir, executor, [UpdateClipping(0.5), writer])
    assert writer.refused == ROUNDS * COHORT  # assigning a segment raises
    assert torch.equal(written, plain)  # in-place writes went to copies
    moved = _fit(log_dir, executor, [])
    assert not torch.equal(moved, plain)  # (the clipping plugin does change the model: the check can fail)


PLUGIN_FILE = '''
import torch
from dpfl_lightning.plugins import FederatedCallback


class Overwrite(FederatedCallback):
    def on_client_released(self, *, client, released):
        released["update"] = torch.zeros_like(released["update"])
'''


@pytest.mark.parametrize("write", ["assign", "delete", "payload", "update"])
def test_writing_to_the_release_is_one_error_naming_the_plugin_the_hook_and_the_rule(log_dir, write):
    class Overwrite(FederatedCallback):
        def on_client_released(self, *, client, released):
            if write == "assign":
                released["update"] = torch.zeros(1)
            elif write == "delete":
                del released["update"]
            elif write == "payload":
                client.payload["update"] = torch.zeros(1)
            else:
                released.update({"update": torch.zeros(1)})

    with pytest.raises(ReleaseWriteError) as info:
        _fit(log_dir, "sequential", [UpdateClipping(0.5), Overwrite()])
    message = str(info.value)
    assert "\n" not in message and isinstance(info.value, TypeError)
    assert message.startswith("Overwrite.on_client_released ")
    assert "'update'" in message or "update()" in message
    assert "the release is read-only" in message and "Fix: keep what you derive from it in client.state" in message


def test_the_command_line_prints_a_write_to_the_release_as_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "overwrite.py").write_text(PLUGIN_FILE)
    monkeypatch.chdir(tmp_path)
    args = ["fit", "--config", QUICKSTART, "--trainer.rounds", "1", "--trainer.loggers", "[]",
            "--trainer.enable_progress_bar", "false", "--trainer.enable_summary", "false",
            "--trainer.checkpoint_every", "null", "--trainer.log_dir", str(tmp_path / "runs"),
            "--trainer.plugins+", "overwrite.Overwrite"]
    with pytest.raises(SystemExit) as info:
        cli.main(args)
    assert info.value.code == 1
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line.startswith("dpfl: error")]
    assert lines == [lines[0]] and lines[0].startswith("dpfl: error: Overwrite.on_client_released assigned "
                                                       "released['update']: the release is read-only"), err
    assert "Traceback" not in err, err
