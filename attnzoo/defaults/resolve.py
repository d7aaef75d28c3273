"""resolve(): which backend runs prefill, which runs decode, and the KV page size, with the reasons.

Precedence, most specific first, field by field (prefill backend, decode backend, page size):
keyword overrides > user policy file (``Overrides.policy_file`` or ``$ATTNZOO_POLICY``) > the shipped
per-architecture entry > the shipped family default. Within a file a model-id pattern beats an
architecture entry, which beats the family default; a GPU row beats the entry's all-GPU fields.

Explicit choices (keywords and user policy files) are checked and, if they cannot run, raise an
error naming the violated constraint and the valid choices: they are never replaced. Only the
automatic policy (the shipped table) adjusts, by walking its family's ``fallback`` list or by moving
the page size to one the chosen backends accept, and every adjustment is recorded in the Decision.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnzoo.attention.backends import all_capabilities, backend_names
from attnzoo.attention.backends.capabilities import (
    GPU_CLASSES,
    GPUS,
    PHASES,
    BackendCapabilities,
    Check,
    check_backend,
)
from attnzoo.attention.kv_cache import KV_CACHE_DTYPES, MAX_PAGE_SIZE
from attnzoo.attention.kv_layout import KVLayout
from attnzoo.defaults.profile import ModelProfile, architecture_of, profile_from_config, profile_from_table
from attnzoo.defaults.table import SHIPPED_POLICY, UNMEASURED, Match, PolicyTable, load_table
from attnzoo.errors import BackendError, PolicyError

POLICY_ENV = "ATTNZOO_POLICY"
_FIELDS = ("prefill_backend", "decode_backend", "page_size")
_ROW_FIELD = {"prefill_backend": "prefill", "decode_backend": "decode", "page_size": "page_size"}
_EXPLICIT = ("override", "user_policy")


@dataclass
class Overrides:
    """What the caller chose explicitly. ``backend`` sets both phases; a phase-specific one wins over it."""

    backend: str | None = None
    prefill_backend: str | None = None
    decode_backend: str | None = None
    page_size: int | None = None
    policy_file: str | os.PathLike | None = None
    # The dtype the model will run in ("bfloat16", torch.bfloat16, ...); checked against each backend's
    # dtypes. None: not checked (the config's dtype is only what the checkpoint was saved in).
    dtype: Any = None
    # Python packages to treat as installed ("flashinfer", "triton"): answers what would run on a machine
    # that has them (`policy explain --assume-installed`). The Decision is then labelled hypothetical.
    assume_installed: tuple[str, ...] = ()
    # What the KV pool stores: "auto" (the model dtype) or "fp8_e4m3"; every chosen backend must read it.
    kv_cache_dtype: str = "auto"


@dataclass
class Source:
    """Where one decided value came from."""

    level: str  # "override" | "user_policy" | "shipped_model" | "shipped_arch" | "family_default" | "fallback"
    detail: str  # human-readable origin
    file: str | None = None
    where: str | None = None  # dotted key path of the row in that file
    line: int | None = None
    pattern: str | None = None  # the model-id glob that matched
    reason: str | None = None  # the row's own `reason`
    measured_in: str | None = None

    @property
    def explicit(self) -> bool:
        return self.level in _EXPLICIT

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass
class Candidate:
    name: str
    phase: str
    accepted: bool
    reasons: list[str]
    chosen: bool = False
    kernel: str | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = {"name": self.name, "phase": self.phase, "accepted": self.accepted, "chosen": self.chosen,
             "reasons": list(self.reasons)}
        if self.kernel:
            d["kernel"] = self.kernel
        if self.notes:
            d["notes"] = list(self.notes)
        return d


@dataclass
class Decision:
    prefill_backend: str
    decode_backend: str
    page_size: int
    gpu: str  # the GPU class whose rows and capabilities applied ("cpu", "sm90", ...)
    architecture: str
    sources: dict[str, Source]  # keys: prefill_backend, decode_backend, page_size
    candidates: list[Candidate]
    adjustments: list[str]
    planned: str | None
    profile: ModelProfile
    model_id: str | None = None
    device_gpu: str | None = None  # what was detected or given, before mapping to a class
    kernels: dict[str, str] = field(default_factory=dict)  # phase -> kernel that runs it
    notes: list[str] = field(default_factory=list)
    policy_files: list[str] = field(default_factory=list)
    # Weight format and linear-layer GEMM path, filled in by load_model once the weights are planned.
    weights: dict[str, str] = field(default_factory=dict)
    # The field's choice for this cell (SGLang, vLLM), whether the table row agrees, and what justifies
    # a difference (a measurement file, or "unmeasured"); see field_summary().
    field_choice: dict[str, Any] | None = None
    # Packages assumed installed (`policy explain --assume-installed`): the answer is hypothetical.
    assumed_installed: list[str] = field(default_factory=list)
    kv_cache_dtype: str = "auto"
    kv_bytes_per_token: int | None = None  # set by load_model once the model's KV specs are known

    def to_dict(self) -> dict[str, Any]:
        return {
            "architecture": self.architecture,
            "model_id": self.model_id,
            "gpu": self.gpu,
            "device_gpu": self.device_gpu,
            "prefill_backend": self.prefill_backend,
            "decode_backend": self.decode_backend,
            "page_size": self.page_size,
            "sources": {k: s.to_dict() for k, s in self.sources.items()},
            "kernels": dict(self.kernels),
            "adjustments": list(self.adjustments),
            "notes": list(self.notes),
            "planned": self.planned,
            "kv_cache_dtype": self.kv_cache_dtype,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "profile": self.profile.to_dict(),
            "policy_files": list(self.policy_files),
            "weights": dict(self.weights),
            "field": self.field_choice,
            "hypothetical": {"assumed_installed": list(self.assumed_installed),
                             "note": "packages assumed installed, not checked on this machine"}
            if self.assumed_installed else None,
            "candidates": [c.to_dict() for c in self.candidates],
        }

    def explain(self) -> str:
        s = self.sources
        where = f" ({self.model_id})" if self.model_id and self.model_id != self.architecture else ""
        gpu = self.gpu if self.device_gpu in (None, self.gpu) else f"{self.gpu} (device {self.device_gpu})"
        out = [
            f"{self.architecture}{where} on {gpu}: prefill {self.prefill_backend}, decode {self.decode_backend}, "
            f"page size {self.page_size}",
            f"  model: {self.profile.describe()}",
        ]
        if self.assumed_installed:
            out.insert(0, f"HYPOTHETICAL: assumes {', '.join(self.assumed_installed)} installed "
                          f"(not checked on this machine); what would run there:")
        shown: set[str] = set()
        for key, label in (("prefill_backend", "prefill backend"), ("decode_backend", "decode backend"),
                           ("page_size", "page size")):
            value = getattr(self, key)
            out.append(f"  {label + ':':17}{value!s:<8} from {s[key].detail}")
            # One row usually sets all three values: say its reason once.
            for what, text in (("reason", s[key].reason), ("measured in", s[key].measured_in)):
                if text and (what, text) not in shown:
                    shown.add((what, text))
                    out.append(f"  {'':26}{what}: {text}")
        kv = f"  KV cache: {self.kv_cache_dtype}"
        if self.kv_bytes_per_token is not None:
            kv += f", {self.kv_bytes_per_token} bytes per token"
        out.append(kv)
        for phase in PHASES:
            if phase in self.kernels:
                out.append(f"  {phase} kernel: {self.kernels[phase]}")
        for key, text in self.weights.items():
            out.append(f"  weights {key.replace('_', ' ')}: {text}")
        f = self.field_choice
        if f:
            out.append(f"  field: SGLang {f['sglang']}; vLLM {f['vllm']}" + (f" (read: {f['read']})" if f.get("read") else ""))
            if f["agrees"]:
                out.append("  attnzoo's table row agrees with the field")
            else:
                why = f["justified_by"]
                out.append("  attnzoo's table row differs from the field: "
                           + ("unmeasured" if why == UNMEASURED else f"measured in {why}"))
            if f.get("note"):
                out.append(f"  field note: {f['note']}")
        if self.planned:
            out.append(f"  planned: {self.planned}")
        if self.adjustments:
            out.append("  adjustments made by the automatic policy:")
            out += [f"    - {a}" for a in self.adjustments]
        if self.notes:
            out.append("  notes:")
            out += [f"    - {n}" for n in self.notes]
        for phase in PHASES:
            out.append(f"  {phase} candidates:")
            for c in (c for c in self.candidates if c.phase == phase):
                mark = "*" if c.chosen else ("+" if c.accepted else "-")
                verdict = "chosen" if c.chosen else ("accepted" if c.accepted else "rejected")
                out.append(f"    {mark} {c.name:15} {verdict}: {'; '.join(c.reasons)}")
                out += [f"    {'':17} note: {n}" for n in c.notes]
        return "\n".join(out)


# --------------------------------------------------------------------------------------------- GPUs

def detect_gpu(device=None) -> str:
    """"cpu", or the CUDA compute capability of ``device`` (default: the current one) as "smXY"."""
    import torch

    if device is not None and torch.device(device).type != "cuda":
        return "cpu"
    if not torch.cuda.is_available():
        return "cpu"
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


def gpu_class(gpu: str) -> str:
    """Map a GPU name ("sm90", "sm_86", "SM100", "cpu") to the class the table has rows for."""
    g = str(gpu).strip().lower().replace("_", "")
    if g in GPUS:
        return g
    m = re.fullmatch(r"sm(\d+)(\d)", g)
    if m and (int(m.group(1)), int(m.group(2))) in GPU_CLASSES:
        return GPU_CLASSES[(int(m.group(1)), int(m.group(2)))]
    raise PolicyError(
        f"GPU {gpu!r} is not one the policy knows",
        fix=f"pass one of: {', '.join(GPUS)} (sm86/sm87 count as sm80, sm121 as sm120)",
    )


def _dtype_name(dtype) -> str | None:
    if dtype is None:
        return None
    name = str(dtype).replace("torch.", "")
    return {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32", "fp32": "float32"}.get(name, name)


# ---------------------------------------------------------------------------------------- resolve


def resolve(
    model,
    gpu: str | None = None,
    overrides: Overrides | None = None,
    model_id: str | None = None,
    *,
    table: str | Path | None = None,
) -> Decision:
    """Decide the prefill backend, decode backend and page size for ``model`` on ``gpu``.

    ``model``: an HF config (object or config.json dict), a ``ModelProfile``, or an architecture name.
    ``gpu``: "cpu", "sm80", ..., or None to detect the current device. ``model_id`` (hub id or path)
    is matched against the model-id patterns of policy files. ``table`` replaces the shipped table
    (for tests of the table machinery).
    """
    ov = overrides or Overrides()
    shipped = load_table(table or SHIPPED_POLICY, shipped=True)
    profile = _profile(model, shipped)
    device_gpu = detect_gpu() if gpu is None else str(gpu)
    cls = gpu_class(device_gpu)
    adjustments: list[str] = []
    notes: list[str] = []
    if cls != device_gpu.strip().lower().replace("_", ""):
        notes.append(f"GPU {device_gpu} uses the {cls} rows and capabilities")

    policy_path, policy_note = _user_policy_path(ov)
    user = load_table(policy_path) if policy_path else None
    if policy_note:
        notes.append(policy_note)

    arch, fam = profile.architecture, profile.family
    matches: list[tuple[PolicyTable, bool, Match]] = []
    if user is not None:
        matches += [(user, True, m) for m in user.lookup(arch, fam, cls, model_id)]
    matches += [(shipped, False, m) for m in shipped.lookup(arch, fam, cls, model_id)]

    values: dict[str, Any] = {}
    sources: dict[str, Source] = {}
    kw = {
        "prefill_backend": (ov.prefill_backend, "prefill_backend") if ov.prefill_backend else (ov.backend, "backend"),
        "decode_backend": (ov.decode_backend, "decode_backend") if ov.decode_backend else (ov.backend, "backend"),
        "page_size": (ov.page_size, "page_size"),
    }
    for key in _FIELDS:
        value, kwname = kw[key]
        if value is not None:
            values[key] = value
            sources[key] = Source("override", f"keyword {kwname}={value!r}")
        else:
            values[key], sources[key] = _walk(matches, key, arch, fam, cls, shipped)
    planned = next((m.row.planned for _, _, m in matches if m.row.planned), None)
    field_choice = field_summary(matches)

    _check_page_size_value(values["page_size"], sources["page_size"])
    if ov.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise PolicyError(f"unknown kv_cache_dtype {ov.kv_cache_dtype!r}", fix=f"use one of: {', '.join(KV_CACHE_DTYPES)}")
    if ov.kv_cache_dtype != "auto" and profile.kind != "mha":
        raise PolicyError(
            f"kv_cache_dtype={ov.kv_cache_dtype!r} is for MHA/GQA models; {arch} is {profile.kind.upper()}, whose "
            "caches keep their explicit layouts",
            fix="use kv_cache_dtype='auto' (MLA/NSA fp8 caches are backend layouts: e.g. backend nsa_triton_fp8)",
        )
    capabilities = all_capabilities()
    dtype = _dtype_name(ov.dtype)
    assume = frozenset(ov.assume_installed)
    fallback = shipped.families[fam].fallback
    explicit_page = values["page_size"] if sources["page_size"].explicit else None

    def check(name: str, phase: str, page_bound: bool = True) -> Check:
        return check_choice(name, phase, profile, gpu=cls, capabilities=capabilities, dtype=dtype,
                            kv_cache_dtype=ov.kv_cache_dtype, assume_installed=assume,
                            page_size=explicit_page if page_bound else None)

    checks: dict[str, Check] = {}
    first_choice: dict[str, str] = {}
    for phase in PHASES:
        key = f"{phase}_backend"
        name, src = values[key], sources[key]
        first_choice[phase] = name
        # An explicit backend with an explicit page size it cannot take is a conflict between two
        # explicit choices: _settle_page_size reports it naming both.
        chk = check(name, phase, page_bound=not src.explicit)
        if chk.ok:
            checks[phase] = chk
            continue
        if src.explicit:
            raise _explicit_backend_error(name, phase, src, chk, profile, cls, check, capabilities)
        for alt in fallback:
            alt_chk = check(alt, phase)
            if alt_chk.ok:
                adjustments.append(
                    f"{phase}: {name} (from {src.detail}) cannot run this model here ({'; '.join(chk.violations)}); "
                    f"using {alt}, the first runnable backend in family.{fam}.fallback"
                )
                values[key] = alt
                sources[key] = Source("fallback", f"family.{fam}.fallback in {shipped.path}, after {name} was rejected",
                                      file=str(shipped.path), where=f"family.{fam}.fallback",
                                      reason=f"{name} cannot run this model here")
                checks[phase] = alt_chk
                break
        else:
            raise BackendError(
                f"no backend in the policy can run {phase} for {arch} on {cls}: {name} (from {src.detail}): "
                f"{'; '.join(chk.violations)}",
                fix=_valid_fix(phase, profile, cls, check, capabilities),
            )

    page, page_adj = _settle_page_size(values, sources, cls, capabilities)
    if page_adj:
        adjustments.append(page_adj)
        sources["page_size"] = Source("fallback", f"adjusted from {sources['page_size'].detail}",
                                      reason=page_adj)

    pre_caps, dec_caps = capabilities[values["prefill_backend"]], capabilities[values["decode_backend"]]
    kernels: dict[str, str] = {}
    for phase in PHASES:
        k = checks[phase].kernel
        if k is not None:
            kernels[phase] = k.name + (f" (the {k.runs_as} backend's kernel: {k.note})" if k.runs_as else "")
            if k.requires_env:
                notes.append(f"{phase}: {k.note}")
    for caps in {pre_caps.name: pre_caps, dec_caps.name: dec_caps}.values():
        m = caps.block_table_columns_multiple(page)
        if m > 1:  # the backend pads its own tables: said here, read by no one at run time
            notes.append(f"{caps.name}: block tables padded to a multiple of {m} columns "
                         f"({caps.block_table_pad_tokens}/page_size)")
    notes += kv_layout_notes(pre_caps, dec_caps, profile.kind)
    if profile.source != "config":
        notes.append(f"model profile {profile.source}; pass the model's config for an exact check")
    if dtype is None:
        notes.append("run dtype not given: backend dtypes not checked")

    candidates = _candidates(values, first_choice, fallback, page, check, cls, capabilities)
    return Decision(
        prefill_backend=values["prefill_backend"], decode_backend=values["decode_backend"], page_size=page,
        gpu=cls, architecture=arch, sources=sources, candidates=candidates, adjustments=adjustments,
        planned=planned, profile=profile, model_id=model_id, device_gpu=device_gpu, kernels=kernels, notes=notes,
        kv_cache_dtype=ov.kv_cache_dtype,
        policy_files=[str(p) for p in (shipped.path, user.path if user else None) if p],
        field_choice=field_choice, assumed_installed=sorted(assume),
    )


def check_choice(name: str, phase: str, profile: ModelProfile, *, gpu: str,
                 capabilities: dict[str, BackendCapabilities], dtype: str | None = None,
                 kv_cache_dtype: str = "auto", assume_installed: frozenset[str] = frozenset(),
                 page_size: int | None = None) -> Check:
    """The policy's view of backend ``name`` for ``phase`` of ``profile`` on ``gpu``: its declaration's
    ``check`` (the one the backend runs on its own layers), its package, and the page size if given."""
    caps = capabilities.get(name)
    if caps is None:
        return Check(name, phase, violations=[f"unknown backend (registered: {', '.join(capabilities)})"])
    chk = check_backend(caps, phase, profile, gpu=gpu, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                        assume_installed=assume_installed)
    if page_size is not None and not caps.page_size_ok(page_size, gpu):
        chk.violations.append(f"page size {page_size} unsupported (supports {caps.page_sizes_text(gpu)})")
    return chk


def field_summary(matches) -> dict[str, Any] | None:
    """The most specific row's `field`, with whether it differs and what justifies a difference."""
    f = next((m.row.field for _, _, m in matches if m.row.field), None)
    if f is None:
        return None
    measured = next((m.row.measured_in for _, _, m in matches if m.row.measured_in), None)
    out = dict(f, differs=not f["agrees"])
    if not f["agrees"]:
        out["justified_by"] = measured or UNMEASURED
    return out


