"""The parts of ``bench/bench_inference.py`` (its docstring describes the measurements): ``timing``
(chunked prefill, decode timing, cache helpers and the fit check, shared with the other decode
benchmarks) and ``real_pair`` (``--real``: a trained teacher/student pair)."""
