"""The policy table as data: parsing, strict validation with file:line errors, and cell lookup.

One schema serves the shipped table (``policy.toml``) and user policy files (``--policy FILE`` or
``$ATTNZOO_POLICY``)::

    schema = 1

    [family.<name>]                      # family default, for every GPU (optional fields)
    fallback = ["triton", "torch"]       # automatic fallback order when a row's backend cannot run a model
    profile = { kind = "mha", ... }      # the model assumed when only an architecture name is known
    [family.<name>.gpu.<gpu>]            # family default row for one GPU
    prefill = "triton"                   # or backend = "..." for both phases
    decode = "triton"
    page_size = 16
    reason = "why"
    planned = "what replaces it once implemented"
    measured_in = "benchmarks/results/<file>"   # or "unmeasured": the row differs from the field untested
    field = { sglang = "fa3", vllm = "FLASH_ATTN (FA3)", agrees = false, note = "..." }
                                         # the field's choice for this cell (engines' own names); `read`
                                         # (what was read, versions) defaults to the file's `field_read`
    [family.<name>.arch.<Architecture>]  # per-architecture entry: same row fields, its own gpu rows
    [models."<model id glob>"]            # per-model-id entry (user files), e.g. "google/gemma-4-*"
    [measured]                           # numbers behind the file (written by `attnzoo tune`); not read by resolve

Within one file the most specific row wins, field by field: model-id pattern > architecture entry >
family default, and within each a GPU row > the entry's all-GPU fields.
"""
from __future__ import annotations

import fnmatch
import re
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnzoo.attention.backends import backend_names
from attnzoo.attention.backends.capabilities import ATTENTION_KINDS, GPUS
from attnzoo.attention.kv_cache import MAX_PAGE_SIZE
from attnzoo.errors import PolicyError

SHIPPED_POLICY = Path(__file__).with_name("policy.toml")
SCHEMA_VERSION = 1

ROW_KEYS = ("backend", "prefill", "decode", "page_size", "reason", "planned", "measured_in", "field")
FIELD_KEYS = ("sglang", "vllm", "agrees", "read", "note")
UNMEASURED = "unmeasured"
PROFILE_KEYS = (
    "kind", "head_dims", "v_head_dims", "num_heads", "num_kv_heads",
    "sliding_window", "softcap", "dtype", "example",
)
# The automatic policy's own machinery: a user file's choices are explicit and never fall back.
_SHIPPED_ONLY = ("fallback", "profile")
_ENTRY_KEYS = {
    "family": set(ROW_KEYS) | {"gpu", "arch", "fallback", "profile"},
    "arch": set(ROW_KEYS) | {"gpu", "profile"},
    "models": set(ROW_KEYS) | {"gpu"},
}


@dataclass(frozen=True)
class Row:
    """The fields one table row sets; None = not set here (a less specific row decides)."""

    where: str  # dotted path in the file, e.g. family.llama.gpu.sm90
    line: int | None
    prefill: str | None = None
    decode: str | None = None
    page_size: int | None = None
    reason: str | None = None
    planned: str | None = None
    measured_in: str | None = None
    field: dict[str, Any] | None = None  # the field's choice: FIELD_KEYS

    def get(self, name: str):
        return getattr(self, name)


@dataclass
class Entry:
    where: str
    line: int | None
    all_gpus: Row
    gpus: dict[str, Row] = field(default_factory=dict)
    profile: dict[str, Any] | None = None


@dataclass
class Family:
    name: str
    entry: Entry
    archs: dict[str, Entry]
    fallback: tuple[str, ...]


@dataclass(frozen=True)
class Match:
    """One row that applies to a (model, GPU) lookup, with where it came from."""

    level: str  # "model" | "arch" | "family"
    row: Row
    pattern: str | None = None


