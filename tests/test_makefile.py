"""The set-up of the README's two commands: `make run` installs what running needs, `make test`
adds the test extras, whatever ran before. Checked with `make -n` (what make would run) in a
copy of the build files whose environment is faked by its stamp files."""

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parent.parent
TEST_ONLY = {"torch", "scipy", "matplotlib", "pytest", "pytest-xdist", "openai", "httpx"}

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def extras(name: str) -> set[str]:
    """The distribution names of Makefile variable ``name``'s extras (from pyproject.toml)."""
    value = re.search(rf"^{name} \?= (.*)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return {re.split(r"[<>=\[ ;]", req)[0].lower() for extra in value.split(",") for req in optional[extra]}


def test_run_installs_no_test_extras():
    run = extras("RUN_EXTRAS")
    assert {"textual", "starlette", "uvicorn"} <= run  # chat and serve
    assert not run & TEST_ONLY, run & TEST_ONLY
    assert TEST_ONLY <= extras("TEST_EXTRAS")


@pytest.fixture
def tree(tmp_path):
    """A copy of the build files with a faked, built environment (stamps only)."""
    for name in ("Makefile", "pyproject.toml", "setup.py"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "native", tmp_path / "native")
    (tmp_path / "build" / "sdist").mkdir(parents=True)
    (tmp_path / "build" / "sdist" / "llama_cpp_python-0.3.36.tar.gz").touch()
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    return tmp_path


def touch_after(path: Path, *others: Path) -> None:
    """Touch ``path`` with a modification time after every file of ``others``."""
    t = max(o.stat().st_mtime for o in others) + 10 if others else time.time()
    path.touch()
    os.utime(path, (t, t))


def plan(tree: Path, target: str) -> str:
    r = subprocess.run(["make", "-n", target], cwd=tree, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_run_then_test_installs_the_test_extras(tree):
    venv = tree / ".venv"
    srcs = [tree / "pyproject.toml", tree / "setup.py", *(tree / "native").iterdir(),
            tree / "build" / "sdist" / "llama_cpp_python-0.3.36.tar.gz"]  # fmt: skip
    fresh = plan(tree, "run")
    assert 'pip install -e ".[tui,server]"' in fresh and "[dev" not in fresh and "train" not in fresh
    touch_after(venv / ".installed", *srcs)  # `make run` done
    touch_after(venv / "bin" / "localspec-rpc-server", venv / ".installed")
    assert "pip install" not in plan(tree, "run")
    after_run = plan(tree, "test")
    assert 'pip install -e ".[dev,tui,server,train]"' in after_run and "pytest -n" in after_run
    touch_after(venv / ".installed-test", venv / ".installed")  # `make test` done
    assert "pip install" not in plan(tree, "test")
    touch_after(tree / "pyproject.toml", venv / ".installed-test", venv / "bin" / "localspec-rpc-server")
    again = plan(tree, "test")  # a changed pyproject.toml redoes both, in order
    assert again.index('".[tui,server]"') < again.index('".[dev,tui,server,train]"') < again.index("pytest -n")
