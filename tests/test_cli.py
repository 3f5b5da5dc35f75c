"""The two commands a user runs, ``wide-moe`` and ``wide-moe-tune``: their help names
the command as invoked, is plain text in a user's words, and gives every option a help
line with its default; a bad invocation is one line on stderr naming the argument or the
file, exit status 2 for a bad argument and 1 for bad data, never a traceback (unless
--debug), and nothing written."""

import argparse
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from test_config import kimi_k3_text_config
from wide_moe_triton import __main__ as layer_cli
from wide_moe_triton import cli, kernels, ops, tune  # noqa: F401  (ops: see bad_invocation)
from wide_moe_triton.checkpoint import CheckpointError

PARSERS = {"wide-moe": (layer_cli.parser, "wide_moe_triton", "__main__.py"),
           "wide-moe-tune": (tune.parser, "wide_moe_triton.tune", "tune/__main__.py")}


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
    ("wide_moe_triton.tune", ["WIDE_MOE_CONFIG_DIR", "~/.cache/wide_moe_triton", ".md",
                              "--quick", "s on an H200", "--dry-run"])])
def test_help_runs_from_the_command_line(module, words):
    done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: python -m {module} ")
    for word in words:
        assert word in done.stdout, word


# What the tune command's help must not say outside parentheses: the package's internal
# names (kernels, weight layouts, formats) and its jargon.
INTERNAL = (*tune.KERNELS, "wgmma", "MXFP", "GEMM", "poison", "bucket", "reduction",
            "median wins", "folded", "config")


def test_tune_help_speaks_a_users_words():
    text = tune.parser().format_help()
    while re.search(r"\([^()]*\)", text):  # innermost parentheses first
        text = re.sub(r"\([^()]*\)", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)  # the usage line's option list
    prog = tune.parser().prog
    text = "\n".join(line for line in text.splitlines()  # examples: what a user types
                      if not line.strip().startswith(prog))
    found = [w for w in INTERNAL if re.search(rf"(?<![\w-]){re.escape(w)}", text, re.I)]
    assert found == [], found
    # The names a user passes are there, in parentheses.
    full = tune.parser().format_help()
    assert all(k in full for k in tune.KERNELS) and "wgmma_decode" in full


# -- bad invocations ------------------------------------------------------------------

CUDA = torch.cuda.is_available()
# (command, argv, exit status, what the line must name). Placeholders in braces are
# paths the test makes: {missing} (nothing there), {empty} (an empty directory), {file}
# (a file), {notjson} and {softmax} (a directory whose config.json is not JSON, or
# describes a softmax router), {tables} (the user's tables' directory).
BAD = [
    ("wide-moe", ["--checkpoint", "{missing}", "--layer", "3"], 2, ["--checkpoint", "{missing}"]),
    ("wide-moe", ["--checkpoint", "{empty}", "--layer", "3"], 1, ["{empty}/config.json"]),
    ("wide-moe", ["--checkpoint", "{file}", "--layer", "3"], 2, ["--checkpoint", "{file}"]),
    ("wide-moe", ["--checkpoint", "{notjson}", "--layer", "3"], 1,
     ["{notjson}/config.json", "not JSON"]),
    ("wide-moe", ["--checkpoint", "{softmax}", "--layer", "3"], 1,
     ["{softmax}/config.json", "moe_router_activation_func"]),
    ("wide-moe", ["--batches", "0"], 2, ["--batches", "0"]),
    ("wide-moe", ["--batches", "-1"], 2, ["--batches", "-1"]),
    ("wide-moe", ["--batches", "4", "two"], 2, ["--batches", "two"]),
    ("wide-moe", ["--layer", "3"], 2, ["--checkpoint", "--layer"]),
    ("wide-moe", ["--tp", "2"], 2, ["--tp"]),
    ("wide-moe", ["--checkpoint", "{empty}", "--layer", "-1"], 2, ["--layer", "-1"]),
    ("wide-moe", ["--checkpoint", "{empty}", "--layer", "3", "--tp", "0"], 2, ["--tp"]),
    ("wide-moe", ["--checkpoint", "{empty}", "--layer", "3", "--tp", "2", "--rank", "2"], 2,
     ["--rank"]),
    ("wide-moe", ["--device", "tpu"], 2, ["--device", "tpu"]),
    ("wide-moe", ["--frobnicate"], 2, ["--frobnicate"]),
    ("wide-moe-tune", ["--dry-run", "--batches", "0"], 2, ["--batches"]),
    ("wide-moe-tune", ["--tp", "0"], 2, ["--tp"]),
    ("wide-moe-tune", ["--dry-run", "--tp", "3"], 2, ["--tp", "3"]),
    ("wide-moe-tune", ["--dry-run", "--out", "{empty}"], 2, ["--out", "{empty}"]),
    ("wide-moe-tune", ["--dry-run", "--kernels", "experts"], 2, ["--kernels", "experts"]),
    ("wide-moe-tune", ["--dry-run", "--experts-layout", "tiles"], 2,
     ["--experts-layout", "tiles"]),
    ("wide-moe-tune", ["--dry-run", "--time-limit", "0"], 2, ["--time-limit"]),
    ("wide-moe-tune", ["--dry-run", "--workers", "0"], 2, ["--workers"]),
    ("wide-moe-tune", ["--dry-run", "--finalists", "0"], 2, ["--finalists"]),
    ("wide-moe-tune", ["--dry-run", "--kernels", "finalize", "--out", "{notjson}/config.json"],
     1, ["{notjson}/config.json", "not valid JSON"]),
]
if not CUDA:
    BAD += [("wide-moe", ["--checkpoint", "{empty}", "--layer", "3", "--device", "cuda"], 2,
             ["--device", "cuda"]),
            ("wide-moe-tune", [], 2, ["--dry-run"])]
