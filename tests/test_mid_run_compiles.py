"""benchmarks/mid_run_compiles.py reads which arguments a compiled Triton kernel specialized on (integers divisible
by 16, pointers 16-byte aligned)."""
import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "mid_run_compiles.py"


def load():
    if str(SCRIPT.parent) not in sys.path:  # as when run as a script: its folder first, for e2e.py
        sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("mid_run_compiles", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_specialized_args_reads_a_multi_line_signature(tmp_path):
    (tmp_path / "_k.ttir").write_text(
        'module {\n  tt.func public @_k(%Q: !tt.ptr<bf16> {tt.divisibility = 16 : i32} loc("Q"(#loc)),\n'
        '      %stride_qt: i32 {tt.divisibility = 16 : i32} loc("stride_qt"(#loc)), %width: i32 loc("width"(#loc)),\n'
        '      %stride_btb: i64 {tt.divisibility = 16 : i32} loc("stride_btb"(#loc))) attributes {noinline = false} {\n'
        '    %c = arith.constant 0 : i32 {tt.divisibility = 16 : i32}\n  }\n}\n')
    assert load().specialized_args(str(tmp_path)) == ["Q", "stride_qt", "stride_btb"]


def test_no_ir_no_arguments(tmp_path):
    assert load().specialized_args(str(tmp_path)) == []