def _walk(matches, key: str, arch: str, fam: str, gpu: str, shipped: PolicyTable) -> tuple[Any, Source]:
    """The value of one field from the most specific row that sets it."""
    for tbl, is_user, m in matches:
        v = m.row.get(_ROW_FIELD[key])
        if v is not None:
            return v, _row_source(tbl, is_user, m)
    raise PolicyError(
        f"the policy table has no {_ROW_FIELD[key]} value for {arch} on {gpu}",
        fix=f"add it to [family.{fam}.gpu.{gpu}] in {shipped.path}",
    )


def table_cells(gpu: str | None = None, policy_file: str | os.PathLike | None = None, *,
                table: str | Path | None = None) -> list[dict[str, Any]]:
    """Every (architecture, GPU) cell of the table as written, merged by precedence; no capability checks.

    ``policy_file`` (or $ATTNZOO_POLICY) is merged over the shipped table, as resolve() would.
    """
    shipped = load_table(table or SHIPPED_POLICY, shipped=True)
    path, _ = _user_policy_path(Overrides(policy_file=policy_file))
    user = load_table(path) if path else None
    gpus = [gpu_class(gpu)] if gpu else list(GPUS)
    cells = []
    for fam in shipped.families.values():
        for arch in fam.archs:
            for g in gpus:
                matches = [(user, True, m) for m in user.lookup(arch, fam.name, g, None)] if user else []
                matches += [(shipped, False, m) for m in shipped.lookup(arch, fam.name, g, None)]
                cell: dict[str, Any] = {"family": fam.name, "architecture": arch, "gpu": g}
                for key in _FIELDS:
                    value, src = _walk(matches, key, arch, fam.name, g, shipped)
                    cell[key] = value
                    cell[f"{key}_from"] = src.detail
                cell["reason"] = next((m.row.reason for _, _, m in matches if m.row.reason), None)
                cell["planned"] = next((m.row.planned for _, _, m in matches if m.row.planned), None)
                cell["measured_in"] = next((m.row.measured_in for _, _, m in matches if m.row.measured_in), None)
                cell["field"] = field_summary(matches)
                cells.append(cell)
    return cells


