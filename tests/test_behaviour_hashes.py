"""Behaviour kept: every shipped config and the rank-invariance run reach the final model and epsilon
recorded in tests/data/behaviour_hashes.json, bit for bit in the environment it was recorded in and
within float-rounding tolerance in any other (tests/behaviour.py says why and how to re-record); and,
with no table, the same run twice gives the same bits."""

import copy

import pytest

import behaviour

TABLE = behaviour.load_table()
EXACT = TABLE["environment"] == behaviour.environment()
PLANTED = "configs/sweeps/paper000_base.yaml"  # DP-FedAvg, model lr 0.5; one of the cheapest runs
QUANTIZED = "configs/ddp_skellam_quickstart.yaml"  # Skellam shares on a 16-bit grid, model lr 0.5


def _mode() -> str:
    if EXACT:
        return "the recorded environment: compared bit for bit"
    drift = "\n  ".join(behaviour.fingerprint_differences(TABLE["environment"], behaviour.environment()))
    return f"another environment than the recorded one, compared within tolerance; it differs in\n  {drift}"


def test_the_table_covers_every_shipped_config_and_placement():
    assert sorted(TABLE["runs"]) == sorted(behaviour.run_keys())


@pytest.mark.parametrize("key", behaviour.run_keys())
def test_a_run_reaches_the_recorded_model_and_epsilon(key):
    found = behaviour.check(key, behaviour.run(key), TABLE)
    assert not found, (f"{key} ({_mode()}):\n  " + "\n  ".join(found)
                       + "\nIf the change is meant to change behaviour: python tests/behaviour.py --record")


@pytest.mark.parametrize("key", ["configs/quickstart.yaml", "configs/pfl_digits.yaml", "configs/clip_quadratic.yaml",
                                 "rank_invariance/distributed"])
def test_the_same_run_twice_gives_the_same_bits(key):
    again = (behaviour.fresh_run_rank_invariance(key.split("/")[1]) if key.startswith("rank_invariance/")
             else behaviour.fresh_run_config(key))
    assert again == behaviour.run(key)


@pytest.mark.parametrize("config", [PLANTED, QUANTIZED])
def test_a_one_percent_learning_rate_change_fails_the_tolerance_check(config):
    # What another environment compares: the summary within the recorded tolerances. This run, as the
    # reference, with the tolerances recorded for it: a real change must not pass them -- also where the
    # mechanism rounds to integers, whose tolerances take an integer flipped and skip the coordinates.
    reference = {**behaviour.run(config), "tolerance": TABLE["runs"][config]["tolerance"]}
    planted = behaviour.fresh_run_config(config, ("--model.init_args.lr", repr(0.5 * 1.01)))
    found = behaviour.differences(reference, planted, exact=False)
    assert found and all(not f.startswith(("epsilon", "coordinate")) or config == PLANTED
                                   for f in found), found


def test_a_quantizing_run_is_compared_without_its_coordinates():
    assert TABLE["runs"][QUANTIZED]["quantized"] and not TABLE["runs"][PLANTED]["quantized"]
    recorded = {**_record(), "quantized": True}
    moved = copy.deepcopy(recorded)
    moved["model"]["coordinates"]["1"] += 1e-3  # a flipped integer in one coordinate's path
    assert behaviour.differences(recorded, moved, exact=False) == []
    assert behaviour.differences({**recorded, "quantized": False}, moved, exact=False)
    assert behaviour.differences(recorded, _record(1 + 1e-4), exact=False)  # the norms still compare


def test_the_calibration_covers_the_kernel_paths_below_this_cpu_and_a_perturbed_start():
    import torch

    names = [name for name, _, _ in behaviour.calibrations()]
    assert names[-1].startswith("initial model") and behaviour.PERTURBATION >= 1e-6
    if torch.backends.cpu.get_cpu_capability() != "DEFAULT":
        assert "ATEN_CPU_CAPABILITY=default" in names
    if torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        assert "ATEN_CPU_CAPABILITY=avx2" in names
    moved = behaviour.fresh_run_config(PLANTED, perturb=behaviour.PERTURBATION)
    assert moved["sha256"] != behaviour.run(PLANTED)["sha256"]  # the perturbation reaches the model


