"""The project's own packaging builds without setuptools warnings: the license is an SPDX
expression (the TOML table form is deprecated), and every folder that ships files is a
declared package (a data folder left out is "Package would be ignored" at every build)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parent.parent


def config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_shipped_folder_is_a_declared_package():
    tool = config()["tool"]["setuptools"]
    packages, dirs = set(tool["packages"]), tool["package-dir"]
    roots = {"localspec": ROOT / "localspec", **{name: ROOT / path for name, path in dirs.items()}}
    found = set()
    for name, root in roots.items():
        for folder, subdirs, files in os.walk(root):
            subdirs[:] = [d for d in subdirs if d != "__pycache__" and not d.startswith(".")]
            rel = Path(folder).relative_to(root)
            dotted = ".".join([name, *rel.parts])
            if files:
                found.add(dotted)
    assert found - packages == set(), "folders with files that are not declared packages"
    for pkg, patterns in tool["package-data"].items():
        assert pkg in packages and not any("/" in p for p in patterns), (pkg, patterns)


def test_pyproject_applies_without_warnings():
    """setuptools reads the configuration with every warning an error (the license as a TOML
    table raised SetuptoolsDeprecationWarning)."""
    code = ("from setuptools.config.pyprojecttoml import apply_configuration\n"
            "from setuptools.dist import Distribution\n"
            "apply_configuration(Distribution(), 'pyproject.toml')\n")  # fmt: skip
    r = subprocess.run([sys.executable, "-W", "error", "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert isinstance(config()["project"]["license"], str)
