"""resolve(): the prefill backend, decode backend and KV page size, with the reasons. Most specific first,
field by field: keywords > user policy file > shipped architecture entry > shipped family default (an
unlisted architecture takes its attention kind's family). Explicit choices that cannot run raise; only
the automatic policy adjusts (the family's ``fallback``, the page size), each adjustment recorded."""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

from attnzoo.attention.backends import all_capabilities, backend_names
from attnzoo.attention.backends.base import detect_gpu, gpu_class
from attnzoo.attention.backends.capabilities import GPUS, PHASES, Check, check_backend
from attnzoo.attention.kv_cache import KV_CACHE_DTYPES, MAX_PAGE_SIZE
from attnzoo.attention.kv_layout import layout_notes
from attnzoo.errors import BackendError, PolicyError
from attnzoo.policy.profile import ModelProfile, dtype_name, profile_from_config
from attnzoo.policy.table import SHIPPED_POLICY, UNMEASURED, PolicyTable, load_table

POLICY_ENV = "ATTNZOO_POLICY"
FIELDS = ("prefill_backend", "decode_backend", "page_size")
_ROW_FIELD = dict(zip(FIELDS, ("prefill", "decode", "page_size")))
_LEVELS = {"model": ("shipped_model", "model pattern {!r}"), "arch": ("shipped_arch", "architecture entry"),
           "family": ("family_default", "family default")}


@dataclass
class Overrides:
    """What the caller chose explicitly. ``backend`` sets both phases; a phase-specific one wins over it."""

    backend: str | None = None
    prefill_backend: str | None = None
    decode_backend: str | None = None
    page_size: int | None = None
    policy_file: str | os.PathLike | None = None
    dtype: Any = None  # the dtype the model will run in, checked against each backend's dtypes (None: not checked)
    assume_installed: tuple[str, ...] = ()  # packages taken as installed: what would run on a machine with them
    kv_cache_dtype: str = "auto"  # "auto" (the model dtype) or "fp8_e4m3"; every chosen backend must read it


@dataclass
class Source:  # where one decided value came from
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
        return self.level in ("override", "user_policy")

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass
class Candidate:
    name: str
    phase: str
    accepted: bool
    chosen: bool = False
    reasons: list[str] = field(default_factory=list)
    kernel: str | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None and v != []}


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
    weights: dict[str, str] = field(default_factory=dict)  # weight format and GEMM path, set by load_model
    field_choice: dict[str, Any] | None = None  # the field's choice for this cell: field_summary()
    assumed_installed: list[str] = field(default_factory=list)  # packages assumed: the answer is hypothetical
    kv_cache_dtype: str = "auto"
    kv_bytes_per_token: int | None = None  # set by load_model once the model's KV specs are known

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in ("architecture", "model_id", "gpu", "device_gpu", *FIELDS)}
        return {**d, "sources": {k: s.to_dict() for k, s in self.sources.items()}, "kernels": dict(self.kernels),
                "adjustments": list(self.adjustments), "notes": list(self.notes), "planned": self.planned,
                "kv_cache_dtype": self.kv_cache_dtype, "kv_bytes_per_token": self.kv_bytes_per_token,
                "profile": self.profile.to_dict(), "policy_files": list(self.policy_files),
                "weights": dict(self.weights), "field": self.field_choice,
                "hypothetical": {"assumed_installed": list(self.assumed_installed),
                                 "note": "packages assumed installed, not checked on this machine"}
                if self.assumed_installed else None,
                "candidates": [c.to_dict() for c in self.candidates]}

    def explain(self) -> str:
        where = f" ({self.model_id})" if self.model_id and self.model_id != self.architecture else ""
        gpu = self.gpu if self.device_gpu in (None, self.gpu) else f"{self.gpu} (device {self.device_gpu})"
        out = [f"HYPOTHETICAL: assumes {', '.join(self.assumed_installed)} installed (not checked on this machine); "
               "what would run there:"] if self.assumed_installed else []
        out += [f"{self.architecture}{where} on {gpu}: prefill {self.prefill_backend}, decode {self.decode_backend}, "
                f"page size {self.page_size}", f"  model: {self.profile.describe()}"]
        shown: set = set()
        for key in FIELDS:
            s = self.sources[key]
            out.append(f"  {key.replace('_backend', ' backend').replace('_', ' ') + ':':17}{getattr(self, key)!s:<8} "
                       f"from {s.detail}")
            for what, text in (("reason", s.reason), ("measured in", s.measured_in)):  # one row: said once
                if text and (what, text) not in shown:
                    shown.add((what, text))
                    out.append(f"  {'':26}{what}: {text}")
        out.append(f"  KV cache: {self.kv_cache_dtype}" + (f", {self.kv_bytes_per_token} bytes per token"
                                                            if self.kv_bytes_per_token is not None else ""))
        out += [f"  {p} kernel: {self.kernels[p]}" for p in PHASES if p in self.kernels]
        out += [f"  weights {k.replace('_', ' ')}: {t}" for k, t in self.weights.items()]
        if f := self.field_choice:
            why = "" if f["agrees"] else f["justified_by"] if f["justified_by"] == UNMEASURED else f"measured in {f['justified_by']}"
            out += [f"  field: SGLang {f['sglang']}; vLLM {f['vllm']}" + (f" (read: {f['read']})" if f.get("read") else ""),
                    f"  attnzoo's table row {'agrees with the field' if f['agrees'] else 'differs from the field: ' + why}",
                    *([f"  field note: {f['note']}"] if f.get("note") else [])]
        out += [f"  planned: {self.planned}"] if self.planned else []
        for title, items in (("adjustments made by the automatic policy", self.adjustments), ("notes", self.notes)):
            out += [f"  {title}:", *(f"    - {a}" for a in items)] if items else []
        for phase in PHASES:
            out.append(f"  {phase} candidates:")
            for c in (c for c in self.candidates if c.phase == phase):
                verdict = "chosen" if c.chosen else ("accepted" if c.accepted else "rejected")
                out.append(f"    {'*' if c.chosen else '+' if c.accepted else '-'} {c.name:15} {verdict}: "
                           f"{'; '.join(c.reasons)}")
                out += [f"    {'':17} note: {n}" for n in c.notes]
        return "\n".join(out)