def model_patterns(gpu: str | None = None, policy_file: str | os.PathLike | None = None, *,
                   table: str | Path | None = None) -> list[dict[str, Any]]:
    """The model-id pattern rows of the shipped table and the user policy file ("*" = all GPUs)."""
    path, _ = _user_policy_path(Overrides(policy_file=policy_file))
    tables = [load_table(table or SHIPPED_POLICY, shipped=True)] + ([load_table(path)] if path else [])
    want = gpu_class(gpu) if gpu else None
    out = []
    for tbl in tables:
        for pattern, entry in tbl.models.items():
            for g, row in [("*", entry.all_gpus), *entry.gpus.items()]:
                if (want and g not in ("*", want)) or (row.prefill, row.decode, row.page_size) == (None,) * 3:
                    continue
                out.append({"pattern": pattern, "gpu": g, "prefill": row.prefill, "decode": row.decode,
                            "page_size": row.page_size, "reason": row.reason, "file": str(tbl.path),
                            "line": row.line})
    return out


def _profile(model, shipped: PolicyTable) -> ModelProfile:
    if isinstance(model, ModelProfile):
        if shipped.family_of(model.architecture) is None:
            raise _unknown_arch(model.architecture, shipped)
        return model
    if isinstance(model, str):
        fam = shipped.family_of(model)
        if fam is None:
            raise _unknown_arch(model, shipped)
        return profile_from_table(model, fam, shipped.profile_for(model))
    arch = architecture_of(model)
    fam = shipped.family_of(arch) if arch else None
    if arch and fam is None:
        raise _unknown_arch(arch, shipped)
    return profile_from_config(model, architecture=arch, family=fam)


