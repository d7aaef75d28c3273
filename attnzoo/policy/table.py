"""The policy table as data: TOML read with tomllib into frozen dataclasses, validated with file:line errors.
One schema (documented at the top of policy.toml) serves the shipped table and user policy files."""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from attnzoo.attention.backends import backend_names
from attnzoo.attention.backends.capabilities import ATTENTION_KINDS, GPUS
from attnzoo.attention.kv_cache import MAX_PAGE_SIZE
from attnzoo.errors import PolicyError
from attnzoo.policy.profile import ModelProfile

SHIPPED_POLICY = Path(__file__).with_name("policy.toml")
SCHEMA_VERSION = 1
UNMEASURED = "unmeasured"
ROW_KEYS = ("backend", "prefill", "decode", "page_size", "reason", "planned", "measured_in", "field")
FIELD_KEYS = ("sglang", "vllm", "agrees", "read", "note")
_INTS = lambda x: isinstance(x, list) and bool(x) and all(type(i) is int and i > 0 for i in x)  # noqa: E731
_BOOL = lambda x: isinstance(x, bool)  # noqa: E731
PROFILE_KEYS = {"kind": lambda x: x in ATTENTION_KINDS, "head_dims": _INTS, "v_head_dims": _INTS,
                "num_kv_heads": _INTS, "num_heads": lambda x: type(x) is int and x > 0, "sliding_window": _BOOL,
                "softcap": _BOOL, "sinks": _BOOL, "dtype": lambda x: x in ("float32", "bfloat16", "float16"),
                "example": lambda x: isinstance(x, str)}
# The automatic policy's own machinery: a user file's choices are explicit and never fall back.
_SHIPPED_ONLY = {"fallback", "profile", "kinds", "flagship"}
_ENTRY_KEYS = {"family": set(ROW_KEYS) | {"gpu", "arch", "fallback", "profile", "kinds"},
               "arch": set(ROW_KEYS) | {"gpu", "profile"}, "models": set(ROW_KEYS) | {"gpu"}}
_TOP_KEYS = {"schema", "family", "models", "field_read", "measured", "flagship"}


@dataclass(frozen=True)
class Row:  # the fields one table row sets; None = not set here (a less specific row decides)
    where: str  # dotted path in the file, e.g. family.llama.gpu.sm90
    line: int | None
    prefill: str | None = None
    decode: str | None = None
    page_size: int | None = None
    reason: str | None = None
    planned: str | None = None
    measured_in: str | None = None
    field: dict[str, Any] | None = None  # the field's choice: FIELD_KEYS


@dataclass(frozen=True)
class Entry:
    all_gpus: Row
    gpus: dict[str, Row] = field(default_factory=dict)
    profile: dict[str, Any] | None = None


@dataclass(frozen=True)
class Family:
    name: str
    entry: Entry
    archs: dict[str, Entry]
    fallback: tuple[str, ...]
    kinds: tuple[str, ...] = ()


@dataclass(frozen=True)
class Match:  # one row that applies to a (model, GPU) lookup, and where it came from
    level: str  # "model" | "arch" | "family"
    row: Row
    pattern: str | None = None


