"""Every public door still plans and refuses as the baseline says (issue 31: behaviour stays the same).

``scripts/door_equivalence.py`` sends seeded random planning requests through every door (Python API, options
object, ``plan`` command, Megatron-LM launch flags, run presets, the data iterator, the Ray driver, upstream's
packing seat and the trainer drop-ins) and fingerprints each answer: a plan by what it decided, a refusal by its
exception class and field. ``tests/data/door_equivalence_baseline.json.gz`` holds the fingerprints of the full
default run; this test runs its first cases through every door and requires the same answers. A change that is
meant to change behaviour rewrites the baseline with the command the failure prints (and says why in its commit).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "door_equivalence.py"
CASES = 60
REWRITE = "python scripts/door_equivalence.py --write tests/data/door_equivalence_baseline.json.gz"


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("door_equivalence", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["door_equivalence"] = module
    spec.loader.exec_module(module)
    return module


def test_baseline_covers_every_door(tool):
    base = tool.read(tool.BASELINE)
    assert base["meta"]["n"] >= 1000 and set(base["meta"]["doors"]) == set(tool.DOORS)
    assert len(base["cases"]) == base["meta"]["n"]
    table = tool.counts(base["cases"], list(tool.DOORS))
    for door, c in table.items():  # every door both plans and refuses somewhere in the baseline
        assert c["plans"] > 0 and c["refusals"] > 0, (door, c)


def test_first_cases_answer_as_the_baseline_at_every_door(tool):
    pytest.importorskip("torch")
    base = tool.read(tool.BASELINE)
    seed = base["meta"]["seed"]
    doors = list(tool.DOORS)
    results = tool.run(CASES, seed, doors)
    diffs = [f"{key} {door}: baseline {base['cases'][key][door]}, now {row[door]} "
             f"(python scripts/door_equivalence.py --case {key} --doors {door})"
             for key, row in results.items() for door in doors if base["cases"][key][door] != row[door]]
    assert not diffs, (f"{len(diffs)} door answer(s) changed:\n" + "\n".join(diffs[:10]) +
                       f"\nIf the change is intended, rewrite the baseline: {REWRITE} (and say why in the commit)")


def test_fingerprints_ignore_the_message_and_read_the_plan_protocol(tool):
    from megatron_dynbatch import DynBatchConfigError, plan_global_batch

    exc = DynBatchConfigError("max_tokens_per_gpu", 0, "must be >= 1", "pass a budget")
    assert tool.refusal(exc) == "E:DynBatchConfigError:max_tokens_per_gpu"
    a = plan_global_batch([100, 200, 300, 50], max_tokens_per_gpu=512, parallel={"dp": 2})
    b = plan_global_batch([100, 200, 300, 50], max_tokens_per_gpu=512, parallel={"dp": 2})
    b.planning_time_s = a.planning_time_s + 1.0  # timing never enters the fingerprint
    assert tool.digest(a) == tool.digest(b) and tool.digest(a).startswith("P:")
    c = plan_global_batch([100, 200, 300, 50], max_tokens_per_gpu=1024, parallel={"dp": 2})
    assert tool.digest(c) != tool.digest(a)  # the budget is part of the fingerprint