def _unknown_arch(arch: str, shipped: PolicyTable) -> PolicyError:
    return PolicyError(
        f"architecture {arch!r} is not in the policy table {shipped.path}",
        fix=f"use one of: {', '.join(shipped.architectures())}",
    )


def _user_policy_path(ov: Overrides) -> tuple[Path | None, str | None]:
    if ov.policy_file:
        env = os.environ.get(POLICY_ENV)
        note = f"${POLICY_ENV}={env} ignored: policy_file/--policy given" if env else None
        return Path(ov.policy_file), note
    env = os.environ.get(POLICY_ENV)
    if env:
        return Path(env), f"user policy file from ${POLICY_ENV}"
    return None, None


def _row_source(tbl: PolicyTable, is_user: bool, m: Match) -> Source:
    loc = f"{m.row.where} (line {m.row.line})" if m.row.line else m.row.where
    if is_user:
        level = "user_policy"
        what = {"model": f"model pattern {m.pattern!r}", "arch": "architecture entry", "family": "family entry"}[m.level]
        detail = f"user policy file {tbl.path}: {what}, {loc}"
    else:
        level = {"model": "shipped_model", "arch": "shipped_arch", "family": "family_default"}[m.level]
        what = {"model": f"model pattern {m.pattern!r}", "arch": "architecture entry", "family": "family default"}[m.level]
        detail = f"shipped policy: {what}, {loc}"
    return Source(level, detail, file=str(tbl.path), where=m.row.where, line=m.row.line, pattern=m.pattern,
                  reason=m.row.reason, measured_in=m.row.measured_in)


