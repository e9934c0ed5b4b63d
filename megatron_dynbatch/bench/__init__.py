"""The benchmark: built-in workloads (:mod:`.workloads`; the real document lengths they draw from, bundled:
:mod:`.documents`), the re-implemented peer baselines (:mod:`.baselines`, on the primitives of
:mod:`.partitioning`; Megatron-LM's own packing paths :mod:`.megatron_upstream`, its dynamic and hybrid context
parallelism :mod:`.megatron_dynamic_cp` and :mod:`.hybrid_cp`), the runner that plans and scores every algorithm
with one cost model (:mod:`.runner`; planning time: :mod:`.speed`, and on hostile input shapes
:mod:`.adversarial`), text/JSON output (:mod:`.report`, :mod:`.table`, the headline and legend
:mod:`.explain`) and per-rank timelines (:mod:`.plot`, matplotlib imported only when a plot is asked for). Beside
the main table: ``bench --dropins`` (:mod:`.dropins`: each trainer's own algorithm against our drop-in for it),
``bench --budgets`` (:mod:`.budgets`: the auto budget against hand-set ones) and the measured step times of
``benchmarks/gpu/measure.py`` (:mod:`.measured`: plans as schedules to time). Torch-free like the planning core.
``megatron-dynbatch bench`` drives it; see ``docs/benchmarks.md`` for a recorded run."""

from .report import format_report, format_speed, format_table, verdicts
from .runner import ALGORITHMS, BenchResult, Row, SpeedResult, run_bench, run_speed, run_workload
from .workloads import WORKLOADS, Workload, default_workloads, select_workloads

__all__ = [
    "ALGORITHMS", "BenchResult", "Row", "SpeedResult", "WORKLOADS", "Workload", "default_workloads",
    "format_report", "format_speed", "format_table", "run_bench", "run_speed", "run_workload",
    "select_workloads", "verdicts",
]
