"""lm-eval's own command line, with the ``attnzoo`` model registered:

    python -m attnzoo.evals run --model attnzoo --model_args pretrained=PATH,backend=torch --tasks gsm8k

lm-eval 0.4.13 discovers models only through its built-in table (no plugin entry points), so the
bare ``lm_eval`` command cannot see ours; this runs the same command line after registering it.
"""
import sys


def main() -> None:
    from lm_eval.__main__ import cli_evaluate

    from attnzoo.evals.lm import register

    register()
    cli_evaluate()


if __name__ == "__main__":
    sys.exit(main())