def _check_page_size_value(page, src: Source) -> None:
    if isinstance(page, bool) or not isinstance(page, int) or not 1 <= page <= MAX_PAGE_SIZE:
        raise PolicyError(f"page size {page!r} (from {src.detail}) is not an integer in 1..{MAX_PAGE_SIZE}",
                          fix="pass e.g. page_size=16")


def _settle_page_size(values: dict[str, Any], sources: dict[str, Source], gpu: str,
                      capabilities: dict[str, BackendCapabilities]) -> tuple[int, str | None]:
    page, src = values["page_size"], sources["page_size"]
    allowed = set(range(1, MAX_PAGE_SIZE + 1))
    needs = []
    for phase in PHASES:
        caps = capabilities[values[f"{phase}_backend"]]
        sizes = caps.page_sizes_on(gpu)
        if sizes is not None:
            allowed &= sizes
            needs.append(f"{phase} backend {caps.name} needs {caps.page_sizes_text(gpu)}")
    if page in allowed:
        return page, None
    if not allowed:
        raise PolicyError(
            f"no page size satisfies both backends: {'; '.join(needs)}",
            fix="choose prefill and decode backends whose page sizes overlap",
        )
    if src.explicit:
        raise PolicyError(
            f"page size {page} (from {src.detail}) is not supported: {'; '.join(needs)}",
            fix=f"use a page size in {{{', '.join(map(str, sorted(allowed)))}}}, or other backends",
        )
    above = [p for p in sorted(allowed) if p >= page]
    new = above[0] if above else max(allowed)
    verb = "raised" if new > page else "lowered"
    return new, f"page size {verb} from {page} ({src.detail}) to {new}: {'; '.join(needs)}"


