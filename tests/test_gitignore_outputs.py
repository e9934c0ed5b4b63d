"""Files the documented commands write into the repository root are git-ignored (issue 28 item 17: the quickstart's
``calibrate ... --output tiny_cpu_cost_model.json`` left an untracked file behind). Every ``--output``, ``--records``
and ``--plot`` file named in the ```bash blocks of the docs that show commands is checked with git itself."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import List

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/quickstart.md", "docs/cost_model.md", "docs/benchmarks.md", "docs/tuning.md")
WRITES = re.compile(r"--(?:output|records|plot)[ =]([\w./-]+)")


def written_files() -> List[str]:
    """The plain relative file names the documented commands write (placeholders in capitals left out)."""
    out = []
    for doc in DOCS:
        text = (ROOT / doc).read_text(encoding="utf-8")
        for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M):
            out += [f for f in WRITES.findall(block) if not f.isupper() and not f.startswith(("/", "$"))]
    return sorted(set(out))


def test_the_documented_output_files_are_found():
    files = written_files()
    assert "tiny_cpu_cost_model.json" in files or any(f.endswith("_cost_model.json") for f in files), files
    assert "plan.png" in files


def test_every_file_a_documented_command_writes_is_ignored():
    if shutil.which("git") is None or subprocess.run(["git", "rev-parse"], cwd=ROOT, capture_output=True).returncode:
        pytest.skip("not a git checkout")
    tracked = set(subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split())
    files = [f for f in written_files() if f not in tracked]  # e.g. docs/benchmark_timelines.png is committed
    res = subprocess.run(["git", "check-ignore", "--no-index", "--stdin", "-v", "-n"], cwd=ROOT, capture_output=True,
                         text=True, input="\n".join(files) + "\n")
    not_ignored = [ln.split("\t")[-1] for ln in res.stdout.splitlines() if ln.startswith("::")]
    assert not_ignored == [], f"documented commands write {not_ignored}: add them to .gitignore"
