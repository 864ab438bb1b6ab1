"""The parts of ``bench/real_conversion.py`` (its docstring describes the run and its commands):
``run_folder`` (the run folder across pieces and the files a run adjusts), ``summary`` (every
figure of a run in one results file), ``compare`` (an ablation or one change against its baseline)
and ``pictures``."""