@dataclass
class PolicyTable:
    path: Path
    families: dict[str, Family]
    models: dict[str, Entry]  # model-id glob -> entry, in file order

    def family_of(self, architecture: str) -> str | None:
        for fam in self.families.values():
            if architecture in fam.archs:
                return fam.name
        return None

    def architectures(self) -> list[str]:
        return [a for fam in self.families.values() for a in fam.archs]

    def lookup(self, architecture: str, family: str | None, gpu: str, model_id: str | None) -> list[Match]:
        """Every row applying to this cell, most specific first."""
        out: list[Match] = []
        if model_id:
            hits = [(p, e) for p, e in self.models.items() if _glob_match(model_id, p)]
            # More literal characters = more specific; ties keep file order.
            hits.sort(key=lambda pe: -len(pe[0].replace("*", "").replace("?", "")))
            for pattern, entry in hits:
                out += [Match("model", r, pattern) for r in _entry_rows(entry, gpu)]
        fam = self.families.get(family) if family else None
        if fam is not None:
            arch_entry = fam.archs.get(architecture)
            if arch_entry is not None:
                out += [Match("arch", r) for r in _entry_rows(arch_entry, gpu)]
            out += [Match("family", r) for r in _entry_rows(fam.entry, gpu)]
        return out

    def profile_for(self, architecture: str) -> dict[str, Any] | None:
        """The fallback profile fields for an architecture (arch entry over family), or None."""
        fam = self.families.get(self.family_of(architecture) or "")
        if fam is None:
            return None
        merged = dict(fam.entry.profile or {})
        merged.update(fam.archs[architecture].profile or {})
        return merged or None


def _glob_match(model_id: str, pattern: str) -> bool:
    # Hub ids are case-insensitive on the Hub; local paths are matched as given.
    return fnmatch.fnmatchcase(model_id.lower(), pattern.lower())


def _entry_rows(entry: Entry, gpu: str) -> list[Row]:
    rows = [entry.gpus[gpu]] if gpu in entry.gpus else []
    return rows + [entry.all_gpus]


# --------------------------------------------------------------------------------------- parsing


def load_table(path: str | Path, *, shipped: bool = False) -> PolicyTable:
    """Read and validate a policy file. Every problem is a PolicyError naming the file, key and line."""
    p = Path(path)
    if not p.is_file():
        raise PolicyError(
            f"policy file {str(p)!r} does not exist" if not p.exists() else f"policy file {str(p)!r} is not a file",
            fix="pass an existing TOML file with --policy / policy_file=, or unset ATTNZOO_POLICY",
        )
    text = p.read_text(encoding="utf-8")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        m = re.search(r"line (\d+)", str(e))
        line = int(m.group(1)) if m else None
        src = text.splitlines()[line - 1].strip() if line and line <= len(text.splitlines()) else ""
        raise PolicyError(
            f"{p}:{line or '?'}: malformed TOML ({e})" + (f" in {src!r}" if src else ""),
            fix="fix the TOML syntax at that line",
        ) from None
    return _Parser(p, text, shipped).parse(data)


