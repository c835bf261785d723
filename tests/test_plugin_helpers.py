"""What plugins share: the noise a client adds under each placement and the value bound after it
(GaussianNoise and AdaptiveClip's count)."""

import pytest

from dpfl_lightning.plan import RoundPlan
from dpfl_lightning.plugins import AdaptiveClip, GaussianNoise


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
