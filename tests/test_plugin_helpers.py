"""What plugins share: the noise a client adds under each placement and the value bound after it
(GaussianNoise and AdaptiveClip's count); the calibrated multiplier in checkpoints (GaussianNoise and
DPSGD)."""

import pytest

from dpfl_lightning.federated.plan import RoundPlan
from dpfl_lightning.plugins import DPSGD, AdaptiveClip, GaussianNoise


def _value_bound(plugin, segment, bound, cohort=4):
    plugin.before_round(plan=RoundPlan(0, tuple(range(cohort))), server=None)
    return plugin.value_bound(segment=segment, bound=bound)


@pytest.mark.parametrize("placement, expected", [("local", 1.0 + 50 * 2.0), ("distributed", 1.0 + 50 * 1.0),
                                                 ("central", 1.0)])
def test_gaussian_noise_value_bound_covers_the_noise_a_client_adds(placement, expected):
    # std 2 over 4 clients: each adds all of it (local), 2 / sqrt(4) = 1 (distributed) or none (central)
    noise = GaussianNoise(std=2.0, placement=placement)
    assert _value_bound(noise, "update", 1.0) == expected
    assert _value_bound(noise, "other", 1.0) == 1.0 and _value_bound(noise, "update", None) is None


@pytest.mark.parametrize("placement, expected", [("distributed", 0.5 + 50 * 1.5), ("central", 0.5)])
def test_adaptive_clip_count_bound_covers_its_noise_share(placement, expected):
    # the centred bit is at most 1/2; a distributed count adds sigma_b / sqrt(n) = 3 / sqrt(4) per client
    clip = AdaptiveClip(count_noise=3.0, placement=placement)
    assert _value_bound(clip, "clip_bit", None) == expected
    assert _value_bound(clip, "update", None) == clip.max_norm  # the update's own bound is the clip norm


@pytest.mark.parametrize("make", [lambda **kw: GaussianNoise(delta=1e-5, **kw), lambda **kw: DPSGD(delta=1e-5, **kw)])
def test_a_calibrated_multiplier_is_the_whole_checkpoint_of_a_noise_plugin(make):
    # a run calibrated for a target epsilon resumes with the multiplier it ran with, not a recalibrated one
    calibrated = make(target_epsilon=3.0)
    calibrated.noise_multiplier = 1.7
    assert calibrated.state_dict() == {"noise_multiplier": 1.7}
    resumed = make(target_epsilon=3.0)
    resumed.load_state_dict({"noise_multiplier": 1.7})
    assert resumed.noise_multiplier == 1.7
    fixed = make(noise_multiplier=1.1)  # a multiplier given by the user is not checkpointed
    assert fixed.state_dict() == {}
    fixed.load_state_dict({})
    assert fixed.noise_multiplier == 1.1
