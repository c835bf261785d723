"""DP-SGD on a Hugging Face GPT-2 (2 layers, a tiny config built here: nothing is downloaded). Its
default position ids, of shape (1, T), run the position embedding ``transformer.wpe`` on a row that
the whole batch shares, which Opacus cannot split by record: refused at the first step, naming the
layer and the fix; with the ids expanded to the batch it trains, and its per-record gradients (tied
``wte``/``lm_head``, HF's ``Conv1D``, LayerNorm) equal a per-example loop's."""

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from dpfl_lightning import ConfigError
from dpfl_lightning.data import FederatedDataModule
from dpfl_lightning.plugins import DPSGD
from dpfl_lightning.plugins.callback import FederatedCallback
from helpers import quiet_trainer

transformers = pytest.importorskip("transformers")

VOCAB, LENGTH = 50, 8


class TinyGPT2(L.LightningModule):
    def __init__(self, expand_positions: bool):
        super().__init__()
        torch.manual_seed(0)
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                         bos_token_id=0, eos_token_id=0)
        self.gpt = transformers.GPT2LMHeadModel(config)
        self.expand_positions = expand_positions

    def forward(self, ids):
        if not self.expand_positions:
            return self.gpt(ids).logits
        B, T = ids.shape
        return self.gpt(ids, position_ids=torch.arange(T, device=ids.device).expand(B, T)).logits

    def loss(self, ids):  # next-token prediction
        return F.cross_entropy(self(ids)[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

    def training_step(self, batch, batch_idx):
        self.last_batch = batch[0]
        return self.loss(batch[0])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch[0]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


PER_CLIENT = 10  # every client's records: the public records_per_client DP-SGD accounts


def token_data(num_clients=4, per_client=PER_CLIENT):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (num_clients * per_client, LENGTH), generator=g)
    labels = torch.zeros(len(ids), dtype=torch.long)
    return FederatedDataModule.from_tensors(ids, labels, ids[:8], labels[:8], num_clients=num_clients)


class Spy(FederatedCallback):
    def __init__(self):
        self.seen = []

    def on_before_optimizer_step(self, *, client, optimizer):
        m = client.model
        self.seen.append(([p.grad_sample.detach().clone() for p in m.parameters()], m.last_batch.clone(),
                          [p.detach().clone() for p in m.parameters()]))


def test_gpt2_default_position_ids_are_refused_at_the_first_step_naming_wpe_and_the_fix(log_dir):
    spy = Spy()
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=2, batch_size=4,
                            records_per_client=PER_CLIENT, plugins=[DPSGD(noise_multiplier=1.0), spy])
    with pytest.raises(ConfigError, match=r"^DPSGD=\['gpt\.transformer\.wpe'\]: .*fewer rows than the batch has "
                                          r"records.*Fix: .*position_ids=torch\.arange\(T\)\.expand\(B, T\)"):
        trainer.fit(TinyGPT2(expand_positions=False), token_data())
    assert spy.seen == []  # refused before the first step


def test_gpt2_with_expanded_position_ids_trains_with_per_record_gradients_of_a_loop(log_dir):
    spy = Spy()
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=2, batch_size=4, local_steps=2,
                            records_per_client=PER_CLIENT, plugins=[DPSGD(noise_multiplier=1.0), spy])
    trainer.fit(TinyGPT2(expand_positions=True), token_data())
    assert len(spy.seen) == 4
    ref = TinyGPT2(expand_positions=True)
    for grad_samples, ids, params in spy.seen:
        assert all(g.shape[0] == ids.shape[0] for g in grad_samples)
        with torch.no_grad():
            for p, v in zip(ref.parameters(), params):
                p.copy_(v)
        for i in range(ids.shape[0]):
            ref.zero_grad()
            ref.loss(ids[i : i + 1]).backward()
            for p, gs in zip(ref.parameters(), grad_samples):
                assert torch.allclose(p.grad, gs[i], atol=1e-6)
