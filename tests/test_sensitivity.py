"""Update clipping and normalization: the norm bound holds exactly, not up to rounding."""

import math

import pytest
import torch

from dpfl_lightning import ConfigError
from dpfl_lightning.federated.plan import RoundPlan
from dpfl_lightning.plugins import ClientContext, UpdateClipping, UpdateNormalization
from dpfl_lightning.rng import RandomSource
from helpers import Recorder, TinyClassifier, quiet_trainer, tiny_data


def _client(**payload):
    return ClientContext(0, 0, RoundPlan(0, (0,)), RandomSource(0), {}, payload=payload)


def _apply(plugin, vec):
    ctx = _client(update=vec)
    plugin.on_client_end(client=ctx)
    return ctx.payload["update"]


def _norm64(v):
    return float(torch.linalg.vector_norm(v.double()))


@pytest.mark.parametrize("C", [1e-3, 0.7, 1.0, 3.3, 250.0])
def test_clipped_norm_never_exceeds_C(C):
    g = torch.Generator().manual_seed(1)
    for trial in range(200):
        scale = 10 ** torch.empty(1).uniform_(-3, 3, generator=g).item()
        v = torch.randn(int(torch.randint(1, 5000, (1,), generator=g)), generator=g) * scale
        out = _apply(UpdateClipping(C), v.clone())
        assert _norm64(out) <= C
        if _norm64(v) <= C:
            assert torch.equal(out, v)  # below the bound: untouched
        else:
            assert _norm64(out) == pytest.approx(C, rel=1e-6)
            cos = torch.nn.functional.cosine_similarity(out.double(), v.double(), dim=0)
            assert cos == pytest.approx(1.0, abs=1e-9)  # direction kept


def test_clipping_just_above_the_bound():
    # norms within a few ulp above C are where a naive u * (C/||u||) can land above C
    C = 1.0
    for seed in range(300):
        v = torch.randn(1000, generator=torch.Generator().manual_seed(seed))
        v = v / _norm64(v) * (1 + 1e-7 * (seed % 5))
        assert _norm64(_apply(UpdateClipping(C), v.clone())) <= C


@pytest.mark.parametrize("C", [0.01, 1.0, 40.0])
def test_normalized_norm_equals_C(C):
    g = torch.Generator().manual_seed(2)
    for _ in range(200):
        v = torch.randn(777, generator=g) * 10 ** torch.empty(1).uniform_(-4, 4, generator=g).item()
        out = _apply(UpdateNormalization(C), v.clone())
        assert _norm64(out) <= C
        assert _norm64(out) == pytest.approx(C, rel=1e-6)


@pytest.mark.parametrize("plugin", [UpdateClipping(1.0), UpdateNormalization(1.0)])
def test_zero_update_stays_zero_without_nan(plugin):
    out = _apply(plugin, torch.zeros(100))
    assert torch.isfinite(out).all()
    assert torch.count_nonzero(out) == 0


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_non_positive_or_non_finite_bound_is_refused(bad):
    for cls in (UpdateClipping, UpdateNormalization):
        with pytest.raises(ConfigError, match=f"{cls.__name__}.max_norm"):
            cls(bad)


def test_bound_holds_for_every_client_in_training(log_dir):
    """Through the trainer: what the plugins after clipping see is within the bound."""
    rec = Recorder(order=150)
    trainer = quiet_trainer(log_dir, rounds=2, clients_per_round=5, plugins=[UpdateClipping(0.05), rec])
    trainer.fit(TinyClassifier(lr=0.5), tiny_data())
    assert len(rec.updates) == 10
    assert all(_norm64(u) <= 0.05 for u in rec.updates)
    assert any(_norm64(u) == pytest.approx(0.05, rel=1e-6) for u in rec.updates)  # clipping was active


def test_normalization_in_training_gives_norm_C(log_dir):
    rec = Recorder(order=150)
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=6, plugins=[UpdateNormalization(3.0), rec])
    trainer.fit(TinyClassifier(lr=0.01), tiny_data())
    assert [pytest.approx(3.0, rel=1e-6)] * 6 == [_norm64(u) for u in rec.updates]


@pytest.mark.parametrize("tiny", [1e-40, 1e-45, 1e-30])
def test_normalizing_a_tiny_update_returns_with_norm_C(tiny):
    # C / ||u|| overflows float32 for such vectors: the factor is applied in float64
    for C in (1.0, 40.0):
        v = torch.full((1000,), tiny, dtype=torch.float32)
        out = _apply(UpdateNormalization(C), v)
        assert torch.isfinite(out).all()
        n = _norm64(out)
        assert n <= C and (n == pytest.approx(C, rel=1e-5) or n == 0.0)


def test_segments_are_bounded_jointly():
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(300, generator=g) * 5, torch.randn(40, generator=g) * 5
    ctx = _client(update=a.clone(), dc=b.clone())
    UpdateClipping(2.0, segments=["update", "dc"]).on_client_end(client=ctx)
    joint = math.sqrt(_norm64(ctx.payload["update"]) ** 2 + _norm64(ctx.payload["dc"]) ** 2)
    assert joint <= 2.0 and joint == pytest.approx(2.0, rel=1e-6)
    ratio = ctx.payload["update"].double() / a.double()  # one factor for both segments
    assert torch.allclose(ratio, ctx.payload["dc"].double()[:1] / b.double()[:1], rtol=1e-5)
