"""wide_moe_triton: a latent-MoE layer for wide decode steps, as Triton kernels.

    from wide_moe_triton import WideMoEConfig, LatentMoE, WideMoE
    stock = LatentMoE(WideMoEConfig.tiny(), seed=0)
    wide = WideMoE.from_module(stock)
    y = wide(x)            # x [b, H] BF16 -> [b, H] BF16
    wide = WideMoE.from_checkpoint("ckpt_dir", layer=5)   # a Kimi-K3 checkpoint's layer
"""

from .config import WideMoEConfig
from .reference import LatentMoE


def _version() -> str:
    """The checkout's pyproject version where this package runs from a checkout (an
    editable install's metadata can lag behind the file), else the installed
    distribution's."""
    import importlib.metadata
    import pathlib
    import tomllib

    pyproject = pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml"
    if pyproject.is_file():
        project = tomllib.loads(pyproject.read_text()).get("project", {})
        if project.get("name") == "wide_moe_triton":
            return project["version"]
    return importlib.metadata.version("wide_moe_triton")


__version__ = _version()


def __getattr__(name):
    # The Triton path imports triton; the stock reference and config do not need it.
    import importlib

    if name in ("WideMoE", "WideScratch", "SimulatedGroup"):
        return getattr(importlib.import_module(".module", __name__), name)
    if name in ("ops", "mx", "reference", "tuning", "checkpoint", "layout"):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'wide_moe_triton' has no attribute {name!r}")


__all__ = ["__version__", "WideMoEConfig", "LatentMoE", "WideMoE", "WideScratch", "SimulatedGroup", "ops"]