def resolve(model, gpu: str | None = None, overrides: Overrides | None = None, model_id: str | None = None, *,
            table: str | os.PathLike | None = None) -> Decision:
    """``model``: an HF config (object or config.json dict), a ``ModelProfile`` or an architecture name; ``gpu``:
    "cpu", "sm80", ... or None for this device; ``model_id`` is matched against the files' model-id patterns;
    ``table`` replaces the shipped table (tests)."""
    ov = overrides or Overrides()
    shipped = load_table(table or SHIPPED_POLICY, shipped=True)
    notes: list[str] = []
    profile = _profile(model, shipped, notes)
    cls = gpu_class(device_gpu := detect_gpu() if gpu is None else str(gpu))
    if cls != device_gpu.strip().lower().replace("_", ""):
        notes.append(f"GPU {device_gpu} uses the {cls} rows and capabilities")
    user = user_table(ov.policy_file, notes)
    arch, fam = profile.architecture, profile.family
    matches = applicable(shipped, user, arch, fam, cls, model_id)
    values, sources = {}, {}
    for key in FIELDS:  # a phase's own keyword beats backend=
        kw = key if getattr(ov, key) is not None or key == "page_size" else "backend"
        if getattr(ov, kw) is not None:
            values[key], sources[key] = getattr(ov, kw), Source("override", f"keyword {kw}={getattr(ov, kw)!r}")
        else:
            values[key], sources[key] = value_of(matches, key, arch, fam, cls, shipped)
    page = values["page_size"]
    if type(page) is not int or not 1 <= page <= MAX_PAGE_SIZE:
        raise PolicyError(f"page size {page!r} (from {sources['page_size'].detail}) is not an integer in "
                          f"1..{MAX_PAGE_SIZE}", fix="pass e.g. page_size=16")
    if ov.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise PolicyError(f"unknown kv_cache_dtype {ov.kv_cache_dtype!r}", fix=f"use one of: {', '.join(KV_CACHE_DTYPES)}")
    if ov.kv_cache_dtype != "auto" and profile.kind != "mha":
        raise PolicyError(f"kv_cache_dtype={ov.kv_cache_dtype!r} is for MHA/GQA models; {arch} is {profile.kind.upper()}, "
                          "whose caches keep their explicit layouts",
                          fix="use kv_cache_dtype='auto' (MLA/NSA fp8 caches are backend layouts: e.g. nsa_triton_fp8)")
    capabilities, dtype, assume = all_capabilities(), dtype_name(ov.dtype), frozenset(ov.assume_installed)
    fallback = shipped.families[fam].fallback
    explicit_page = page if sources["page_size"].explicit else None

    def check(name: str, phase: str, page_bound: bool = True) -> Check:
        if name not in capabilities:
            return Check(name, phase, violations=[f"unknown backend (registered: {', '.join(capabilities)})"])
        return check_backend(capabilities[name], phase, profile, gpu=cls, dtype=dtype, kv_cache_dtype=ov.kv_cache_dtype,
                             assume_installed=assume, page_size=explicit_page if page_bound else None)

    def valid_fix(phase: str) -> str:
        valid = [n for n in capabilities if check(n, phase).ok]
        return (f"valid {phase} backends for {arch} on {cls} in this build: {', '.join(valid)}" if valid else
                f"no registered backend can run {phase} for {arch} on {cls}; use gpu='cpu' with the torch backend")

    checks, first_choice, adjustments = {}, {}, []
    for phase in PHASES:
        key = f"{phase}_backend"
        name, src = values[key], sources[key]
        first_choice[phase] = name
        # An explicit backend with an explicit page size it cannot take: _settle_page_size names both.
        chk = checks[phase] = check(name, phase, page_bound=not src.explicit)
        if chk.ok:
            continue
        if src.explicit and name not in capabilities:
            raise BackendError(f"unknown attention backend {name!r} (from {src.detail})",
                               fix=f"choose one of the registered backends: {', '.join(backend_names())}")
        if src.explicit:
            raise BackendError(f"{phase} backend {name!r} (from {src.detail}) cannot run {arch} on {cls}: "
                               f"{'; '.join(chk.violations)}", fix=valid_fix(phase))
        alt = next((a for a in fallback if check(a, phase).ok), None)
        if alt is None:
            raise BackendError(f"no backend in the policy can run {phase} for {arch} on {cls}: {name} (from "
                               f"{src.detail}): {'; '.join(chk.violations)}", fix=valid_fix(phase))
        adjustments.append(f"{phase}: {name} (from {src.detail}) cannot run this model here "
                           f"({'; '.join(chk.violations)}); using {alt}, the first runnable backend in family.{fam}.fallback")
        values[key], checks[phase] = alt, check(alt, phase)
        sources[key] = Source("fallback", f"family.{fam}.fallback in {shipped.path}, after {name} was rejected",
                              file=str(shipped.path), where=f"family.{fam}.fallback", reason=f"{name} cannot run this model here")
    page, page_adj = _settle_page_size(values, sources, cls, capabilities)
    if page_adj:
        adjustments.append(page_adj)
        sources["page_size"] = Source("fallback", f"adjusted from {sources['page_size'].detail}", reason=page_adj)
    pre_caps, dec_caps = capabilities[values["prefill_backend"]], capabilities[values["decode_backend"]]
    ks = {phase: k for phase in PHASES if (k := checks[phase].kernel) is not None}
    kernels = {p: k.name + (f" (the {k.runs_as} backend's kernel: {k.note})" if k.runs_as else "") for p, k in ks.items()}
    notes += [f"{p}: {k.note}" for p, k in ks.items() if k.requires_env]
    for caps in {pre_caps.name: pre_caps, dec_caps.name: dec_caps}.values():
        if (m := caps.block_table_columns_multiple(page)) > 1:  # the backend pads its own tables: said here
            notes.append(f"{caps.name}: block tables padded to a multiple of {m} columns "
                         f"({caps.block_table_pad_tokens}/page_size)")
    notes += layout_notes(pre_caps, dec_caps, profile.kind)
    notes += [f"model profile {profile.source}; pass the model's config for an exact check"] \
        if profile.source != "config" and not profile.source.startswith("read from") else []
    notes += ["run dtype not given: backend dtypes not checked"] if dtype is None else []
    return Decision(
        **{**values, "page_size": page}, gpu=cls, architecture=arch, sources=sources, adjustments=adjustments,
        candidates=_candidates(values, first_choice, fallback, page, check, cls, capabilities),
        planned=next((m.row.planned for _, _, m in matches if m.row.planned), None),
        profile=profile, model_id=model_id, device_gpu=device_gpu, kernels=kernels, notes=notes,
        kv_cache_dtype=ov.kv_cache_dtype, policy_files=[str(t.path) for t in (shipped, user) if t],
        field_choice=field_summary(matches), assumed_installed=sorted(assume))