class _Parser:
    def __init__(self, path: Path, text: str, shipped: bool):
        self.path = path
        self.shipped = shipped
        self.field_read: str | None = None
        self.lines = _key_lines(text)

    # -- errors
    def line_of(self, keypath: tuple[str, ...]) -> int | None:
        for n in range(len(keypath), 0, -1):
            if keypath[:n] in self.lines:
                return self.lines[keypath[:n]]
        return None

    def fail(self, keypath: tuple[str, ...], problem: str, fix: str) -> PolicyError:
        line = self.line_of(keypath)
        return PolicyError(f"{self.path}:{line or '?'}: key {_dotted(keypath)!r}: {problem}", fix=fix)

    def unknown(self, keypath: tuple[str, ...], allowed) -> PolicyError:
        return self.fail(keypath, "unknown key", f"use one of: {', '.join(sorted(allowed))}")

    # -- structure
    def parse(self, data: dict) -> PolicyTable:
        allowed_top = {"schema", "family", "models", "field_read", "measured"}
        for k in data:
            if k not in allowed_top:
                raise self.unknown((k,), allowed_top)
        self.field_read = data.get("field_read")
        if self.field_read is not None and not isinstance(self.field_read, str):
            raise self.fail(("field_read",), "expected a string", 'write field_read = "what was read, versions"')
        self.table(data.get("measured", {}), ("measured",))
        schema = data.get("schema", SCHEMA_VERSION)
        if schema != SCHEMA_VERSION:
            raise self.fail(("schema",), f"schema version {schema!r} is not supported",
                            f"set schema = {SCHEMA_VERSION}")
        families: dict[str, Family] = {}
        fam_data = self.table(data.get("family", {}), ("family",))
        for name, body in fam_data.items():
            families[name] = self.family(name, self.table(body, ("family", name)))
        if not self.shipped:
            self.check_families_known(families)
        models: dict[str, Entry] = {}
        for pattern, body in self.table(data.get("models", {}), ("models",)).items():
            models[pattern] = self.entry(self.table(body, ("models", pattern)), ("models", pattern), "models")
        # An architecture in two families would make the lookup depend on file order.
        seen: dict[str, str] = {}
        for fam in families.values():
            for arch in fam.archs:
                if arch in seen:
                    raise self.fail(("family", fam.name, "arch", arch), f"architecture also listed in family {seen[arch]!r}",
                                    "list each architecture in one family only")
                seen[arch] = fam.name
        return PolicyTable(self.path, families, models)

    def check_families_known(self, families: dict[str, Family]) -> None:
        """A user file may only refine families and architectures the shipped table knows."""
        shipped = load_table(SHIPPED_POLICY, shipped=True)
        for name, fam in families.items():
            if name not in shipped.families:
                raise self.fail(("family", name), "unknown family",
                                f"use one of: {', '.join(shipped.families)}")
            for arch in fam.archs:
                if arch not in shipped.families[name].archs:
                    raise self.fail(("family", name, "arch", arch), f"architecture not in family {name!r}",
                                    f"use one of: {', '.join(shipped.families[name].archs)}")

    def table(self, value, keypath: tuple[str, ...]) -> dict:
        if not isinstance(value, dict):
            raise self.fail(keypath, f"expected a table, got {type(value).__name__}",
                            f"write it as [{_dotted(keypath)}] with fields below it")
        return value

    def family(self, name: str, body: dict) -> Family:
        kp = ("family", name)
        for k in body:
            if k not in _ENTRY_KEYS["family"]:
                raise self.unknown(kp + (k,), _ENTRY_KEYS["family"])
            if k in _SHIPPED_ONLY and not self.shipped:
                raise self.fail(kp + (k,), "only the shipped table sets this key",
                                "remove it; a user policy file chooses backends and page sizes, explicitly")
        entry = self.entry(body, kp, "family")
        archs = {
            a: self.entry(self.table(b, kp + ("arch", a)), kp + ("arch", a), "arch")
            for a, b in self.table(body.get("arch", {}), kp + ("arch",)).items()
        }
        fallback = body.get("fallback", [])
        if not isinstance(fallback, list) or not all(isinstance(x, str) for x in fallback):
            raise self.fail(kp + ("fallback",), "expected a list of backend names", 'write fallback = ["triton", "torch"]')
        for b in fallback:
            self.backend_name(b, kp + ("fallback",))
        return Family(name, entry, archs, tuple(fallback))

    def entry(self, body: dict, kp: tuple[str, ...], kind: str) -> Entry:
        for k in body:
            if k not in _ENTRY_KEYS[kind]:
                raise self.unknown(kp + (k,), _ENTRY_KEYS[kind])
            if k in _SHIPPED_ONLY and not self.shipped:
                raise self.fail(kp + (k,), "only the shipped table sets this key",
                                "remove it; a user policy file chooses backends and page sizes, explicitly")
        gpus: dict[str, Row] = {}
        for gpu, rb in self.table(body.get("gpu", {}), kp + ("gpu",)).items():
            if gpu not in GPUS:
                raise self.fail(kp + ("gpu", gpu), "unknown GPU", f"use one of: {', '.join(GPUS)}")
            rb = self.table(rb, kp + ("gpu", gpu))
            for k in rb:
                if k not in ROW_KEYS:
                    raise self.unknown(kp + ("gpu", gpu, k), ROW_KEYS)
            gpus[gpu] = self.row(rb, kp + ("gpu", gpu))
        profile = None
        if "profile" in body:
            profile = self.profile(self.table(body["profile"], kp + ("profile",)), kp + ("profile",))
        row_fields = {k: v for k, v in body.items() if k in ROW_KEYS}
        return Entry(_dotted(kp), self.line_of(kp), self.row(row_fields, kp), gpus, profile)

    def row(self, body: dict, kp: tuple[str, ...]) -> Row:
        vals: dict[str, Any] = {}
        for k in ("backend", "prefill", "decode"):
            if k in body:
                vals[k] = self.backend_name(body[k], kp + (k,))
        both = vals.pop("backend", None)
        prefill = vals.get("prefill", both)
        decode = vals.get("decode", both)
        page = body.get("page_size")
        if page is not None and (isinstance(page, bool) or not isinstance(page, int) or not 1 <= page <= MAX_PAGE_SIZE):
            raise self.fail(kp + ("page_size",), f"page size {page!r} is not an integer in 1..{MAX_PAGE_SIZE}",
                            "write e.g. page_size = 16")
        for k in ("reason", "planned", "measured_in"):
            if k in body and not isinstance(body[k], str):
                raise self.fail(kp + (k,), f"expected a string, got {type(body[k]).__name__}", f'write {k} = "..."')
        return Row(
            where=_dotted(kp), line=self.line_of(kp), prefill=prefill, decode=decode, page_size=page,
            reason=body.get("reason"), planned=body.get("planned"), measured_in=body.get("measured_in"),
            field=self.field(body["field"], kp + ("field",)) if "field" in body else None,
        )

    def field(self, value, kp: tuple[str, ...]) -> dict[str, Any]:
        body = dict(self.table(value, kp))
        for k, v in body.items():
            if k not in FIELD_KEYS:
                raise self.unknown(kp + (k,), FIELD_KEYS)
            if not isinstance(v, bool if k == "agrees" else str):
                raise self.fail(kp + (k,), f"invalid value {v!r}",
                                "agrees = true/false; sglang, vllm, read, note are strings")
        for k in ("sglang", "vllm", "agrees"):
            if k not in body:
                raise self.fail(kp, f"missing {k!r}", 'write field = { sglang = "...", vllm = "...", agrees = false }')
        if "read" not in body and self.field_read:
            body["read"] = self.field_read
        return body

    def backend_name(self, value, kp: tuple[str, ...]) -> str:
        if not isinstance(value, str) or value not in backend_names():
            raise self.fail(kp, f"unknown backend {value!r}", f"use one of: {', '.join(backend_names())}")
        return value

    def profile(self, body: dict, kp: tuple[str, ...]) -> dict:
        for k, v in body.items():
            if k not in PROFILE_KEYS:
                raise self.unknown(kp + (k,), PROFILE_KEYS)
            ok = {
                "kind": lambda x: x in ATTENTION_KINDS,
                "head_dims": _int_list, "v_head_dims": _int_list, "num_kv_heads": _int_list,
                "num_heads": lambda x: isinstance(x, int) and x > 0,
                "sliding_window": lambda x: isinstance(x, bool), "softcap": lambda x: isinstance(x, bool),
                "dtype": lambda x: x in ("float32", "bfloat16", "float16"),
                "example": lambda x: isinstance(x, str),
            }[k](v)
            if not ok:
                raise self.fail(kp + (k,), f"invalid value {v!r}", "see the profile fields in attnzoo/defaults/policy.toml")
        return dict(body)