def _valid_fix(phase: str, profile: ModelProfile, gpu: str, check, capabilities) -> str:
    valid = [n for n in capabilities if check(n, phase).ok]
    if valid:
        return f"valid {phase} backends for {profile.architecture} on {gpu} in this build: {', '.join(valid)}"
    return f"no registered backend can run {phase} for {profile.architecture} on {gpu}; use gpu='cpu' with the torch backend"


def _explicit_backend_error(name, phase, src: Source, chk: Check, profile, gpu, check, capabilities) -> BackendError:
    if name not in capabilities:
        return BackendError(
            f"unknown attention backend {name!r} (from {src.detail})",
            fix=f"choose one of the registered backends: {', '.join(backend_names())}",
        )
    what = f"{phase} backend {name!r} (from {src.detail}) cannot run {profile.architecture} on {gpu}"
    return BackendError(f"{what}: {'; '.join(chk.violations)}", fix=_valid_fix(phase, profile, gpu, check, capabilities))


def _candidates(values, first_choice, fallback, page: int, check, gpu: str, capabilities) -> list[Candidate]:
    out: list[Candidate] = []
    for phase in PHASES:
        chosen = values[f"{phase}_backend"]
        order = [chosen, first_choice[phase], *fallback, *capabilities]
        seen: set[str] = set()
        for name in order:
            if name in seen:
                continue
            seen.add(name)
            chk = check(name, phase)
            caps = capabilities.get(name)
            notes = []
            if caps is not None and not caps.page_size_ok(page, gpu):
                notes.append(f"needs page size {caps.page_sizes_text(gpu)}; this decision uses {page}")
            if chk.kernel is not None and chk.kernel.runs_as:
                notes.append(f"{phase} runs the {chk.kernel.runs_as} backend's kernel here ({chk.kernel.note})")
            out.append(Candidate(name, phase, chk.ok, chk.reasons, chosen=name == chosen,
                                 kernel=chk.kernel.name if chk.kernel else None, notes=notes))
    return out


