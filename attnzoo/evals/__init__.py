"""Accuracy harnesses: lm-eval's tasks run through our engine (``run_eval``), and paired backend comparison.

- ``attnzoo.evals.lm``: the lm-eval model class ``attnzoo`` (importing the module registers it with lm-eval).
- ``attnzoo.evals.tasks``: task lookup, and gsm8k from local files (``--data-dir``).
- ``attnzoo.evals.report``: report building, paired comparison of two runs, terminal rendering.
- ``attnzoo.evals.stats``: exact McNemar test and the paired-difference interval.
- ``attnzoo.evals.run_eval``: the ``run_eval`` command.
- ``python -m attnzoo.evals ...``: lm-eval's own command line with ``--model attnzoo`` available.

Importing this package imports neither lm-eval nor torch; the submodules do.
"""
