"""lm-eval's own result and sample files for a run (``run_eval --lm-eval-output DIR``), written by lm-eval's
EvaluationTracker, so tools that read lm-eval's output folders read ours."""
from __future__ import annotations

from pathlib import Path


def write_lm_eval_files(folder: str, results: dict, label: str, llm) -> dict:
    """results_<date>.json and samples_<task>_<date>.jsonl under ``folder``/<model>; returns where, and the
    Decision the run used (lm-eval's results carry it under ``attnzoo``)."""
    from lm_eval.loggers import EvaluationTracker

    tracker = EvaluationTracker(output_path=str(folder))
    chat_template = getattr(llm.tokenizer, "chat_template", None) if llm.tokenizer is not None else None
    tracker.general_config_tracker.log_experiment_args(
        model_source="attnzoo", model_args={"pretrained": str(llm.source.name)}, system_instruction=None,
        chat_template=chat_template if isinstance(chat_template, str) else None, fewshot_as_multiturn=False)
    samples = results.get("samples") or {}
    aggregated = {k: v for k, v in results.items() if k != "samples"}
    aggregated["attnzoo"] = {"label": label, "decision": llm.decision.to_dict()}
    tracker.save_results_aggregated(results=aggregated, samples=samples)
    for task, task_samples in samples.items():
        tracker.save_results_samples(task_name=task, samples=task_samples)
    out = Path(folder) / tracker.general_config_tracker.model_name_sanitized
    return {"folder": str(out.resolve()), "files": sorted(p.name for p in out.glob(f"*{tracker.date_id}*"))}
