"""``run_eval TASK``: an lm-eval task through our engine, with a report and an optional paired comparison.

Everything that can be wrong with the command line (task, data files, backend choices the policy
rejects, limits, the output path, a saved report to compare with) is checked before any weights are
read, so a mistake costs seconds, not a model load and a half-finished run.
"""
from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnzoo.console import setup_logging
from attnzoo.errors import AttnzooError, EvalError
from attnzoo.evals.args import CPU_LOGIT_COMPARE_LIMIT, _check_numbers, build_parser, check_output_path  # noqa: F401

log = logging.getLogger("attnzoo")

# KV tokens each of the two teacher-forcing engines holds at once (a wave of questions).
_FORCED_KV_TOKENS = {"cuda": 1 << 18, "cpu": 1 << 14}


@dataclass
class Backends:
    """One run's explicit attention choices (None: the policy decides)."""

    backend: str | None = None
    prefill_backend: str | None = None
    decode_backend: str | None = None
    page_size: int | None = None
    kv_cache_dtype: str = "auto"

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in self.__dict__.items() if v is not None and (k, v) != ("kv_cache_dtype", "auto")]
        return ", ".join(parts) or "policy default"


def _compare_target(value: str | None) -> tuple[str | None, Path | None]:
    """(backend name, None) or (None, saved report path)."""
    if value is None:
        return None, None
    p = Path(value).expanduser()
    if p.is_file():
        return None, p
    if value.endswith(".json") or os.sep in value:
        raise EvalError(f"--compare-to {value!r}: no such report file", fix="pass an existing report JSON or a backend name")
    return value, None


