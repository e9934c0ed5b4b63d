"""``scripts/setup.sh`` does what README says (issue 28 item 17): the planner-only set-up is an isolated ``.venv``
(NumPy, PyYAML, tqdm and the package, nothing of the system's site-packages); ``--test`` lets ``.venv`` see the
system's site-packages so an installed torch is reused -- on a fresh checkout and on a ``.venv`` the first command
made, which it switches over and says so. The interpreter is a stand-in that records its calls and makes a
``pyvenv.cfg`` like ``python -m venv`` does (the real installs need the network and minutes; CI runs the real
``setup.sh --test``): what is checked is the script's own logic."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

STAND_IN = r"""#!/usr/bin/env bash
echo "PY $*" >> "$SETUP_LOG"
if [ "${1:-}" = "-m" ] && [ "${2:-}" = "venv" ]; then
  shift 2; sys=false; dir=
  for a in "$@"; do case "$a" in --system-site-packages) sys=true ;; -*) ;; *) dir=$a ;; esac; done
  mkdir -p "$dir/bin"
  printf 'home = /usr/bin\ninclude-system-site-packages = %s\nversion = 3.11.7\n' "$sys" > "$dir/pyvenv.cfg"
  cp "$0" "$dir/bin/python"
  exit 0
fi
case "$*" in *"print(torch.__version__)"*) echo 2.13.0 ;; esac
if [ "${1:-}" = "-" ]; then cat > /dev/null; fi
exit 0
"""


@pytest.fixture()
def repo(tmp_path):
    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    py = tmp_path / "python-stand-in"
    py.write_text(STAND_IN)
    py.chmod(py.stat().st_mode | stat.S_IEXEC)
    return tmp_path


def _setup(repo: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": str(repo / "python-stand-in"), "SETUP_LOG": str(repo / "log.txt")}
    res = subprocess.run(["bash", str(repo / "scripts" / "setup.sh"), *args], capture_output=True, text=True,
                         env=env, timeout=60)
    assert res.returncode == 0, res.stderr
    return res


def _sees_system(repo: Path) -> bool:
    cfg = (repo / ".venv" / "pyvenv.cfg").read_text()
    assert cfg.count("include-system-site-packages") == 1, cfg
    return "include-system-site-packages = true" in cfg


def test_the_planner_set_up_is_isolated_and_test_then_sees_the_system_packages(repo):
    out = _setup(repo).stdout
    assert not _sees_system(repo) and "isolated from the system's site-packages" in out
    assert "--system-site-packages" not in (repo / "log.txt").read_text()
    out = _setup(repo, "--test").stdout
    assert _sees_system(repo) and "now also sees the system's site-packages" in out
    assert "reusing installed torch 2.13.0" in out
    out = _setup(repo).stdout  # the planner set-up again: says what the .venv now is
    assert _sees_system(repo) and "also sees the system's site-packages" in out


def test_a_fresh_test_set_up_sees_the_system_packages_from_the_start(repo):
    out = _setup(repo, "--test").stdout
    assert _sees_system(repo) and "now also sees" not in out
    assert "-m venv --system-site-packages .venv" in (repo / "log.txt").read_text()