@dataclass(frozen=True)
class PolicyTable:
    path: Path
    families: dict[str, Family]
    models: dict[str, Entry]  # model-id glob -> entry, in file order
    flagships: dict[str, str] = field(default_factory=dict)  # hub id -> architecture

    def family_of(self, architecture: str) -> str | None:
        return next((f.name for f in self.families.values() if architecture in f.archs), None)

    def family_of_kind(self, kind: str) -> str | None:
        """The family serving unlisted architectures of this attention kind ("mha_sinks", unlisted: "mha")."""
        return next((f.name for k in (kind, kind.split("_")[0]) for f in self.families.values() if k in f.kinds), None)

    def architectures(self) -> list[str]:
        return [a for fam in self.families.values() for a in fam.archs]

    def flagship(self, model_id: str) -> str | None:
        return next((a for m, a in self.flagships.items() if m.lower() == model_id.lower()), None)

    def lookup(self, architecture: str, family: str | None, gpu: str, model_id: str | None) -> list[Match]:
        """Every row applying to this cell, most specific first."""
        rows = lambda e: ([e.gpus[gpu]] if gpu in e.gpus else []) + [e.all_gpus]  # noqa: E731
        # Hub ids are case-insensitive; more literal characters = more specific.
        hits = [(p, e) for p, e in self.models.items() if model_id and fnmatch.fnmatchcase(model_id.lower(), p.lower())]
        out = [Match("model", r, p) for p, e in sorted(hits, key=lambda pe: -len(re.sub(r"[*?]", "", pe[0]))) for r in rows(e)]
        fam = self.families.get(family or "")
        entries = [("arch", fam.archs.get(architecture)), ("family", fam.entry)] if fam else []
        return out + [Match(level, r) for level, e in entries if e for r in rows(e)]

    def profile(self, architecture: str) -> ModelProfile:
        """The model assumed when only a listed architecture's name is known: its ``profile`` fields."""
        fam = self.families[self.family_of(architecture)]
        f = {**(fam.entry.profile or {}), **(fam.archs[architecture].profile or {})}
        if "kind" not in f or "head_dims" not in f:
            raise PolicyError(f"the policy table has no fallback profile for {architecture!r}",
                              fix="pass the model's config (a local dir or a cached hub id), not the architecture name")
        return ModelProfile(
            architecture=architecture, family=fam.name, kind=f["kind"], head_dims=frozenset(f["head_dims"]),
            v_head_dims=frozenset(f.get("v_head_dims", f["head_dims"])), uses_sliding_window=f.get("sliding_window", False),
            uses_softcap=f.get("softcap", False), uses_sinks=f.get("sinks", False), num_heads=f.get("num_heads"),
            num_kv_heads=frozenset(f.get("num_kv_heads", [])), dtype=f.get("dtype"),
            source="assumed from the architecture name" + (f", shaped like {f['example']}" if "example" in f else ""))


def load_table(path, *, shipped: bool = False) -> PolicyTable:
    """Read and validate a policy file. Every problem is a PolicyError naming the file, key and line."""
    p = Path(path)
    if not p.is_file():
        raise PolicyError(f"policy file {str(p)!r} {'is not a file' if p.exists() else 'does not exist'}",
                          fix="pass an existing TOML file with --policy / policy_file=, or unset ATTNZOO_POLICY")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise PolicyError(f"policy file {p} is not UTF-8 text (byte {e.start}: {e.reason})",
                          fix="save the file as UTF-8 (TOML files are UTF-8)") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        line = getattr(e, "lineno", None) or int((re.search(r"line (\d+)", str(e)) or [0, 0])[1]) or None
        src = text.splitlines()[line - 1].strip() if line and line <= len(text.splitlines()) else ""
        raise PolicyError(f"{p}:{line or '?'}: malformed TOML ({e})" + (f" in {src!r}" if src else ""),
                          fix="fix the TOML syntax at that line") from None
    except RecursionError:
        raise PolicyError(f"policy file {p} nests arrays or tables too deeply to read",
                          fix="a policy file is a few levels deep: [family.NAME.gpu.GPU] rows of plain values") from None
    return _Parser(p, text.splitlines(), shipped).parse(data)


def _dotted(kp: tuple[str, ...]) -> str:
    return ".".join(k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else f'"{k}"' for k in kp)


def _parts(s: str) -> list[str]:
    return [t.strip("\"'") for t in re.findall(r'"[^"]*"|\'[^\']*\'|[^.\s"\']+', s)]


