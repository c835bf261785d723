"""Modules that moved into packages keep their old import paths, with a deprecation: the old path
gives the very module at the new path, the warning names the new path, and the `dpfl` entry point,
a config's old `class_path` and an object pickled under an old path still work."""

import json
import pickle
import subprocess
import sys

import pytest

from dpfl_lightning.moved import MOVED

PROBE = r"""
import importlib, json, sys, warnings
from dpfl_lightning.moved import MOVED
out = {}
for old, new in MOVED.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m_old = importlib.import_module("dpfl_lightning." + old)
    m_new = importlib.import_module("dpfl_lightning." + new)
    out[old] = [m_old is m_new, [str(w.message) for w in caught if w.category is DeprecationWarning]]
print(json.dumps(out))
"""


def test_every_old_path_gives_the_new_module_and_names_it_in_a_deprecation():
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(found) == set(MOVED)
    for old, (same, messages) in found.items():
        assert same, old
        assert len(messages) == 1 and f"dpfl_lightning.{MOVED[old]}" in messages[0], (old, messages)


def test_the_new_paths_exist_and_the_old_files_are_gone():
    import importlib.util
    import os

    import dpfl_lightning

    root = os.path.dirname(dpfl_lightning.__file__)
    for old, new in MOVED.items():
        assert importlib.util.find_spec("dpfl_lightning." + new) is not None, new
        assert not os.path.exists(os.path.join(root, *old.split(".")) + ".py"), old


def test_unknown_names_are_not_invented():
    with pytest.raises(ModuleNotFoundError):
        __import__("dpfl_lightning.no_such_module")
    import dpfl_lightning.cli as cli

    with pytest.raises(AttributeError):
        cli.no_such_name  # noqa: B018


def test_the_old_entry_point_and_the_new_one_name_the_same_function():
    import dpfl_lightning.cli as cli
    from dpfl_lightning.cli.command import main

    assert cli.main is main  # `dpfl = "dpfl_lightning.cli:main"` of an older install


def test_an_object_pickled_under_an_old_path_loads():
    from dpfl_lightning.federated.plan import RoundPlan

    data = pickle.dumps(RoundPlan, protocol=0)  # (text protocol: no length prefixes) a reference by module path, as a pickled checkpoint holds it
    old = data.replace(b"dpfl_lightning.federated.plan", b"dpfl_lightning.plan")
    assert old != data
    assert pickle.loads(old) is RoundPlan


def test_a_config_with_an_old_class_path_still_parses(tmp_path):
    from dpfl_lightning.cli.command import build_parser, parse

    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  rounds: 1\n  loggers:\n    - class_path: dpfl_lightning.loggers.WandbLogger\n"
                    "      init_args: {mode: disabled}\n"
                    "model:\n  class_path: dpfl_lightning.models.MLPClassifier\n  init_args: {in_features: 64}\n"
                    "data:\n  class_path: dpfl_lightning.data.Digits\n")
    cfg = parse(build_parser(), ["fit", "--config", str(path)])
    assert "dpfl_lightning.loggers.WandbLogger" in json.dumps(cfg, default=str)  # parsed, not refused
