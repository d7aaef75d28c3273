"""Find and build lm-eval tasks, with gsm8k readable from local files.

``--data-dir DIR`` keeps lm-eval's own gsm8k task (prompt, few-shot sampling, stop strings, the
strict-match and flexible-extract filters, the metric) and swaps only where its documents come from:
the task's YAML is read from lm-eval's task folder and its dataset fields are replaced by the
``json`` builder over DIR/train.jsonl and DIR/test.jsonl. The task keeps its name, so results and
logged samples are keyed exactly as in a stock lm-eval run.
"""
from __future__ import annotations

import contextlib
import difflib
import json
import os
from pathlib import Path
from typing import Any

from attnzoo.errors import EvalError

# Tasks whose documents --data-dir can supply, and the files it needs for each split.
LOCAL_DATA_TASKS = {"gsm8k": {"train": "train.jsonl", "test": "test.jsonl"}}
_GSM8K_FIELDS = ("question", "answer")


def require_lm_eval() -> None:
    """lm-eval supplies the task definitions and metrics; name the missing extra before any model loads."""
    try:
        import lm_eval  # noqa: F401
    except ImportError as e:
        raise EvalError(f"run_eval needs lm-eval, which is not installed here ({e})",
                        fix="pip install -e '.[evals]' (lm_eval==0.4.13)") from None


def _lm_eval_tasks_dir() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent


def check_data_dir(task: str, data_dir: str | Path) -> dict[str, str]:
    """Validate DIR for ``task`` and return the ``data_files`` mapping (split -> absolute path)."""
    if task not in LOCAL_DATA_TASKS:
        raise EvalError(
            f"--data-dir is supported for {', '.join(LOCAL_DATA_TASKS)} only, not for task {task!r}",
            fix=f"drop --data-dir to load {task!r} from the Hugging Face Hub as lm-eval does",
        )
    root = Path(data_dir).expanduser()
    if not root.is_dir():
        raise EvalError(f"--data-dir {str(data_dir)!r} is not a directory",
                        fix=f"point --data-dir at a folder holding {', '.join(LOCAL_DATA_TASKS[task].values())}")
    files = {}
    for split, name in LOCAL_DATA_TASKS[task].items():
        path = root / name
        if not path.is_file():
            raise EvalError(f"--data-dir {str(data_dir)!r} has no {name} (the {split} split of {task})",
                            fix=f"put the original GSM8K {name} (one JSON object per line with 'question' and 'answer') there")
        _check_gsm8k_file(path)
        files[split] = str(path.resolve())
    return files


def _check_gsm8k_file(path: Path) -> int:
    """The number of documents in ``path``, each checked. The json builder would fail deep inside
    `datasets` with no line number; check here instead."""
    try:
        return _read_gsm8k_file(path)
    except UnicodeDecodeError as e:
        raise EvalError(f"{path} is not UTF-8 text (byte {e.object[e.start:e.start + 1]!r} at offset {e.start})",
                        fix="use the original GSM8K jsonl files (UTF-8), or convert the file with iconv -t UTF-8") from None
    except OSError as e:
        raise EvalError(f"cannot read {path} ({e.strerror or e})", fix="check the file's permissions") from None


def _read_gsm8k_file(path: Path) -> int:
    n = 0
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as e:
                raise EvalError(f"{path}:{lineno} is not valid JSON ({e.msg})", fix="use the original GSM8K jsonl files") from None
            if not isinstance(doc, dict) or any(not isinstance(doc.get(k), str) for k in _GSM8K_FIELDS):
                raise EvalError(f"{path}:{lineno} lacks the string fields 'question' and 'answer'",
                                fix="use the original GSM8K jsonl format")
            if "####" not in doc["answer"]:
                raise EvalError(f"{path}:{lineno}: the answer has no '#### <number>' line",
                                fix="use the original GSM8K answers, which end in '#### <final answer>'")
            n += 1
    if n == 0:
        raise EvalError(f"{path} is empty", fix="use the original GSM8K jsonl files")
    return n


def check_fewshot_pool(data_files: dict[str, str] | None, loaded, num_fewshot: int | None) -> None:
    """--data-dir: each task's few-shot split must hold as many documents as the shots it samples (without
    replacement), else lm-eval fails on the first question, after the model has loaded."""
    if not data_files:
        return
    for name, task in loaded["tasks"].items():
        shots = num_fewshot if num_fewshot is not None else (task.config.num_fewshot or 0)
        split = getattr(task.config, "fewshot_split", None) or "train"
        if shots and split in data_files:
            have = _check_gsm8k_file(Path(data_files[split]))
            if have < shots:
                raise EvalError(f"{data_files[split]} holds {have} document(s), fewer than the {shots} few-shot "
                                f"examples {name} samples from it per question",
                                fix=f"pass --num-fewshot {have} or fewer, or use the full {Path(data_files[split]).name}")


