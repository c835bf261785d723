"""DP-SGD on models with frozen layers after trainable ones (a LoRA model whose frozen head is tied to
its frozen embedding, as GPT-2's ``lm_head``; a frozen head; a frozen eval-mode BatchNorm after a
trainable convolution) and on ResNet-like blocks with in-place ReLUs and residuals (``fix_model``).
Per-record gradients and clipping cover the trainable parameters only, as plain Opacus's do; the
frozen ones stay bit-identical and get no noise; a failed ``fix_model`` run puts the user's layers
back."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from opacus import GradSampleModule
from torch import nn

from dpfl_lightning import ConfigError
from dpfl_lightning.plugins import DPSGD
from dpfl_lightning.plugins.callback import FederatedCallback
from helpers import TinyClassifier, quiet_trainer, tiny_data


class LoRALinear(nn.Module):
    """A frozen pretrained linear layer plus a trainable low-rank update ``B A``."""

    def __init__(self, d: int, rank: int = 2):
        super().__init__()
        self.base = nn.Linear(d, d).requires_grad_(False)
        self.A = nn.Linear(d, rank, bias=False)
        self.B = nn.Linear(rank, d, bias=False)

    def forward(self, x):
        return self.base(x) + self.B(self.A(x))


class LoRAModel(TinyClassifier):
    """GPT-2's layout in miniature: a frozen token embedding, LoRA layers, and a frozen output layer
    whose weight is the embedding's (tied)."""

    def __init__(self, vocab: int = 10, d: int = 12):
        super().__init__()
        del self.net
        torch.manual_seed(0)
        self.wte = nn.Embedding(vocab, d).requires_grad_(False)
        self.h1, self.h2 = LoRALinear(d), LoRALinear(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, x):
        tokens = (x.abs() * 3).long().clamp(max=self.wte.num_embeddings - 1)  # 10 "tokens" per record
        h = self.wte(tokens).mean(1)
        return self.lm_head(torch.tanh(self.h2(torch.tanh(self.h1(h)))))


class FrozenHead(TinyClassifier):
    def __init__(self, in_features: int = 10, **kw):
        super().__init__(in_features=in_features, **kw)
        self.net[2].requires_grad_(False)


class FrozenBatchNorm(TinyClassifier):
    """A trainable convolution, then a pretrained BatchNorm frozen in eval mode, then a trainable head."""

    def __init__(self, **kw):
        super().__init__(**kw)
        del self.net
        torch.manual_seed(0)
        self.conv = nn.Conv1d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm1d(4)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.5, 2.0)
            self.bn.weight.uniform_(0.5, 1.5)
        self.bn.eval().requires_grad_(False)
        self.fc = nn.Linear(40, 10)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x.unsqueeze(1)))).flatten(1))


class BasicBlock(nn.Module):
    """torchvision's ResNet ``BasicBlock`` in one dimension: in-place ReLUs and ``out += identity``."""

    def __init__(self, c: int, norm=nn.BatchNorm1d):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv1d(c, c, 3, padding=1, bias=False), norm(c)
        self.relu = nn.ReLU(inplace=True)
        self.conv2, self.bn2 = nn.Conv1d(c, c, 3, padding=1, bias=False), norm(c)

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResNetLike(TinyClassifier):
    def __init__(self, norm=nn.BatchNorm1d, fail_in_round: int | None = None, **kw):
        super().__init__(**kw)
        del self.net
        torch.manual_seed(0)
        self.stem, self.bn = nn.Conv1d(1, 4, 3, padding=1, bias=False), norm(4)
        self.relu = nn.ReLU(inplace=True)
        self.block = BasicBlock(4, norm)
        self.fc = nn.Linear(40, 10)
        self.fail_in_round = fail_in_round

    def forward(self, x):
        return self.fc(self.block(self.relu(self.bn(self.stem(x.unsqueeze(1))))).flatten(1))

    def training_step(self, batch, batch_idx):
        if self.current_epoch == self.fail_in_round:
            raise RuntimeError("a failure in the middle of the run")
        return super().training_step(batch, batch_idx)


def in_place_without_norm():  # no layer to fix: the in-place ReLU and the residual follow trainable layers
    return ResNetLike(norm=lambda c: nn.Identity())


def keeping_batches(model):
    def training_step(batch, batch_idx):
        model.last_batch = batch
        return type(model).training_step(model, batch, batch_idx)

    model.training_step = training_step
    return model


