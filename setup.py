"""The package list beside pyproject.toml: every ``wide_moe_triton`` package found in the
checkout, and ``wide_moe_triton.autotune_configs`` from the top-level ``autotune_configs/``
(the tuned tables' source), so a wheel and an editable install both hold the tables
where ``tuning.SHIPPED`` looks for them."""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["wide_moe_triton", "wide_moe_triton.*"]),
                "wide_moe_triton.autotune_configs"],
      package_dir={"wide_moe_triton.autotune_configs": "autotune_configs"})
