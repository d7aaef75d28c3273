import os
import sys

import torch

# Tests import their shared helpers as a plain module.
sys.path.insert(0, os.path.dirname(__file__))
# Without a GPU, Triton kernels run through the interpreter; it must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