def _tensor_parallel_size(args) -> int:
    from attnzoo.engine.tensor_parallel import torchrun_world

    world = torchrun_world()
    return args.tensor_parallel_size or (world[2] // (args.data_parallel_size or 1) if world else 1)


def _resolve_policy(config, src, device, dtype, policy_file, b: Backends, tp: int = 1):
    """The Decision load_model would take, computed from the config alone (no weights read)."""
    import torch

    from attnzoo.policy import Overrides, resolve
    from attnzoo.policy.profile import profile_from_config, rank_local

    try:
        dev = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    except RuntimeError:
        raise EvalError(f"--device {device!r} is not a device torch knows", fix="pass cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise EvalError(f"--device {device} was asked for but no CUDA GPU is available", fix="pass --device cpu")
    ov = Overrides(backend=b.backend, prefill_backend=b.prefill_backend, decode_backend=b.decode_backend,
                   page_size=b.page_size, policy_file=policy_file, dtype=dtype, kv_cache_dtype=b.kv_cache_dtype)
    shapes = config if tp == 1 else rank_local(profile_from_config(config), tp)  # one rank's heads
    return resolve(shapes, gpu=None if dev.type == "cuda" else "cpu", overrides=ov, model_id=src.name)


# ------------------------------------------------------------------------------ one run


def _load(args, b: Backends, **kw):
    from attnzoo import load_model

    return load_model(args.model, backend=b.backend, prefill_backend=b.prefill_backend, decode_backend=b.decode_backend,
                      page_size=b.page_size, policy_file=args.policy, dtype=args.dtype, device=args.device,
                      kv_cache_dtype=b.kv_cache_dtype, k_scale=args.k_scale, v_scale=args.v_scale,
                      tensor_parallel_size=args.tensor_parallel_size, **kw)


def _load_replicas(args, b: Backends):
    """The evaluated model: one replica, or ``--data-parallel-size`` of them (None on torchrun ranks other
    than 0: they served rank 0's replicas until it closed them)."""
    if (args.data_parallel_size or 1) == 1:
        return _load(args, b)
    return _load(args, b, data_parallel_size=args.data_parallel_size)


def _evaluate(args, data_files, b: Backends, label: str) -> tuple[dict, dict]:
    """Load the model with backends ``b``, run the task; return the run's report and each question's
    (prompt ids, output ids), keyed (task, doc_id), for teacher forcing."""
    import lm_eval

    from attnzoo.evals.lm import AttnzooLM
    from attnzoo.evals.report import build_run
    from attnzoo.evals.tasks import load_tasks

    from attnzoo.evals import perf

    t_load = time.perf_counter()
    llm = _load_replicas(args, b)
    if llm is None:
        return None, {}
    load_s = time.perf_counter() - t_load
    if llm.device.type == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats(llm.device)
    llm.engine.step_log = []  # one line per step: prefill and decode throughput apart
    lm = AttnzooLM(llm=llm, pretrained=args.model, wave_size=args.wave_size)
    # Fresh task objects per run: lm-eval stores each run's instances and responses on them.
    tm, loaded = load_tasks(args.task, data_files)
    gen_kwargs = {"max_gen_toks": args.max_new_tokens} if args.max_new_tokens else None
    t0 = time.perf_counter()
    results = lm_eval.simple_evaluate(
        model=lm, tasks=list(loaded["tasks"].values()), num_fewshot=args.num_fewshot, limit=args.limit,
        apply_chat_template=args.apply_chat_template, fewshot_as_multiturn=args.apply_chat_template,
        gen_kwargs=gen_kwargs, log_samples=True, task_manager=tm,
    )
    wall = time.perf_counter() - t0
    configs = results.get("configs", {})
    settings = {
        "task": args.task, "limit": args.limit,
        "num_fewshot": {t: c.get("num_fewshot") for t, c in configs.items()} if len(configs) > 1
        else next((c.get("num_fewshot") for c in configs.values()), args.num_fewshot),
        "apply_chat_template": args.apply_chat_template,
        "max_new_tokens": args.max_new_tokens or next(
            (c.get("generation_kwargs", {}).get("max_gen_toks") for c in configs.values()), None) or lm.max_gen_toks,
        "data_dir": str(Path(args.data_dir).resolve()) if args.data_dir else None,
        "backends_asked": b.describe(), "data_parallel_size": args.data_parallel_size or 1,
        "kv_cache_dtype": b.kv_cache_dtype, "k_scale": args.k_scale, "v_scale": args.v_scale,
        "policy_file": args.policy,
        "seeds": {k: results.get("config", {}).get(k) for k in ("random_seed", "numpy_seed", "torch_seed", "fewshot_seed")},
        "load_s": load_s,
    }
    info = llm.info()
    run = build_run(task_results=results["results"], samples=results.get("samples", {}), lm=lm, info=info,
                    decision=llm.decision, wall_s=wall, settings=settings, label=label)
    run["performance"] = perf.performance(lm.records, info, llm.engine.step_log, t0)
    run["provenance"] = {"attnzoo_git": perf.git_commit(),
                         "checkpoint": perf.checkpoint_identity(llm.source.directory, llm.source.gguf_file)}
    llm.engine.step_log = None
    if args.lm_eval_output:
        from attnzoo.evals.lm_eval_files import write_lm_eval_files

        run["lm_eval_files"] = write_lm_eval_files(args.lm_eval_output, results, label, llm)
    seqs = {(g.task_name, g.doc_id): (g.prompt_ids, g.output_ids) for g in lm.records}
    llm.close()  # tensor parallel from one process: the next run starts its own ranks
    del lm, llm
    _free_memory()
    return run, seqs


def _teacher_force(args, a: Backends, b: Backends, seqs_a: dict, prompts: dict, limit: int):
    """Teacher-force run A's outputs through A's and B's backends (both loaded at once: twice the weights'
    memory, a small KV cache each). Returns (ForcedResult or None, a note for the report)."""
    return teacher_force_many(args, a, [b], seqs_a, prompts, limit)[0]


def teacher_force_many(args, a: Backends, bs: list[Backends], seqs_a: dict, prompts: dict, limit: int,
                       on_wave=None) -> list[tuple]:
    """``_teacher_force`` for several B's at once: A and every B loaded together (a small KV cache each),
    stepped in lockstep, A's logits computed once for all. Returns (ForcedResult or None, note) per B;
    ``on_wave(pairs)`` gets the same after each wave of questions, with notes saying how far it is."""
    import torch

    from attnzoo.evals import tokens

    if limit == 0:
        return [(None, "off (--logit-compare-limit 0)")] * len(bs)
    keys = sorted(seqs_a, key=lambda k: (str(k[0]), k[1]))[:limit]
    seqs = [tokens.Sequence(key=k, prompt=prompts[k], output=seqs_a[k]) for k in keys if k in prompts]
    if not seqs:
        return [(None, "no token ids to replay")] * len(bs)
    dev = torch.device(args.device) if args.device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    longest = max(len(s.prompt) + len(s.output) for s in seqs)
    budget = max(_FORCED_KV_TOKENS[dev.type], longest)
    llm_a, llm_bs = None, []
    try:
        llm_a = _load(args, a, kv_cache_tokens=budget, cuda_graph=False)
        # Tensor parallel: B joins A's group (its ranks load B too), so one rank 0 steps both.
        for b in bs:
            llm_bs.append(_load(args, b, kv_cache_tokens=budget, cuda_graph=False))
    except AttnzooError as e:  # e.g. a saved report's backends that cannot run on this machine
        for llm in [llm_a, *llm_bs]:
            if llm is not None:
                llm.close()
        return [(None, f"skipped: run A's or B's backends cannot be loaded here ({e})")] * len(bs)
    t0 = time.perf_counter()

    def with_notes(results: list, final: bool) -> list[tuple]:
        secs = time.perf_counter() - t0
        if not final:
            return [(r, f"{len(r.per_question)} of {len(seqs)} questions so far ({secs:.1f} s; teacher forcing "
                        "still running)") for r in results]
        return [(r, f"{len(seqs)} of {len(seqs_a)} questions, {secs:.1f} s"
                    + ("" if len(seqs) == len(seqs_a) else " (--logit-compare-limit)")) for r in results]

    try:
        if llm_a.tp is not None:  # one B: its ranks follow A's rank 0 (tokens.teacher_forced_compare)
            results = [tokens.teacher_forced_compare(llm_a, llm_b, seqs, budget_tokens=budget) for llm_b in llm_bs]
        else:
            wave = None if on_wave is None else (lambda res: on_wave(with_notes(res, final=False)))
            results = tokens.teacher_forced_compare_many(llm_a, llm_bs, seqs, budget_tokens=budget, on_wave=wave)
    finally:
        for llm in [*llm_bs, llm_a]:
            llm.close()
    del llm_a, llm_bs
    _free_memory()
    return with_notes(results, final=True)


def _free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------ entry points


def run(args, write: bool = True, sequences: dict | None = None) -> dict:
    """Validate, evaluate, compare. Returns ``{"format", "run", ["run_b"], ["comparison"]}``.

    ``write=False`` leaves writing ``--output`` to the caller (``main`` prints the summary first).
    ``sequences``: filled with this run's (prompt ids, output ids) per (task, doc_id), for teacher forcing
    by the caller (``teacher_force_many``)."""
    from attnzoo.evals.report import REPORT_FORMAT, compare_runs
    from attnzoo.evals.saved import check_saved_matches, check_saved_tokens, load_saved
    from attnzoo.evals.tasks import check_data_dir, check_fewshot_pool, load_tasks, require_lm_eval
    from attnzoo.models import loader

    require_lm_eval()
    _check_numbers(args)
    out_path = check_output_path(args.output) if args.output else None
    if args.plot:
        check_output_path(args.plot, "--plot")
    compare_backend, saved_path = _compare_target(args.compare_to)
    saved = load_saved(saved_path) if saved_path else None

    mine = Backends(args.backend, args.prefill_backend, args.decode_backend, args.page_size, args.kv_cache_dtype)
    other_kv = args.compare_kv_cache_dtype or args.kv_cache_dtype
    if compare_backend:
        other = Backends(compare_backend, None, None, args.compare_page_size, other_kv)
    elif args.compare_kv_cache_dtype is not None and saved is None:
        other = Backends(args.backend, args.prefill_backend, args.decode_backend, args.page_size, other_kv)
    else:
        other = None
    src = loader.resolve_source(args.model)
    config = loader.load_config(src)
    if saved is not None:
        check_saved_tokens(saved, (getattr(config, "text_config", None) or config).vocab_size, str(saved_path))
    tp = _tensor_parallel_size(args)
    _check_context(args, config)
    _resolve_policy(config, src, args.device, args.dtype, args.policy, mine, tp)
    if other is not None:
        _resolve_policy(config, src, args.device, args.dtype, args.policy, other, tp)

    if args.apply_chat_template:
        tok = loader.load_tokenizer(src)
        if tok is None or getattr(tok, "chat_template", None) is None:
            raise EvalError(f"--apply-chat-template was given but {src.name} has no chat template",
                            fix="drop --apply-chat-template, or evaluate a checkpoint whose tokenizer has a chat template")
        try:  # a template that does not parse, or raises, would otherwise fail after the model loads
            tok.apply_chat_template([{"role": "user", "content": "1 + 1?"}], tokenize=False, add_generation_prompt=True)
        except Exception as e:  # jinja2's TemplateError family, or whatever the template's own code raises
            raise EvalError(f"the chat template of {src.name} fails on a one-message chat ({type(e).__name__}: {e})",
                            fix="repair chat_template in tokenizer_config.json, or drop --apply-chat-template") from None

    data_files = check_data_dir(args.task, args.data_dir) if args.data_dir else None
    # Reads the documents now, so an unknown task or an unreachable dataset fails before the model loads.
    _, loaded = load_tasks(args.task, data_files)
    check_fewshot_pool(data_files, loaded, args.num_fewshot)
    if saved is not None:
        check_saved_matches(saved, args, loaded, src)
    del loaded

    import torch

    on_gpu = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    limit = args.logit_compare_limit if args.logit_compare_limit is not None else (
        1 << 62 if on_gpu else CPU_LOGIT_COMPARE_LIMIT)
    report: dict[str, Any] = {"format": REPORT_FORMAT}
    report["run"], seqs = _evaluate(args, data_files, mine, label=mine.describe())
    if report["run"] is None:  # a torchrun rank other than 0 of a data-parallel run: rank 0 reports
        return report
    if sequences is not None:
        sequences.update(seqs)
    prompts = {k: p for k, (p, _) in seqs.items()}
    if other is not None:
        report["run_b"], _ = _evaluate(args, data_files, other, label=other.describe())
        forced, note = _teacher_force(args, mine, other, {k: o for k, (_, o) in seqs.items()}, prompts, limit)
        report["comparison"] = compare_runs(report["run"], report["run_b"], alpha=args.alpha, forced=forced, forced_note=note)
    elif saved is not None:
        # The saved run is A, the reference: this run (B) is teacher-forced on its tokens.
        forced, note = None, "skipped: the saved report has no generated token ids (saved before they were recorded)"
        saved_seqs = _saved_outputs(saved)
        if saved_seqs:
            forced, note = _teacher_force(args, _saved_backends(saved), mine, saved_seqs, prompts, limit)
        report["comparison"] = compare_runs(saved, report["run"], alpha=args.alpha, forced=forced, forced_note=note)
        report["comparison"]["a"]["label"] = f"saved report {saved_path.resolve()} ({saved.get('label')})"
        report["comparison"]["a"]["path"] = str(saved_path.resolve())
        report["comparison"]["a"]["kv_cache_dtype"] = (saved.get("settings") or {}).get("kv_cache_dtype")
    if args.plot and "comparison" in report:
        from attnzoo.evals.report import write_chart

        why_not = write_chart(report, args.plot)
        report["chart"] = args.plot if why_not is None else f"not written: {why_not}"
    if out_path is not None and write and _rank() == 0:
        write_report(out_path, report)
    return report


def write_report(path: Path, report: dict) -> None:
    """Write the report atomically: a temporary file in the same folder, renamed over ``path``, so a
    failed write (full disk, folder removed mid-run) never leaves truncated JSON or destroys a previous
    report. If it fails, the report is saved in the system temporary folder and the error names it."""
    text = json.dumps(report, indent=1, default=str)  # anything unserialisable fails before the disk is touched
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o644)  # mkstemp makes it 0600
        os.replace(tmp, path)
    except KeyboardInterrupt:  # no half-written temporary file left beside the report
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise
    except OSError as e:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        kept = "the previous report there is unchanged; " if path.exists() else ""
        try:
            fd, rescue = tempfile.mkstemp(prefix="run_eval-report-", suffix=".json")
            with os.fdopen(fd, "w") as fh:
                fh.write(text)
        except OSError:
            raise EvalError(f"cannot write the report to {path} ({e.strerror or e}); {kept}it could not be saved anywhere",
                            fix="free disk space or pick another --output, and run again") from None
        raise EvalError(f"cannot write the report to {path} ({e.strerror or e}); {kept}the report was saved to {rescue}",
                        fix=f"free space or recreate the folder, then move {rescue} to {path}") from None


def _check_context(args, config) -> None:
    text_config = getattr(config, "text_config", None) or config
    context = int(getattr(text_config, "max_position_embeddings", 4096))  # load_model's default too
    if args.max_new_tokens is not None and args.max_new_tokens >= context:
        raise EvalError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the model's "
                        f"context of {context} tokens", fix=f"pass --max-new-tokens well below {context}")