def _int_list(x) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(i, int) and not isinstance(i, bool) and i > 0 for i in x)


def _dotted(keypath: tuple[str, ...]) -> str:
    return ".".join(k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else f'"{k}"' for k in keypath)


# ------------------------------------------------------------------------ key -> line numbers
# tomllib reports no positions for keys, so the file is scanned once: every table header and every
# `key = value` line (dotted keys, and keys of one-line inline tables) is mapped to its full key path.

_KEY_LINE = re.compile(r"""^\s*((?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*')(?:\s*\.\s*(?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*'))*)\s*=""")
_INLINE_KEY = re.compile(r"""[{,]\s*([A-Za-z0-9_-]+|"[^"]*"|'[^']*')\s*=""")


def _split_key(s: str) -> tuple[str, ...]:
    parts = re.findall(r"""\s*([A-Za-z0-9_-]+|"[^"]*"|'[^']*')\s*(?:\.|$)""", s.strip())
    return tuple(p[1:-1] if p[:1] in "\"'" else p for p in parts)


def _key_lines(text: str) -> dict[tuple[str, ...], int]:
    lines: dict[tuple[str, ...], int] = {}
    header: tuple[str, ...] = ()
    for n, raw in enumerate(text.splitlines(), start=1):
        s = raw.strip()
        if not s or s.startswith("#"):
            continue
        h = re.match(r"^\[\[?\s*(.+?)\s*\]\]?\s*(#.*)?$", s)
        if h:
            header = _split_key(h.group(1))
            for i in range(1, len(header) + 1):
                lines.setdefault(header[:i], n)
            continue
        m = _KEY_LINE.match(raw)
        if not m:
            continue
        key = header + _split_key(m.group(1))
        for i in range(len(header) + 1, len(key) + 1):
            lines.setdefault(key[:i], n)
        rest = raw[m.end():]
        if "{" in rest:
            for k in _INLINE_KEY.findall(rest):
                lines.setdefault(key + _split_key(k), n)
    return lines
