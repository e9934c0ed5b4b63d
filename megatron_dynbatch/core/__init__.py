"""The planning core: lengths in, plan out. Pure Python + NumPy (+ PyYAML for presets).

Nothing below this package imports torch, megatron or ray -- not even lazily (``tests/test_layout.py`` checks
both the source and a fresh interpreter), so every DP rank can plan without a GPU, and the benchmark and CLI run
on a machine with NumPy alone. Modules: ``errors``, ``parallel``, ``alignment``, ``model_spec`` (+
``model_sources``, ``presets``), ``flops``, ``cost_model``, ``memory``, ``run_config`` and the ``planner``.
"""
