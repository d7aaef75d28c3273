"""lm-eval's own command line, with the ``attnzoo`` model registered:

    python -m attnzoo.evals run --model attnzoo --model_args pretrained=PATH,backend=torch --tasks gsm8k
    python -m attnzoo.evals run --model attnzoo --model_args kv_cache_dtype=fp8_e4m3 --tasks gsm8k \
        --data-dir ../shared/data/gsm8k          # offline: gsm8k's documents from local files

lm-eval 0.4.13 discovers models only through its built-in table (no plugin entry points), so the
bare ``lm_eval`` command cannot see ours; this runs the same command line after registering it.
Without a GPU the model runs where ``load_model`` puts it (lm-eval's default ``--device cuda:0`` is
ignored then; ``device=`` in ``--model_args`` is not).

Where the Hub cannot be reached (or HF_HUB_OFFLINE is set), the named tasks' documents are read first (from the datasets cache, in
its offline mode), so a missing dataset fails in seconds, before the model loads.

``--data-dir DIR`` (ours, taken off the command line before lm-eval sees it) replaces ``gsm8k`` in
``--tasks`` with a task file that includes lm-eval's own gsm8k YAML and swaps only its dataset for
DIR/train.jsonl and DIR/test.jsonl, as ``run_eval --data-dir`` does.
"""
import sys
import tempfile
from pathlib import Path

from attnzoo.errors import AttnzooError, EvalError


def _pop_data_dir(argv: list[str]) -> tuple[list[str], str | None]:
    out, data_dir, i = [], None, 0
    while i < len(argv):
        a = argv[i]
        if a == "--data-dir" and i + 1 < len(argv):
            data_dir, i = argv[i + 1], i + 2
            continue
        if a.startswith("--data-dir="):
            data_dir = a.split("=", 1)[1]
        else:
            out.append(a)
        i += 1
    return out, data_dir


def local_task_file(task: str, data_dir: str, folder: Path) -> Path:
    """A task YAML that is lm-eval's ``task`` with its documents read from ``data_dir``."""
    import json

    from attnzoo.evals.tasks import _lm_eval_tasks_dir, check_data_dir

    files = check_data_dir(task, data_dir)
    path = folder / f"{task}.yaml"
    # JSON is valid YAML: no quoting rules to get wrong for paths.
    spec = {"include": str(_lm_eval_tasks_dir() / task / f"{task}.yaml"), "dataset_path": "json",
            "dataset_name": None, "dataset_kwargs": {"data_files": files}}
    path.write_text(json.dumps(spec, indent=1) + "\n")
    return path


def _with_local_tasks(argv: list[str], data_dir: str, folder: Path) -> list[str]:
    """``--tasks`` (also ``-t`` and ``--tasks=...``, lm-eval's spellings) with each task swapped for its local file."""
    from attnzoo.evals.tasks import LOCAL_DATA_TASKS

    def local(names: str) -> str:
        unknown = [n for n in names.split(",") if n not in LOCAL_DATA_TASKS]
        if unknown:
            raise EvalError(f"--data-dir serves {', '.join(LOCAL_DATA_TASKS)} only, not {', '.join(unknown)}",
                            fix="drop --data-dir, or run those tasks separately")
        return ",".join(str(local_task_file(n, data_dir, folder)) for n in names.split(","))

    found = _tasks_arg(argv)
    if found is None:
        raise EvalError("--data-dir needs --tasks gsm8k", fix="add --tasks gsm8k")
    i, names = found
    out = list(argv)
    out[i] = local(names) if out[i] == names else "--tasks=" + local(names)
    return out


def _tasks_arg(argv: list[str]) -> tuple[int, str] | None:
    """Where the task names are in ``argv`` (``--tasks X``, ``-t X``, ``--tasks=X``): (index, names)."""
    for i, a in enumerate(argv):
        if a in ("--tasks", "-t") and i + 1 < len(argv):
            return i + 1, argv[i + 1]
        if a.startswith("--tasks="):
            return i, a.split("=", 1)[1]
    return None


def _check_tasks_offline(argv: list[str]) -> None:
    """Without the Hub, read each named task's documents (from the datasets cache) before lm-eval loads the
    model: lm-eval loads the model first and the documents after."""
    from attnzoo.evals.tasks import load_tasks

    found = _tasks_arg(argv)
    for name in (found[1].split(",") if found else ()):
        if name and not name.endswith((".yaml", ".yml")) and "/" not in name:
            load_tasks(name, None)


def _is_hub_failure(e: BaseException) -> bool:
    """A dataset download that failed (offline, unreachable Hub)."""
    while e is not None:
        mod = type(e).__module__ or ""
        if isinstance(e, (ConnectionError, TimeoutError)) or mod.startswith(("requests", "urllib3", "huggingface_hub", "httpx")):
            return True
        if "offline" in str(e).lower() or "couldn't reach" in str(e).lower():
            return True
        e = e.__cause__ or e.__context__
    return False


_HELP = """attnzoo's additions to lm-eval's command line (lm-eval's own options follow):
  --model attnzoo       attnzoo's engine (--model_args pretrained=PATH,backend=NAME,kv_cache_dtype=...)
  --data-dir DIR        read gsm8k from DIR/train.jsonl and DIR/test.jsonl (offline) instead of the Hub
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        from lm_eval.__main__ import cli_evaluate
    except ModuleNotFoundError as e:
        print(f"attnzoo.evals: error: lm-eval is not installed ({e.name}). Fix: pip install \"attnzoo[evals]\"",
              file=sys.stderr)
        return 2

    import attnzoo.evals.lm  # noqa: F401  (registers --model attnzoo with lm-eval)
    from attnzoo.evals.tasks import hub_offline_mode

    if any(a in ("-h", "--help") for a in argv):
        print(_HELP)
    args, data_dir = _pop_data_dir(argv)
    with tempfile.TemporaryDirectory(prefix="attnzoo-tasks-") as tmp:
        try:
            sys.argv = [sys.argv[0], *args]
            if data_dir is not None:
                sys.argv[1:] = _with_local_tasks(args, data_dir, Path(tmp))
                cli_evaluate()
            else:
                with hub_offline_mode() as offline:
                    if offline:
                        _check_tasks_offline(args)
                    cli_evaluate()
        except AttnzooError as e:
            print(f"attnzoo.evals: error: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback through lm-eval and torch
            print("\nattnzoo.evals: interrupted", file=sys.stderr)
            return 130
        except Exception as e:
            if data_dir is None and _is_hub_failure(e):
                print(f"attnzoo.evals: error: cannot download the task's documents ({type(e).__name__}: {e}). "
                      "Fix: run offline with --data-dir DIR (gsm8k: DIR/train.jsonl and DIR/test.jsonl)", file=sys.stderr)
                return 2
            raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
