"""A saved report (``run_eval --output``) as the reference of ``--compare-to``: read and checked in full
before a run starts, so that a malformed record fails in seconds, not after a whole evaluation."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from attnzoo.errors import EvalError
from attnzoo.evals.report import BINARY_METRICS, REPORT_FORMAT


def load_saved(path: Path) -> dict:
    """The run of the report at ``path``, checked (``check_saved_report``)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EvalError(f"cannot read the report {str(path)!r}: {e}", fix="pass a JSON file written by run_eval --output") from None
    return check_saved_report(data, str(path))


def check_saved_report(report: Any, path: str) -> dict:
    """A saved report must be ours, and hold everything a comparison reads from it (the Decision, the
    settings, each question's record and token ids), checked in full before a run starts: a malformed
    record would otherwise fail after the whole evaluation. Returns its run."""
    if not isinstance(report, dict) or report.get("format") != REPORT_FORMAT or "run" not in report:
        raise EvalError(f"{path} is not a run_eval report (format {REPORT_FORMAT})",
                        fix="pass a JSON file written by run_eval --output, or a backend name")

    def bad(where: str, what: str):
        return EvalError(f"{path} is malformed: {where} {what}",
                         fix="pass an unedited report written by run_eval --output, or re-run it with --output")

    def need(value, kind, where: str, what: str, *, optional: bool = False):
        # bool is an int subclass: True is no doc_id or page size.
        typed = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
        if not (typed or (optional and value is None)):
            raise bad(where, f"must be {what}, got {value!r:.80}")
        return value

    run = need(report["run"], dict, "run", "an object")
    need(run.get("model"), str, "run.model", "a string")
    need(run.get("label"), str, "run.label", "a string", optional=True)
    decision = need(run.get("decision"), dict, "run.decision", "an object")
    for key in ("prefill_backend", "decode_backend"):
        need(decision.get(key), str, f"run.decision.{key}", "a backend name")
    if need(decision.get("page_size"), int, "run.decision.page_size", "a positive integer") < 1:
        raise bad("run.decision.page_size", f"must be a positive integer, got {decision['page_size']!r}")
    settings = need(run.get("settings", {}), dict, "run.settings", "an object")
    need(settings.get("kv_cache_dtype"), str, "run.settings.kv_cache_dtype", "a string", optional=True)
    tasks = need(run.get("tasks"), dict, "run.tasks", "an object")
    if not tasks:
        raise bad("run.tasks", "is empty")
    for task, t in tasks.items():
        where = f"run.tasks.{task}"
        records = need(need(t, dict, where, "an object").get("per_question"), list, f"{where}.per_question",
                       "a list of per-question records")
        if not records:
            raise EvalError(f"{path} has no per-question records for task {task!r}", fix="re-run run_eval --output to save one")
        seen = set()
        for i, r in enumerate(records):
            at = f"{where}.per_question[{i}]"
            need(r, dict, at, "an object")
            doc = need(r.get("doc_id"), int, f"{at}.doc_id", "an integer")
            if doc in seen:
                raise bad(f"{at}.doc_id", f"repeats document {doc}")
            seen.add(doc)
            need(r.get("answers"), dict, f"{at}.answers", "an object (filter -> answer)")
            correct = need(r.get("correct"), dict, f"{at}.correct", "an object (filter -> true/false)")
            if not correct:  # the paired test compares these; without them the run would fail at its end
                raise EvalError(f"{path}: {at} has no right/wrong score (its task is not scored by "
                                f"{' or '.join(BINARY_METRICS)})", fix="--compare-to needs a task scored by exact_match or acc")
            for flt, ok in correct.items():
                need(ok, bool, f"{at}.correct.{flt}", "true or false")
            need(r.get("prompt_hash"), str, f"{at}.prompt_hash", "a string", optional=True)
            ids = need(r.get("output_token_ids"), list, f"{at}.output_token_ids", "a list of token ids", optional=True)
            if ids is not None and not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ids):
                raise bad(f"{at}.output_token_ids", "must hold non-negative integer token ids")
    return run


def check_saved_tokens(run: dict, vocab_size: int, path: str) -> None:
    """The saved token ids are replayed through this model (teacher forcing): each must be in its vocabulary."""
    for task, t in run["tasks"].items():
        for i, r in enumerate(t["per_question"]):
            bad = [x for x in r.get("output_token_ids") or () if x >= vocab_size]
            if bad:
                raise EvalError(f"{path}: run.tasks.{task}.per_question[{i}] holds token id {bad[0]}, outside this "
                                f"model's vocabulary of {vocab_size}", fix="compare against a report of this model")


def check_saved_matches(saved: dict, args, loaded, src) -> None:
    """A saved report is comparable only when it ran the same model and the same task settings."""
    names = set(loaded["tasks"])
    if set(saved.get("tasks", {})) != names:
        raise EvalError(f"the saved report is for task(s) {', '.join(sorted(saved.get('tasks', {})))}, not {', '.join(sorted(names))}",
                        fix="compare against a report of the same task")
    theirs = saved.get("model")
    if theirs != src.name and not (theirs and Path(theirs).expanduser().resolve() == Path(src.name).expanduser().resolve()):
        raise EvalError(f"the saved report evaluated model {theirs!r}, this run {src.name!r}",
                        fix="pass the saved report's --model, or compare against a report of this model")
    s = saved.get("settings", {})
    configs = {name: task.config for name, task in loaded["tasks"].items()}
    shots = {name: args.num_fewshot if args.num_fewshot is not None else c.num_fewshot for name, c in configs.items()}
    # 256: AttnzooLM's max_gen_toks default, used when neither the flag nor the task sets one.
    max_new = args.max_new_tokens or next(((c.generation_kwargs or {}).get("max_gen_toks") for c in configs.values()), None) or 256
    mine = {"limit": args.limit, "apply_chat_template": args.apply_chat_template,
            "num_fewshot": shots if len(shots) > 1 else next(iter(shots.values())), "max_new_tokens": max_new}
    flags = {"limit": "--limit", "apply_chat_template": "--apply-chat-template", "num_fewshot": "--num-fewshot",
             "max_new_tokens": "--max-new-tokens"}
    for key, value in mine.items():
        if key in s and s[key] != value:
            raise EvalError(f"the saved report was run with {key}={s[key]!r}, this run has {value!r}; "
                            "the two runs would not answer the same questions the same way",
                            fix=f"run with the saved report's {flags[key]} ({s[key]!r}), or compare against a matching report")
