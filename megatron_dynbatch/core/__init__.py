"""The planning core: lengths in, plan out. Pure Python + NumPy (+ PyYAML for presets).

Nothing below this package imports torch, megatron or ray -- not even lazily (``tests/test_layout.py`` checks
both the source and a fresh interpreter), so every DP rank can plan without a GPU, and the benchmark and CLI run
on a machine with NumPy alone. Modules:

* inputs: ``errors``, ``checks`` (the scalar checks every entry point shares), ``parallel``, ``topology`` (which
  CP groups cross nodes), ``alignment``, ``model_spec`` (+ ``model_sources``, ``presets``), ``run_config``;
* costs: ``flops``, ``cost_model`` (the step-time model), ``cost_profiles``, ``cost_files`` (a ``cost_model=``
  choice resolved), ``cost_fit`` (fitting to timings), ``pipeline_sim`` (1F1B makespan), ``smallops``;
* ``memory`` (the peak per GPU and the budget that fits) and ``startup`` (the longest sample fits a micro-batch);
* ``planner`` (lengths in, plan out; ``planner.dyncp`` for dynamic context parallelism), ``partitioning`` (the
  peers' partitioning primitives), ``metrics`` (a plan's per-step scalars);
* ``calibration`` (fitting the cost model on the user's hardware, offline and online) and ``dropin`` (the
  planning side of the trainers' drop-ins).
"""