def _record(scale=1.0, epsilon=0.6474445662179724, moved=1.0):
    x = [0.5 * scale, -1.25 * scale, 2.0 * scale, 0.0]
    return {"sha256": "ab" * 32, "epsilon": epsilon,
            "model": {"size": 4, "norm2": sum(v * v for v in x) ** 0.5, "norm1": sum(abs(v) for v in x),
                      "sum": sum(x), "coordinates": {str(i): v for i, v in enumerate(x)},
                      "projections": [0.1 * scale, -0.3 * scale],
                      "moved": {"norm2": 1e-4 * moved, "norm1": 2e-4 * moved}}}


def test_the_tolerance_takes_rounding_drift_and_refuses_a_change():
    recorded = _record()
    assert behaviour.differences(recorded, _record(1 + 1e-9, epsilon=0.6474445662143198), exact=False) == []
    assert behaviour.differences(recorded, _record(1 + 1e-4), exact=False)
    assert behaviour.differences(recorded, _record(epsilon=0.6474445662179724 * (1 + 1e-5)), exact=False)
    # dp_scaffold_synthetic's epsilon, the same code on two machines (the accountant's drift, 1.4e-8)
    assert behaviour.differences(_record(epsilon=0.15591411843939576), _record(epsilon=0.15591411633093138),
                                 exact=False) == []
    assert behaviour.differences(recorded, _record(epsilon=None), exact=False)
    moved = copy.deepcopy(recorded)
    moved["model"]["coordinates"]["3"] = 1e-4  # a coordinate at zero moves: measured against the RMS
    assert [f.split(":")[0] for f in behaviour.differences(recorded, moved, exact=False)] == ["coordinate 3"]
    # a model that moved little from its start: its move's norms, each within its own tolerance
    assert behaviour.differences(recorded, _record(moved=1 + 1e-7), exact=False) == []
    assert ([f.split(":")[0] for f in behaviour.differences(recorded, _record(moved=1.01), exact=False)]
            == ["moved norm2", "moved norm1"])
    loose = {**recorded, "tolerance": {"moved norm2": 0.1, "moved norm1": 0.1}}
    assert behaviour.differences(loose, _record(moved=1.01), exact=False) == []


def test_a_recorded_tolerance_is_ten_times_the_drift_of_another_kernel_path():
    recorded = _record()
    tolerance = behaviour.tolerances(recorded, _record(1 + 1e-5))
    assert tolerance["norm2"] == pytest.approx(1e-4) and tolerance["moved norm1"] == behaviour.FLOOR
    assert behaviour.differences({**recorded, "tolerance": tolerance}, _record(1 + 5e-5), exact=False) == []
    assert behaviour.differences({**recorded, "tolerance": tolerance}, _record(1 + 5e-4), exact=False)


def test_the_recorded_environment_compares_bits():
    recorded = _record()
    rounded = _record(1 + 1e-12)
    rounded["sha256"] = "cd" * 32
    assert behaviour.differences(recorded, rounded, exact=False) == []
    assert [f.split(":")[0] for f in behaviour.differences(recorded, rounded, exact=True)] == ["sha256"]
    assert behaviour.differences(recorded, _record(epsilon=0.6474445662143198), exact=True)


def test_the_fingerprint_names_what_changes_bits():
    here = behaviour.environment()
    for name in ("python", "cpu", "torch_cpu_capability", "numpy_cpu_features", "torch", "numpy", "scipy",
                 "dp-accounting", "opacus"):
        assert here[name], name
    other = {**here, "numpy": "0.0"}
    assert behaviour.fingerprint_differences(other, here) == [f"numpy: {here['numpy']!r} here, '0.0' recorded"]
