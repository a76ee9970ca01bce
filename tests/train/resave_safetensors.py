"""Re-saves a safetensors file with PyTorch's own writer (safetensors.torch), optionally damaged for
an error test, and prints the name of the tensor it changed.

Usage: resave_safetensors.py IN OUT [drop|reshape]
  (none)    every tensor as read
  drop      without the first tensor
  reshape   the first tensor with a trailing dimension of 1 added
"""
import sys

from safetensors.torch import load_file, save_file

src, dst = sys.argv[1], sys.argv[2]
how = sys.argv[3] if len(sys.argv) > 3 else ""
tensors = load_file(src)
first = sorted(tensors)[0]
if how == "drop":
    del tensors[first]
elif how == "reshape":
    tensors[first] = tensors[first].unsqueeze(-1).contiguous()
save_file(tensors, dst)
print(first)