def offline_set() -> bool:
    """HF_HUB_OFFLINE (or its datasets / transformers spellings) is set."""
    return any(os.environ.get(k, "").lower() in ("1", "true", "yes", "on")
               for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"))


@contextlib.contextmanager
def hub_offline_mode():
    """Where the Hub cannot be reached, or the environment says offline, the documents are read in the
    datasets library's offline mode: a cached dataset still loads and anything else fails at once (the Hub
    client would retry each file for ~23 s, logging every try; the libraries read the environment only at
    their import, so a variable set later did not count). Yields why (for the error), or None where
    nothing changed."""
    from attnzoo.network import hub_host, reachable

    host = hub_host()
    if offline_set():
        why = "HF_HUB_OFFLINE (or HF_DATASETS_OFFLINE) is set"
    elif not reachable(host):
        why = f"{host} cannot be reached (no network?)"
    else:
        yield None
        return
    import datasets.config
    import huggingface_hub.constants

    # Both libraries read these module flags on every request.
    flags = [(huggingface_hub.constants, "HF_HUB_OFFLINE"), (datasets.config, "HF_HUB_OFFLINE"),
             (datasets.config, "HF_DATASETS_OFFLINE")]
    saved = [getattr(mod, name) for mod, name in flags]
    for mod, name in flags:
        setattr(mod, name, True)
    try:
        yield why
    finally:
        for (mod, name), value in zip(flags, saved):
            setattr(mod, name, value)


def task_manager(task: str):
    """A TaskManager that knows ``task``. For gsm8k only its own folder is indexed (seconds instead of
    half a minute for the whole catalogue of several thousand YAML files)."""
    from lm_eval.tasks import TaskManager

    folder = _lm_eval_tasks_dir() / task
    if task in LOCAL_DATA_TASKS and (folder / f"{task}.yaml").is_file():
        tm = TaskManager(include_path=str(folder), include_defaults=False)
        if task in tm.all_tasks:
            return tm
    tm = TaskManager()
    if task not in tm.all_tasks:
        close = difflib.get_close_matches(task, tm.all_tasks, n=5, cutoff=0.6)
        hint = f"did you mean: {', '.join(close)}? " if close else ""
        raise EvalError(f"unknown task {task!r}: lm-eval has no task, group or tag of that name",
                        fix=f"{hint}`lm-eval ls tasks` lists them; gsm8k is the task run_eval is built around")
    return tm


def task_spec(tm, task: str, data_files: dict[str, str] | None) -> str | dict[str, Any]:
    """What to hand to ``TaskManager.load``: the name, or (with local files) the task's own config with
    only its dataset fields replaced."""
    if data_files is None:
        return task
    from lm_eval.tasks._yaml_loader import load_yaml

    entry = tm.task_index[task]
    cfg = dict(load_yaml(entry.yaml_path, resolve_func=True))
    cfg.update(dataset_path="json", dataset_name=None, dataset_kwargs={"data_files": dict(data_files)})
    return cfg


def _offline_fix(task: str) -> str:
    if task in LOCAL_DATA_TASKS:
        return f"pass --data-dir DIR with {', '.join(LOCAL_DATA_TASKS[task].values())} to run offline"
    return "connect to the network, or pre-fill the Hugging Face datasets cache"


def load_tasks(task: str, data_files: dict[str, str] | None) -> tuple[Any, dict[str, Any]]:
    """Build the task objects (this reads the documents). Returns the TaskManager (hand it to
    ``simple_evaluate``, which otherwise indexes every task lm-eval has) and lm-eval's
    ``{"tasks": ..., ...}``."""
    tm = task_manager(task)
    spec = task_spec(tm, task, data_files)
    offline = None
    try:
        with (contextlib.nullcontext() if data_files else hub_offline_mode()) as offline:
            loaded = tm.load([spec])
    except EvalError:
        raise
    except Exception as e:  # offline hub, gated dataset, bad YAML: lm-eval and datasets raise many types
        if offline:
            raise EvalError(f"cannot load the documents of task {task!r}: {offline} and they are not in the "
                            "local datasets cache", fix=_offline_fix(task)) from None
        where = "the local files" if data_files else "the Hugging Face Hub"
        fix = "check the files under --data-dir" if data_files else _offline_fix(task)
        raise EvalError(f"cannot load the documents of task {task!r} from {where}: {type(e).__name__}: {e}", fix=fix) from e
    if not loaded["tasks"]:
        raise EvalError(f"task {task!r} expands to no tasks", fix="pick a task, or a group with tasks in it")
    return tm, loaded
