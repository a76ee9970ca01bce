"""Runs a command and appends its peak resident memory to a file, as one line `RANK MIB`: the
kernel's ru_maxrss of the command's process (anonymous and mapped file pages), read the same way
for fsdpp and PyTorch. Under a launcher, one per rank:

    fsdpp launch --nproc 2 -- python bench/peak_rss.py OUT -- COMMAND ...
"""
import os
import resource
import subprocess
import sys

if len(sys.argv) < 4 or sys.argv[2] != "--":
    raise SystemExit(__doc__)
code = subprocess.call(sys.argv[3:])
peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
with open(sys.argv[1], "a") as f:
    f.write(f"{os.environ.get('RANK', '0')} {peak_mib:.1f}\n")
sys.exit(code)