class Spy(FederatedCallback):
    """At every local step: the trainable parameters' per-record gradients, the frozen ones' (none
    expected), the batch and the parameters."""

    def __init__(self):
        self.seen = []

    def on_before_optimizer_step(self, *, client, optimizer):
        m = client.model
        named = list(m.named_parameters())
        self.seen.append(({n: p.grad_sample.detach().clone() for n, p in named if p.requires_grad},
                          [n for n, p in named if not p.requires_grad and getattr(p, "grad_sample", None) is not None],
                          [t.clone() for t in m.last_batch], {n: p.detach().clone() for n, p in named}))


def _per_example_gradients(ref, params, x, y):
    """Each record's gradient of the trainable parameters, one backward per record (the oracle)."""
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(params[n])
    out = []
    for i in range(x.shape[0]):
        ref.zero_grad()
        F.cross_entropy(ref(x[i : i + 1]), y[i : i + 1]).backward()
        out.append({n: p.grad.clone() for n, p in ref.named_parameters() if p.requires_grad})
    return out


# (model, fix_model, whether plain Opacus runs it: its full backward hooks refuse in-place operations)
CASES = {"lora": (LoRAModel, False, True), "frozen_head": (FrozenHead, False, True),
         "frozen_batchnorm": (FrozenBatchNorm, False, True), "resnet_fixed": (ResNetLike, True, False),
         "in_place_residual": (in_place_without_norm, False, False)}


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.parametrize("case", list(CASES))
def test_per_record_gradients_of_the_trainable_parameters_equal_a_per_example_loop(log_dir, case):
    build, fix, opacus_runs = CASES[case]
    spy, model = Spy(), keeping_batches(build())
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=2, batch_size=5, local_steps=2,
                            plugins=[DPSGD(noise_multiplier=0.5, max_grad_norm=1.0, fix_model=fix), spy])
    trainer.fit(model, tiny_data(num_clients=4, samples=20))
    assert len(spy.seen) == 4
    ref = copy.deepcopy(model)  # after fit: an ordinary module (fixed layers included), no hooks
    plain = GradSampleModule(copy.deepcopy(model)) if opacus_runs else None  # plain Opacus, same model and batch
    for grad_samples, frozen_with_samples, (x, y), params in spy.seen:
        assert frozen_with_samples == []
        assert set(grad_samples) == {n for n, p in model.named_parameters() if p.requires_grad}
        for i, g in enumerate(_per_example_gradients(ref, params, x, y)):
            for n, gs in grad_samples.items():
                assert torch.allclose(gs[i], g[n], atol=1e-6), n
        if plain is None:
            continue
        _per_example_gradients(plain._module, params, x[:0], y[:0])  # (loads the parameters)
        plain.zero_grad()
        F.cross_entropy(plain(x), y).backward()
        for n, p in plain._module.named_parameters():
            if p.requires_grad:
                assert torch.allclose(p.grad_sample, grad_samples[n], atol=1e-6), n


@pytest.mark.parametrize("case", ["lora", "frozen_head", "frozen_batchnorm"])
def test_clipping_is_over_the_trainable_parameters_and_frozen_ones_stay_bit_identical(log_dir, case):
    C, B = 0.05, 5
    spy, model = Spy(), keeping_batches(CASES[case][0]())
    model.lr = 1.0
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=1, batch_size=B, local_steps=1,
                            plugins=[DPSGD(noise_multiplier=0.0, max_grad_norm=C, allow_infinite_epsilon=True), spy])
    trainer.fit(model, tiny_data(num_clients=2, samples=20))
    (_, _, (x, y), params), = spy.seen
    grads = _per_example_gradients(copy.deepcopy(model), params, x, y)
    names = list(grads[0])
    flat = torch.stack([torch.cat([g[n].flatten() for n in names]) for g in grads]).double()
    norms = flat.norm(dim=1)
    assert (norms > C).all()  # every record is clipped
    expected = (flat * (C / (norms + 1e-6))[:, None]).sum(0) / B  # Opacus's rule, over the trainable part only
    after = dict(model.named_parameters())
    step = torch.cat([(before[n] - after[n].detach()).flatten() for n in names]).double()  # SGD, lr 1, no noise
    assert torch.allclose(step, expected, atol=1e-6)
    for n in frozen:
        assert torch.equal(after[n].detach(), before[n]), n
    for n, b in model.named_buffers():  # the frozen BatchNorm's statistics too (eval mode)
        assert torch.equal(b, buffers[n]), n


class ZeroLoss(FrozenHead):
    def training_step(self, batch, batch_idx):
        return 0.0 * self(batch[0]).sum()  # every per-record gradient is 0: the step is the noise


