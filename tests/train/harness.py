"""What the Python comparisons with transformers share: a scratch folder, checks that collect
failures, and commands run with their output shown when they fail."""
import os
import subprocess
import tempfile


class Harness:
    def __init__(self, prefix):
        self.work = tempfile.mkdtemp(prefix=prefix)
        self.failures = []

    def check(self, ok, what):
        print(("ok    " if ok else "FAIL  ") + what, flush=True)
        if not ok:
            self.failures.append(what)

    def run(self, *args, expect=0):
        p = subprocess.run([str(a) for a in args], capture_output=True, text=True, errors="replace")
        if expect is not None and p.returncode != expect:
            print(p.stdout[-3000:], p.stderr[-3000:], sep="\n")
            raise AssertionError(f"{' '.join(map(str, args))}: exit {p.returncode}, expected {expect}")
        return p

    def path(self, *parts):
        return os.path.join(self.work, *parts)
