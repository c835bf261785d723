"""``dpfl`` start-up: ``--version``, every subcommand's ``--help`` and ``dpfl privacy calibrate | plan |
theory`` load neither torch nor Lightning (read from ``sys.modules`` of a fresh interpreter, not from
a clock), and the help printed without them is the full parsers' help."""

import json
import os
import subprocess
import sys
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAVY = ("torch", "lightning", "pytorch_lightning", "opacus", "wandb")
# Only an end to a hung probe: what is checked is which modules load, never how long it takes.
TIMEOUT_S = 900
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "COLUMNS": "100"}

PROBE = """
import json, sys
sys.argv = ["dpfl", *json.loads(sys.argv[1])]
from dpfl_lightning.cli.command import main
code = 0
try:
    main()
except SystemExit as e:
    code = e.code or 0
sys.stdout.flush()
print("\\nPROBE " + json.dumps({"code": code, "modules": sorted({m.split(".")[0] for m in sys.modules})}))
"""


def _dpfl(*args: str) -> tuple[str, int, list[str]]:
    """``dpfl ARGS`` in a fresh interpreter: its output, exit status and the heavy modules it loaded."""
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(list(args))], capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=ENV, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out, _, last = proc.stdout.rpartition("\nPROBE ")
    report = json.loads(last)
    return out + proc.stderr, report["code"], [m for m in HEAVY if m in report["modules"]]


HELP = [["--help"], ["fit", "--help"], ["validate", "-h"], ["test", "--help"], ["predict", "--help"],
        ["audit", "--help"], ["sweep", "--help"], ["report", "--help"], ["privacy", "--help"],
        ["privacy", "epsilon", "--help"], ["privacy", "calibrate", "--help"], ["privacy", "plan", "--help"],
        ["privacy", "theory", "--help"]]


@pytest.mark.parametrize("args", HELP, ids=" ".join)
def test_help_of_every_subcommand_loads_neither_torch_nor_lightning(args):
    out, code, heavy = _dpfl(*args)
    assert code == 0 and heavy == [], out[-2000:]
    words = [a for a in args if not a.startswith("-")]
    assert f"usage: dpfl {'[options] ' if words else ''}{' [options] '.join(words)}" in out, out[:500]


def test_version_prints_the_package_version_without_torch():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        expected = tomllib.load(f)["project"]["version"]
    out, code, heavy = _dpfl("--version")
    assert (code, heavy) == (0, [])
    assert out.strip() == f"dpfl_lightning {expected}"


@pytest.mark.parametrize("args,code,needle", [
    (["privacy", "calibrate", "--epsilon", "2", "--delta", "1e-6", "--rounds", "50", "--clients", "1000",
      "--sampling_rate", "0.05"], 0, "noise_multiplier = "),
    (["privacy", "plan", "--epsilon", "3", "--delta", "1e-5", "--noise", "[2, 5]", "--local_steps", "[1, 10]"], 0,
     "largest number of rounds"),
    (["privacy", "theory", "--mu", "0.1", "--L", "10", "--epsilon", "10", "--delta", "1e-5", "--C", "0.1", "--N", "10",
      "--d", "10", "--psi0", "1e4"], 0, "T*"),
    (["privacy", "calibrate", "--epsilon", "2", "--delta", "0.5", "--rounds", "50", "--clients", "1000",
      "--sampling_rate", "0.05"], 2, "dpfl: error: --delta=0.5"),  # a bad setting is reported without torch too
    (["fitt"], 2, "dpfl: error: fitt: no such command. Fix: did you mean fit?"),
], ids=["calibrate", "plan", "theory", "calibrate-error", "misspelled"])
def test_the_privacy_planner_runs_without_torch_or_lightning(args, code, needle):
    out, status, heavy = _dpfl(*args)
    assert (status, heavy) == (code, []), out[-2000:]
    assert needle in out, out[-2000:]


COMPARE = """
import contextlib, io, json, os
from dpfl_lightning.cli import command as cli, help as cli_help
from dpfl_lightning.cli.parsers import SIGNATURE_PARSERS, build_parser

# what `dpfl fit --help` printed when it built the full parser, against what it prints now
os.environ["COLUMNS"] = "100"
parser = build_parser()
full_out = io.StringIO()
with contextlib.redirect_stdout(full_out):
    try:
        cli.parse(parser, ["fit", "--help"])
    except SystemExit:
        pass
light_out = io.StringIO()
with contextlib.redirect_stdout(light_out):
    cli.main(["fit", "--help"])
import re

def ours(text):
    # what our own signatures and docstrings say: a dotted name of another package (a subclass of
    # LightningModule that this environment happens to have imported) and the line breaks it moves
    # are the environment's, not the stored data's
    text = re.sub(r"\b(?!dpfl_lightning\.)[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+\b", "", text)
    return " ".join(text.split())

differ = [] if ours(full_out.getvalue()) == ours(light_out.getvalue()) else ["dpfl fit --help"]
commands = parser.dpfl_subcommands
for columns in ("72", "100", "180"):
    os.environ["COLUMNS"] = columns
    for name in SIGNATURE_PARSERS:
        full, light = commands[name], cli_help.light_parser(cli_help.stored_spec(name))
        if [a.option_strings for a in full._actions] != [a.option_strings for a in light._actions]:
            differ.append(f"{name}: the options")
        elif ours(full.format_help()) != ours(light.format_help()):
            differ.append(f"{name} at {columns} columns")
print("COMPARE " + json.dumps(differ))
"""


def test_the_stored_help_is_the_full_parsers_help():
    """The help printed without torch is the text of the parsers built from the signatures (at
    several terminal widths); when a signature or docstring changes, this fails until
    ``python -m dpfl_lightning.cli.help`` regenerates dpfl_lightning/cli/help_data.py. Compared as
    words, without the dotted names of other packages: which of their LightningModule subclasses a
    parser lists depends on what the environment imported, not on our signatures."""
    proc = subprocess.run([sys.executable, "-c", COMPARE], capture_output=True, text=True, timeout=TIMEOUT_S,
                          env=ENV, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    differ = json.loads(proc.stdout.rpartition("COMPARE ")[2])
    assert differ == [], f"stale help data for {differ}: run python -m dpfl_lightning.cli.help"


def test_the_light_help_lists_the_signature_options():
    """The stored help has what the signatures give (not a stub): the trainer's settings, the split
    options and the model/data choices, with their types and defaults."""
    out, code, _ = _dpfl("fit", "--help")
    for needle in ("--trainer.rounds ROUNDS", "(type: int, default: 10)", "--trainer.plugins PLUGINS",
                   "--split.partition PARTITION", "--model.help CLASS_PATH_OR_NAME", "dpfl_lightning.data.Digits",
                   "--resume RESUME", "--print_config"):
        assert needle in out, needle
    eps, _, _ = _dpfl("privacy", "epsilon", "--help")
    assert "--accountant ACCOUNTANT" in eps and "--trainer.rounds ROUNDS" in eps and "without training" in eps