MAINS = {"wide-moe": layer_cli.main, "wide-moe-tune": tune.main}


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    root = tmp_path_factory.mktemp("places")
    (root / "empty").mkdir()
    (root / "file").write_text("not a checkpoint\n")
    (root / "notjson").mkdir()
    (root / "notjson" / "config.json").write_text("{'hidden_size': 7168,")
    (root / "softmax").mkdir()
    fields = dict(kimi_k3_text_config(), moe_router_activation_func="softmax")
    (root / "softmax" / "config.json").write_text(json.dumps({"text_config": fields}))
    return {name: str(root / name) for name in ("missing", "empty", "file", "notjson",
                                                "softmax", "tables")}


def fill(texts, places):
    return [t.format(**places) for t in texts]


def assert_one_line(err: str, command: str, named) -> None:
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith(f"{command}: error: "), err
    for word in named:
        assert word in err, (word, err)


@pytest.mark.parametrize("command, argv, status, named", BAD,
                         ids=[f"{c} {' '.join(a)}" for c, a, _, _ in BAD])
def test_bad_invocation(command, argv, status, named, places, capsys, monkeypatch):
    """In-process (``main(argv)``): the status, one line naming the argument or file,
    nothing on stdout, and nothing in the user's tables' directory."""
    # --dry-run sets TRITON_INTERPRET: restored after the test (``ops``, imported above,
    # has defined every kernel before it).
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "0"))
    monkeypatch.setenv("WIDE_MOE_CONFIG_DIR", places["tables"])

    def no_sweep(args):
        raise AssertionError("a sweep started")
    monkeypatch.setattr(tune.engine, "sweep", no_sweep)
    assert MAINS[command](fill(argv, places)) == status
    out, err = capsys.readouterr()
    assert_one_line(err, command, fill(named, places))
    assert out == ""
    assert not os.path.exists(places["tables"])


def test_debug_shows_the_exception(places):
    with pytest.raises(CheckpointError, match="config.json"):
        layer_cli.main(["--debug", "--checkpoint", places["empty"], "--layer", "3"])


@pytest.mark.parametrize("text, status", [("7", 7), ("0", 0), ("-2", None), ("x", None)])
def test_natural_int(text, status):
    if status is None:
        with pytest.raises(argparse.ArgumentTypeError, match=repr(text) if text == "x" else text):
            cli.natural_int(text)
    else:
        assert cli.natural_int(text) == status


def test_one_line_of_a_long_error():
    err = RuntimeError("first line\n  second line\n")
    assert cli._one_line(err) == "RuntimeError: first line (--debug shows the rest)"
    assert cli._one_line(ValueError("x is bad")) == "x is bad"
    assert cli._one_line(MemoryError()) == "MemoryError"


# As a user runs them: a process of its own, its exit status and the one line on stderr,
# no traceback. Without a GPU (CUDA_VISIBLE_DEVICES="") on any machine; the last runs the
# layer with TRITON_INTERPRET=0, so its kernels are defined for a GPU: WideMoE on the CPU
# refuses to be built, naming what to set.
PROCESSES = [
    ("wide_moe_triton", ["--checkpoint", "{empty}", "--layer", "3"], {}, 1,
     ["{empty}/config.json"]),
    ("wide_moe_triton.tune", [], {}, 2, ["--dry-run"]),
    ("wide_moe_triton", ["--batches", "1"], {"TRITON_INTERPRET": "0"}, 1,
     ["TRITON_INTERPRET=1"]),
]


@pytest.mark.parametrize("module, argv, env, status, named", PROCESSES,
                         ids=[f"{m} {' '.join(a)} {e}" for m, a, e, _, _ in PROCESSES])
def test_bad_invocation_as_a_process(module, argv, env, status, named, places):
    command = "wide-moe-tune" if module.endswith("tune") else "wide-moe"
    run = subprocess.run([sys.executable, "-m", module, *fill(argv, places)],
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": "", **env},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == status, run.stderr
    assert "Traceback" not in run.stderr
    assert_one_line(run.stderr, command, fill(named, places))


def test_cpu_device_needs_the_interpreter(monkeypatch):
    """In-process, the check the last process above meets: a CPU device with kernels
    defined for a GPU is refused naming TRITON_INTERPRET=1; a CUDA device never is (no
    GPU needed to ask)."""
    monkeypatch.setattr(kernels, "_INTERPRETED", False)
    with pytest.raises(RuntimeError, match="^device cpu: .*set TRITON_INTERPRET=1"):
        kernels.check_device("cpu")
    with pytest.raises(RuntimeError, match="^device cpu: .*set TRITON_INTERPRET=1"):
        kernels.check_device(torch.device("cpu"))
    kernels.check_device("cuda:0")
    monkeypatch.setattr(kernels, "_INTERPRETED", True)
    kernels.check_device("cpu")