POOL_MLA_LAYOUT = KVLayout.BF16.value  # what KVPool holds for MLA/NSA layers: model-dtype [latent | rope] entries


def kv_layout_notes(prefill: BackendCapabilities, decode: BackendCapabilities, kind: str) -> list[str]:
    """What the Decision says about KV layouts: a mismatch between the phases, and every conversion."""
    pre, dec = prefill.layout_for(kind), decode.layout_for(kind)
    notes = []
    if pre != dec:
        notes.append(f"prefill ({prefill.name}) reads KV layout {pre} and decode ({decode.name}) reads {dec}: "
                     "the cache is converted between them")
    if kind == "mha":
        return notes
    phases = {"prefill and decode": prefill} if prefill.name == decode.name else {"prefill": prefill, "decode": decode}
    for phase, caps in phases.items():
        if caps.mla_kv_layout != POOL_MLA_LAYOUT:
            notes.append(
                f"{phase} backend {caps.name} reads KV layout {caps.mla_kv_layout}: the pool keeps "
                f"{POOL_MLA_LAYOUT} (model dtype) entries and a Triton kernel (attnzoo/attention/kernels/kv_layout.py) "
                f"converts each token once, when its layer stores it, into {caps.name}'s {caps.mla_kv_layout} copy"
            )
    return notes