def field_summary(matches) -> dict[str, Any] | None:
    """The most specific row's `field`, with whether it differs and what justifies a difference."""
    if (f := next((m.row.field for _, _, m in matches if m.row.field), None)) is None:
        return None
    measured = next((m.row.measured_in for _, _, m in matches if m.row.measured_in), None)
    return dict(f, differs=not f["agrees"], **({} if f["agrees"] else {"justified_by": measured or UNMEASURED}))


def applicable(shipped: PolicyTable, user: PolicyTable | None, arch, fam, gpu, model_id) -> list:
    return [(t, t is user, m) for t in (user, shipped) if t for m in t.lookup(arch, fam, gpu, model_id)]


def value_of(matches, key: str, arch: str, fam: str, gpu: str, shipped: PolicyTable) -> tuple[Any, Source]:
    """The value of one field from the most specific row that sets it, and where it came from."""
    for tbl, is_user, m in matches:
        if (v := getattr(m.row, _ROW_FIELD[key])) is not None:
            level, what = _LEVELS[m.level]
            what = "family entry" if is_user and m.level == "family" else what.format(m.pattern)
            what += ", " + (f"{m.row.where} (line {m.row.line})" if m.row.line else m.row.where)
            detail = f"user policy file {tbl.path}: {what}" if is_user else f"shipped policy: {what}"
            return v, Source("user_policy" if is_user else level, detail, file=str(tbl.path), where=m.row.where,
                             line=m.row.line, pattern=m.pattern, reason=m.row.reason, measured_in=m.row.measured_in)
    raise PolicyError(f"the policy table has no {_ROW_FIELD[key]} value for {arch} on {gpu}",
                      fix=f"add it to [family.{fam}.gpu.{gpu}] in {shipped.path}")


