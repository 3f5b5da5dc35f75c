"""The package as a user installs it: a wheel carries the shipped tuning tables and its
commands; an installed copy finds the H200's table by GPU name; a table of the user's
own, in the writable tables' directory, wins over the shipped one."""

import importlib.metadata
import json
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

from wide_moe_triton import tuning

ROOT = pathlib.Path(__file__).resolve().parents[1]
H200 = "NVIDIA H200"


def shipped_source(name: str) -> dict:
    """The table as the repository holds it (what the wheel must carry)."""
    return json.loads((ROOT / "autotune_configs" / (name.replace(" ", "_") + ".json"))
                      .read_text())


def pyproject_version() -> str:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_the_version_is_pyprojects():
    import wide_moe_triton

    assert wide_moe_triton.__version__ == pyproject_version()


def test_the_checkout_holds_the_tables_at_the_top_level():
    """The design card's layout: the tables' source is autotune_configs/ at the top, and
    a checkout on the path reads them there."""
    assert not (ROOT / "wide_moe_triton" / "autotune_configs").exists()
    assert pathlib.Path(str(tuning.SHIPPED)) == ROOT / "autotune_configs"
    assert tuning.find_table(H200) == ROOT / "autotune_configs" / "NVIDIA_H200.json"


def user_table(date: str) -> dict:
    """A valid table of the user's own, told apart by its date and its one entry."""
    return {"gpu": H200, "triton": "3.9.0", "date": date,
            "kernels": {"finalize": {"L3584_K16": {"64": {"BLOCK_T": 3}}}}}


@pytest.fixture
def tables(monkeypatch, tmp_path):
    """A fresh user tables' directory, and the table cache emptied before and after."""
    monkeypatch.setenv("WIDE_MOE_CONFIG_DIR", str(tmp_path / "tables"))
    tuning.clear_caches()
    yield tmp_path / "tables"
    tuning.clear_caches()


def test_user_dir_is_the_variable_else_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("WIDE_MOE_CONFIG_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tuning.user_dir() == tmp_path / "mine"
    monkeypatch.delenv("WIDE_MOE_CONFIG_DIR")
    assert tuning.user_dir() == tmp_path / "xdg" / "wide_moe_triton"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert tuning.user_dir() == tmp_path / "home" / ".cache" / "wide_moe_triton"
    assert tuning.table_path(H200) == tuning.user_dir() / "NVIDIA_H200.json"


def test_a_users_table_wins_over_the_shipped_one(tables, monkeypatch):
    """By GPU name, no GPU needed: the shipped table, until the user writes one; a GPU
    without either has none. ``config_for`` on that GPU then takes the user's entry."""
    assert tuning.find_table(H200) == tuning.SHIPPED / "NVIDIA_H200.json"
    assert tuning.load_table(H200) == shipped_source(H200)
    assert tuning.find_table("NVIDIA B200") is None and tuning.load_table("NVIDIA B200") is None
    tables.mkdir()
    (tables / "NVIDIA_H200.json").write_text(json.dumps(user_table("2026-12-06")))
    tuning.clear_caches()
    assert tuning.find_table(H200) == tables / "NVIDIA_H200.json"
    assert tuning.load_table(H200) == user_table("2026-12-06")
    monkeypatch.setattr(tuning, "gpu_info", lambda device=None: tuning.GpuInfo(H200))
    assert tuning.config_for("finalize", "L3584_K16", 40, {"BLOCK_T": 1, "num_warps": 4}) == \
        {"BLOCK_T": 3, "num_warps": 4}


def _wheel_builder() -> list[str]:
    """pip's wheel command: without build isolation (offline, about a second) where this
    environment's setuptools builds wheels by itself (70.1 on, or with the wheel
    package), else in pip's isolated build environment (setuptools from the index, as a
    user's ``pip install .`` gets it)."""
    def version(name):
        try:
            return tuple(int(p) for p in importlib.metadata.version(name).split(".")[:2])
        except (importlib.metadata.PackageNotFoundError, ValueError):
            return None
    offline = (version("setuptools") or (0,)) >= (70, 1) or (
        version("setuptools") and version("wheel"))
    return [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
            *(["--no-build-isolation"] if offline else [])]


def test_an_installed_wheel_finds_the_shipped_tables(tmp_path):
    """Build the wheel from a copy of the sources (the build writes beside them; the
    tables' source is the top-level autotune_configs/, which the wheel carries inside the
    package), install
    it into a fresh directory outside the checkout, and from there: the H200's table is
    found by GPU name among the package's own files and holds what the repository ships;
    a table in the user's directory wins; the installed command runs under its name."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in ("wide_moe_triton", "autotune_configs"):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([*_wheel_builder(), "-w", str(tmp_path / "dist"), str(src)], check=True,
                   cwd=tmp_path, capture_output=True, timeout=300)
    wheel, = (tmp_path / "dist").glob("wide_moe_triton-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "wide_moe_triton/autotune_configs/NVIDIA_H200.json" in names, names
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--target", str(site), str(wheel)], check=True, capture_output=True,
                   timeout=300)

    empty, mine = tmp_path / "empty", tmp_path / "mine"
    mine.mkdir()
    (mine / "NVIDIA_H200.json").write_text(json.dumps(user_table("2026-12-07")))
    probe = """if True:
        import json, os, sys
        import wide_moe_triton
        from wide_moe_triton import tuning
        found = {}
        for where in sys.argv[1:]:
            os.environ["WIDE_MOE_CONFIG_DIR"] = where
            tuning.clear_caches()
            found[where] = [str(tuning.find_table("NVIDIA H200")),
                            tuning.load_table("NVIDIA H200")]
        print(json.dumps({"package": tuning.__file__, "found": found,
                          "version": wide_moe_triton.__version__}))
    """
    env = {**os.environ, "PYTHONPATH": str(site)}
    run = subprocess.run([sys.executable, "-c", probe, str(empty), str(mine)], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    assert pathlib.Path(got["package"]).is_relative_to(site), got["package"]
    assert got["version"] == pyproject_version()
    path, table = got["found"][str(empty)]
    assert pathlib.Path(path) == site / "wide_moe_triton" / "autotune_configs" / \
        "NVIDIA_H200.json"
    assert table == shipped_source(H200)
    path, table = got["found"][str(mine)]
    assert pathlib.Path(path) == mine / "NVIDIA_H200.json"
    assert table == user_table("2026-12-07")

    # The console script pip wrote, run as a user would: its name on its one error line.
    run = subprocess.run([str(site / "bin" / "wide-moe"), "--batches", "0"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stderr == ("wide-moe: error: argument --batches: "
                                                  "must be a positive integer, got 0\n"), run


# A file a concern: a module past this has grown a second one to split out.
MAX_LINES = 700


def test_no_package_file_is_over_the_line_limit():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
             for p in (ROOT / "wide_moe_triton").rglob("*.py")}
    assert sizes, "no package source found"
    over = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not over, f"package files over {MAX_LINES} lines: {over}"