class _Parser:
    def __init__(self, path: Path, lines: list[str], shipped: bool):
        self.path, self.lines, self.shipped, self.field_read = path, lines, shipped, None
        self.headers = {n: _parts(m[1]) for n, l in enumerate(lines, 1) if (m := re.match(r"\s*\[+([^\]]+)\]", l))}

    def line_of(self, kp: tuple[str, ...]) -> int | None:
        """The line of a key path (tomllib reports none): its first table header, else its `key =` line."""
        if hit := next((n for n, h in self.headers.items() if h[:len(kp)] == list(kp)), None):
            return hit
        start, depth = max(((n, len(h)) for n, h in self.headers.items() if list(kp[:len(h)]) == h), default=(0, 0))
        rest = list(kp[depth:])
        for n, line in enumerate(self.lines[start:], start + 1):
            if n in self.headers:
                break
            lhs = _parts(line.split("=", 1)[0]) if "=" in line and not line.lstrip().startswith("#") else None
            if lhs and (lhs[:len(rest)] == rest or (rest[:len(lhs)] == lhs and (
                    len(rest) == len(lhs) or re.search(rf"[{{,]\s*{re.escape(rest[-1])}\s*=", line)))):
                return n
        return start or None

    def fail(self, kp: tuple[str, ...], problem: str, fix: str) -> PolicyError:
        return PolicyError(f"{self.path}:{self.line_of(kp) or '?'}: key {_dotted(kp)!r}: {problem}", fix=fix)

    def table(self, value, kp: tuple[str, ...], allowed=None) -> dict:
        if not isinstance(value, dict):
            raise self.fail(kp, f"expected a table, got {type(value).__name__}",
                            f"write it as [{'.'.join(kp)}] with fields below it")
        for k in value if allowed is not None else ():
            if k not in allowed:
                raise self.fail(kp + (k,), "unknown key", f"use one of: {', '.join(sorted(allowed))}")
            if k in _SHIPPED_ONLY and not self.shipped:
                raise self.fail(kp + (k,), "only the shipped table sets this key",
                                "remove it; a user policy file chooses backends and page sizes, explicitly")
        return value

    def parse(self, data: dict) -> PolicyTable:
        self.table(data, (), _TOP_KEYS)
        self.table(data.get("measured", {}), ("measured",))
        self.field_read = data.get("field_read", "")
        if not isinstance(self.field_read, str):
            raise self.fail(("field_read",), "expected a string", 'write field_read = "what was read, versions"')
        if data.get("schema", SCHEMA_VERSION) != SCHEMA_VERSION:
            raise self.fail(("schema",), f"schema version {data['schema']!r} is not supported",
                            f"set schema = {SCHEMA_VERSION}")
        families = {n: self.family(n, b) for n, b in self.table(data.get("family", {}), ("family",)).items()}
        shipped = None if self.shipped else load_table(SHIPPED_POLICY, shipped=True)
        seen: dict[str, str] = {}  # an architecture in two families would make the lookup depend on file order
        for fam in families.values():
            known = shipped.families.get(fam.name) if shipped else fam
            if known is None:  # a user file only refines what the shipped table knows
                raise self.fail(("family", fam.name), "unknown family", f"use one of: {', '.join(shipped.families)}")
            for arch in fam.archs:
                if arch not in known.archs:
                    raise self.fail(("family", fam.name, "arch", arch), f"architecture not in family {fam.name!r}",
                                    f"use one of: {', '.join(known.archs)}")
                if arch in seen:
                    raise self.fail(("family", fam.name, "arch", arch), f"architecture also listed in family "
                                    f"{seen[arch]!r}", "list each architecture in one family only")
                seen[arch] = fam.name
        models = {p: self.entry(b, ("models", p), "models") for p, b in self.table(data.get("models", {}), ("models",)).items()}
        flagships = self.table(data.get("flagship", {}), ("flagship",))
        for hub_id, arch in flagships.items():
            if arch not in seen:
                raise self.fail(("flagship", hub_id), f"architecture {arch!r} is not in the table", f"use one of: {', '.join(seen)}")
        return PolicyTable(self.path, families, models, dict(flagships))

    def family(self, name: str, body) -> Family:
        kp = ("family", name)
        archs = {a: self.entry(b, kp + ("arch", a), "arch") for a, b in self.table(body.get("arch", {}), kp + ("arch",)).items()}
        for key, example in (("fallback", '["triton", "torch"]'), ("kinds", '["mha"]')):
            if not isinstance(body.get(key, []), list) or not all(isinstance(x, str) for x in body.get(key, [])):
                raise self.fail(kp + (key,), "expected a list of names", f"write {key} = {example}")
        fallback = tuple(self.backend_name(b, kp + ("fallback",)) for b in body.get("fallback", []))
        return Family(name, self.entry(body, kp, "family"), archs, fallback, tuple(body.get("kinds", [])))

    def entry(self, body, kp: tuple[str, ...], kind: str) -> Entry:
        self.table(body, kp, _ENTRY_KEYS[kind])
        gpus = {}
        for gpu, rb in self.table(body.get("gpu", {}), kp + ("gpu",)).items():
            if gpu not in GPUS:
                raise self.fail(kp + ("gpu", gpu), "unknown GPU", f"use one of: {', '.join(GPUS)}")
            gpus[gpu] = self.row(self.table(rb, kp + ("gpu", gpu), set(ROW_KEYS)), kp + ("gpu", gpu))
        profile = dict(self.table(body["profile"], kp + ("profile",), set(PROFILE_KEYS))) if "profile" in body else None
        for k, v in (profile or {}).items():
            if not PROFILE_KEYS[k](v):
                raise self.fail(kp + ("profile", k), f"invalid value {v!r}", "see the profile fields in policy.toml")
        return Entry(self.row({k: v for k, v in body.items() if k in ROW_KEYS}, kp), gpus, profile)

    def row(self, body: dict, kp: tuple[str, ...]) -> Row:
        names = {k: self.backend_name(body[k], kp + (k,)) for k in ("backend", "prefill", "decode") if k in body}
        page = body.get("page_size")
        if page is not None and (type(page) is not int or not 1 <= page <= MAX_PAGE_SIZE):
            raise self.fail(kp + ("page_size",), f"page size {page!r} is not an integer in 1..{MAX_PAGE_SIZE}",
                            "write e.g. page_size = 16")
        for k in ("reason", "planned", "measured_in"):
            if k in body and not isinstance(body[k], str):
                raise self.fail(kp + (k,), f"expected a string, got {type(body[k]).__name__}", f'write {k} = "..."')
        return Row(where=_dotted(kp), line=self.line_of(kp),
                   prefill=names.get("prefill", names.get("backend")), decode=names.get("decode", names.get("backend")),
                   page_size=page, reason=body.get("reason"), planned=body.get("planned"),
                   measured_in=body.get("measured_in"),
                   field=self.field(body["field"], kp + ("field",)) if "field" in body else None)

    def field(self, value, kp: tuple[str, ...]) -> dict[str, Any]:
        body = dict(self.table(value, kp, set(FIELD_KEYS)))
        for k, v in body.items():
            if not isinstance(v, bool if k == "agrees" else str):
                raise self.fail(kp + (k,), f"invalid value {v!r}", "agrees = true/false; sglang, vllm, read, note are strings")
        for k in ("sglang", "vllm", "agrees"):
            if k not in body:
                raise self.fail(kp, f"missing {k!r}", 'write field = { sglang = "...", vllm = "...", agrees = false }')
        return {**body, **({"read": self.field_read} if self.field_read and "read" not in body else {})}

    def backend_name(self, value, kp: tuple[str, ...]) -> str:
        if not isinstance(value, str) or value not in backend_names():
            raise self.fail(kp, f"unknown backend {value!r}", f"use one of: {', '.join(backend_names())}")
        return value