def test_the_noise_is_on_the_trainable_parameters_only(log_dir):
    z, C, B, steps = 0.8, 2.0, 4, 3
    model = ZeroLoss(in_features=200, lr=1.0)
    head = [p.detach().clone() for p in model.net[2].parameters()]
    before = torch.cat([p.detach().flatten().clone() for p in model.net[0].parameters()]).double()
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=4, batch_size=B, local_steps=steps,
                            plugins=[DPSGD(noise_multiplier=z, max_grad_norm=C)])
    trainer.fit(model, tiny_data(num_clients=4, samples=20, dim=200))
    assert all(torch.equal(p.detach(), h) for p, h in zip(model.net[2].parameters(), head))  # no noise, no step
    after = torch.cat([p.detach().flatten() for p in model.net[0].parameters()]).double()
    # each client: the sum of `steps` draws N(0, (zC)^2) / B; FedAvg averages the 4 clients
    moved = (after - before) * B * math.sqrt(4) / math.sqrt(steps)
    assert moved.numel() == 200 * 16 + 16
    assert moved.std().item() == pytest.approx(z * C, rel=0.06)  # 3216 draws: rel. s.e. 1.3%


def test_a_lora_model_trains_under_dpsgd_with_its_frozen_weights_unchanged(log_dir):
    model = LoRAModel()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert set(adapters) == {"h1.A.weight", "h1.B.weight", "h2.A.weight", "h2.B.weight"}
    trainer = quiet_trainer(log_dir, rounds=3, clients_per_round=3, batch_size=6,
                            plugins=[DPSGD(noise_multiplier=0.5, max_grad_norm=1.0)])
    trainer.fit(model, tiny_data(num_clients=6))
    params = dict(model.named_parameters())
    assert model.lm_head.weight is model.wte.weight  # still tied
    assert all(torch.equal(params[n].detach(), v) for n, v in frozen.items())
    assert all(not torch.equal(params[n].detach(), v) for n, v in adapters.items())
    assert math.isfinite(trainer.history[-1]["my_val_loss"]) and math.isfinite(trainer.history[-1]["epsilon"])


def test_fix_model_trains_a_resnet_like_model(log_dir):
    model = ResNetLike()
    trainer = quiet_trainer(log_dir, rounds=2, clients_per_round=2, batch_size=8,
                            plugins=[DPSGD(noise_multiplier=0.5, fix_model=True)])
    trainer.fit(model, tiny_data())
    assert [type(m).__name__ for m in (model.bn, model.block.bn1, model.block.bn2)] == ["GroupNorm"] * 3
    assert isinstance(model.relu, nn.ReLU) and model.relu.inplace  # kept: in-place operations need no fix
    assert len(trainer.history) == 2 and math.isfinite(trainer.history[-1]["my_val_loss"])


def _layers(model):
    return {name: (m, copy.deepcopy(m.state_dict())) for name, m in model.named_modules()}


def _assert_as_given(model, layers):
    now = dict(model.named_modules())
    assert list(now) == list(layers)
    for name, (m, state) in layers.items():
        assert now[name] is m, name
        if not list(m.children()) and isinstance(m, nn.BatchNorm1d):  # the replaced layers: exactly as built
            assert all(torch.equal(v, state[k]) for k, v in m.state_dict().items()), name


@pytest.mark.parametrize("when", ["first_step", "round_1", "dpsgd_set_up"])
def test_a_failed_fix_model_run_puts_the_users_layers_back(log_dir, when):
    model = ResNetLike(fail_in_round={"first_step": 0, "round_1": 1}.get(when))
    layers = _layers(model)
    kw = dict(batch_size=None) if when == "dpsgd_set_up" else dict(batch_size=8)
    trainer = quiet_trainer(log_dir, rounds=3, clients_per_round=2, plugins=[DPSGD(noise_multiplier=0.5, fix_model=True)],
                            **kw)
    error = ConfigError if when == "dpsgd_set_up" else RuntimeError
    with pytest.warns(UserWarning, match="the run failed; ResNetLike has its own layers back"):
        with pytest.raises(error, match="batch size" if when == "dpsgd_set_up" else "middle of the run"):
            trainer.fit(model, tiny_data())
    _assert_as_given(model, layers)
    assert len(trainer.history) == (1 if when == "round_1" else 0)
    # and the same module trains afterwards, fixed again
    quiet_trainer(log_dir, rounds=1, clients_per_round=2, batch_size=8,
                  plugins=[DPSGD(noise_multiplier=0.5, fix_model=True)]).fit(ResNetLike(), tiny_data())


def test_a_successful_fix_model_run_called_inside_an_except_block_keeps_the_fixed_layers(log_dir):
    model = ResNetLike()
    try:
        raise KeyError("the caller's own, handled")
    except KeyError:
        quiet_trainer(log_dir, rounds=1, clients_per_round=2, batch_size=8,
                      plugins=[DPSGD(noise_multiplier=0.5, fix_model=True)]).fit(model, tiny_data())
    assert isinstance(model.bn, nn.GroupNorm)
