"""The two commands a user runs, ``wide-moe`` and ``wide-moe-tune``: their help names
the command as invoked, is plain text, and gives every option a help line with its
default."""

import argparse
import subprocess
import sys

import pytest

from wide_moe_triton import __main__ as layer_cli
from wide_moe_triton import tune

PARSERS = {"wide-moe": (layer_cli.parser, "wide_moe_triton", "__main__.py"),
           "wide-moe-tune": (tune.parser, "wide_moe_triton.tune", "tune.py")}


def test_pyproject_scripts_are_these_commands():
    import pathlib
    import tomllib

    project = tomllib.loads((pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert project["project"]["scripts"] == {
        "wide-moe": "wide_moe_triton.__main__:main", "wide-moe-tune": "wide_moe_triton.tune:main"}


@pytest.mark.parametrize("script", PARSERS)
def test_help_names_the_command_as_invoked(script, monkeypatch):
    make, module, file = PARSERS[script]
    monkeypatch.setattr(sys, "argv", [f"/venv/bin/{script}"])
    assert make().prog == script
    monkeypatch.setattr(sys, "argv", [f"/src/wide_moe_triton/{file}"])
    assert make().prog == f"python -m {module}"


@pytest.mark.parametrize("script", PARSERS)
def test_every_option_has_help_with_its_default_and_no_markup(script):
    p = PARSERS[script][0]()
    options = [a for a in p._actions if not isinstance(a, argparse._HelpAction)]
    assert options
    for action in options:
        assert action.help and "default" in action.help, action.option_strings
    text = p.format_help()
    assert "``" not in text and ":func:" not in text
    for action in options:  # each option's line shows in the help
        assert action.option_strings[0] in text


@pytest.mark.parametrize("module, words", [
    ("wide_moe_triton", ["stock", "interpreter", "rel err", "bitwise"]),
    ("wide_moe_triton.tune", ["autotune_configs/", ".md", "--quick", "s on an H200"])])
def test_help_runs_from_the_command_line(module, words):
    done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: python -m {module} ")
    for word in words:
        assert word in done.stdout, word


def test_tune_refuses_an_unknown_kernel(capsys):
    with pytest.raises(SystemExit):
        tune.parser().parse_args(["--kernels", "experts"])
    assert "invalid choice: 'experts'" in capsys.readouterr().err