def _profile(model, shipped: PolicyTable, notes: list[str]) -> ModelProfile:
    if isinstance(model, str):
        if shipped.family_of(model) is None:
            raise PolicyError(f"architecture {model!r} is not in the policy table {shipped.path}",
                              fix=f"use one of: {', '.join(shipped.architectures())}, or pass the model's config: "
                                  "an unlisted architecture resolves by its attention kind")
        return shipped.profile(model)
    model = model if isinstance(model, ModelProfile) else profile_from_config(model)
    if (fam := shipped.family_of(model.architecture)) is not None:  # shipped rows win
        return model if model.family == fam else replace(model, family=fam)
    if (fam := shipped.family_of_kind(kind := model.attention_kind)) is None:
        served = ", ".join(sorted({k for f in shipped.families.values() for k in f.kinds}))
        raise PolicyError(f"architecture {model.architecture!r} is not in the policy table and no family serves its "
                          f"attention kind {kind!r} (families serve: {served})",
                          fix=f"add {kind!r} to a family's kinds in {shipped.path}, or pass backend= explicitly")
    notes.append(f"architecture {model.architecture} is not in the policy table: resolved by its attention kind "
                 f"{kind} to the {fam} family's rows (family.{fam}.kinds)")
    return replace(model, family=fam)


def user_table(policy_file, notes: list[str]) -> PolicyTable | None:
    if policy_file is not None and not isinstance(policy_file, (str, os.PathLike)):
        raise PolicyError(f"policy_file must be a path (str or os.PathLike), got {type(policy_file).__name__}",
                          fix="pass the path of a TOML policy file, e.g. policy_file='my_policy.toml'")
    env = os.environ.get(POLICY_ENV)
    if env:
        notes.append(f"${POLICY_ENV}={env} ignored: policy_file/--policy given" if policy_file
                     else f"user policy file from ${POLICY_ENV}")
    return load_table(policy_file or env) if policy_file or env else None


def _settle_page_size(values, sources, gpu: str, capabilities) -> tuple[int, str | None]:
    page, src = values["page_size"], sources["page_size"]
    allowed, needs = set(range(1, MAX_PAGE_SIZE + 1)), []
    for phase in PHASES:
        caps = capabilities[values[f"{phase}_backend"]]
        if (sizes := caps.page_sizes_on(gpu)) is not None:
            allowed &= sizes
            needs.append(f"{phase} backend {caps.name} needs {caps.page_sizes_text(gpu)}")
    if page in allowed:
        return page, None
    if not allowed or src.explicit:
        raise PolicyError(f"page size {page} (from {src.detail}) is not supported: {'; '.join(needs)}" if allowed else
                          f"no page size satisfies both backends: {'; '.join(needs)}",
                          fix=f"use a page size in {{{', '.join(map(str, sorted(allowed)))}}}, or other backends"
                          if allowed else "choose prefill and decode backends whose page sizes overlap")
    new = next((p for p in sorted(allowed) if p >= page), max(allowed))
    return new, (f"page size {'raised' if new > page else 'lowered'} from {page} ({src.detail}) to {new}: "
                 f"{'; '.join(needs)}")


def _candidates(values, first_choice, fallback, page: int, check, gpu: str, capabilities) -> list[Candidate]:
    out: list[Candidate] = []
    for phase in PHASES:
        chosen = values[f"{phase}_backend"]
        for name in dict.fromkeys([chosen, first_choice[phase], *fallback, *capabilities]):
            chk, caps = check(name, phase), capabilities.get(name)
            notes = [f"needs page size {caps.page_sizes_text(gpu)}; this decision uses {page}"] \
                if caps is not None and not caps.page_size_ok(page, gpu) else []
            if chk.kernel is not None and chk.kernel.runs_as:
                notes.append(f"{phase} runs the {chk.kernel.runs_as} backend's kernel here ({chk.kernel.note})")
            out.append(Candidate(name, phase, chk.ok, chosen=name == chosen, reasons=chk.reasons,
                                 kernel=chk.kernel.name if chk.kernel else None, notes=notes))
    return out

