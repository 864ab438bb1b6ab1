"""The whole HALO pipeline as one plan of steps, and the runner that carries it out (`halo-dist
demo`).

The plan (demo.py, :class:`~halo_dist.pipeline.demo.Demo`): teacher -> data shards -> stage 1 ->
layer selection -> stage 2 -> stage 3 -> export -> calibration of the logits-scaling base ->
evaluation of teacher and student -> report. Each step is the command a user would type
(data_prep, launchers/stageN.py, halo-dist ...), its inputs the folders the steps before it wrote
and its done-marker the file it writes last.

  demo.py      the plan and `halo-dist demo` (its flag parser and entry)
  steps.py     the runner: each step a subprocess with its log, skipped when done, stopped at the
               deadline, some in the background
  settings.py  the flags and presets (CPU default, tiny for tests, one H200)
  progress.py  the console's progress line of a running step
  report.py    the Markdown report with pictures and the closing console lines
"""
