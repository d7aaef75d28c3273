"""e2e.py with programmatic dependent launch off at chosen launch sites, to find which kernels it helps.

    python benchmarks/pdl_sites.py --off skinny_kernels,decode -- --shape llama8b --prompts 1 --hf-prompts 0 \\
        --backends triton --cascade off --load-kwargs '{"cuda_graph_batch_sizes": [1]}' --out /tmp/x

``--off`` names the modules whose launches lose PDL (decode, store, fused_kernels, skinny_kernels, fused for
the MoE kernels, routing); every other launch keeps attnzoo.pdl's own rule (results/pdl_multi_wave_nvidia_h200.txt).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from attnzoo import pdl  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--off", default="", help="comma-separated module names whose kernels launch without PDL")
    ap.add_argument("e2e_args", nargs=argparse.REMAINDER, help="after --: e2e.py's arguments")
    args = ap.parse_args()
    off = tuple(f"/{name}.py" for name in args.off.split(",") if name)
    rule = pdl.launch_args

    def launch_args(x, programs=None):
        # Launch sites call pdl.launch_args at graph capture, so the caller's file names the kernel's module.
        if sys._getframe(1).f_code.co_filename.endswith(off or ("\0",)):
            return {"PDL": False, "launch_pdl": False}
        return rule(x, programs)

    pdl.launch_args = launch_args
    import e2e

    e2e.main([a for a in args.e2e_args if a != "--"])


if __name__ == "__main__":
    main()
