"""Package discovery that pyproject.toml alone cannot express: every ``vmmkv*`` package found
on disk (new ones included without editing a list), plus the CUDA sources of the top-level
``csrc/`` shipped as the package ``vmmkv._csrc``. Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["vmmkv", "vmmkv.*"]), "vmmkv._csrc"],
    package_dir={"vmmkv._csrc": "csrc"},
)
