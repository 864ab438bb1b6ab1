"""On-policy distillation (OPAL): the student samples continuations of curriculum prompts and is
trained on the frozen teacher's reverse KL over its own tokens. stage.py is what a step trains
(``OPDModule``: packed rollouts scored by student and teacher), the rollout record and its packing,
``generate``-based sampling, the horizon schedule and its plateau detector, and the tokenizer and
vocabulary checks; build.py builds the student, teacher and shared tokenizer; prompts.py the prompt
sets and their curriculum; rollouts.py the continuous-batching rollouts on the static decoder,
which draw their tokens with sampling.py's on-device samplers; trainer.py is ``OPDTrainer``, the
``halo_dist.train`` Trainer with OPD's step, evaluation, checkpoint contents and export. Its config
section (``OPDConfig``, ``PromptSetConfig``) stays in ``halo_dist.config.opd_schema``: the run
config holds it, and every module here reads the run config, so a schema here would tie the two
packages into an import cycle.

Nothing is imported here, so importing one module (the prompts, the samplers) does not load the
trainer and its torch-heavy dependencies.
"""