def _saved_outputs(saved: dict) -> dict:
    return {(task, r["doc_id"]): r["output_token_ids"] for task, t in saved["tasks"].items()
            for r in t["per_question"] if r.get("output_token_ids") is not None}


def _saved_backends(saved: dict) -> Backends:
    d, s = saved["decision"], saved.get("settings", {})
    return Backends(None, d["prefill_backend"], d["decode_backend"], d["page_size"], s.get("kv_cache_dtype", "auto"))


def _rank() -> int:
    """torchrun rank (0 outside torchrun): only rank 0 writes and prints the report."""
    from attnzoo.engine.tensor_parallel import torchrun_world

    world = torchrun_world()
    return world[0] if world else 0


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback through lm-eval and torch
        print("\nrun_eval: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    from attnzoo.evals.report import render

    args = build_parser().parse_args(argv)
    setup_logging(logging.WARNING)
    log.setLevel(logging.INFO)
    try:
        report = run(args, write=False)
    except AttnzooError as e:
        print(f"run_eval: error: {e}", file=sys.stderr)
        return 2
    if _rank() != 0:
        return 0
    print(render(report, per_question_rows=args.per_question), flush=True)  # before the write, which can fail
    if args.output:
        try:
            write_report(Path(args.output).expanduser(), report)
        except AttnzooError as e:
            print(f"run_eval: error: {e}", file=sys.stderr)
            return 2
        print(f"\nreport written to {args.output}")
    if report.get("chart"):
        print(f"chart: {report['chart']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
