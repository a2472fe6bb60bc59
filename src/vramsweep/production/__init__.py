"""A production run (docs/RUNS.md): what a ``vramsweep train`` run keeps after training and how it resumes.

1. :mod:`.length`: the run's length in optimizer steps (``train.epochs`` over the examples, or
   ``train.steps``).
2. :mod:`.outputs`: the run folder (``adapter/`` or ``model/``, ``tokenizer/``, ``config.yaml``,
   ``losses.jsonl``, ``run.json``, ``result.json``).
3. :mod:`.checkpoint`: checkpoints every ``train.save_every`` steps and on SIGTERM/SIGUSR1, atomic with a
   completion marker, the newest K kept; exact resume with ``train.resume=auto``.
4. :mod:`.use`: ``vramsweep generate`` and ``vramsweep export``.
"""
