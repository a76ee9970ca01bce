"""What the Python comparisons with transformers share: a scratch folder, checks that collect
failures, commands run with their output shown when they fail, fsdpp's logits through the probe,
and the checkpoints' tensors and runs' losses."""
import json
import os
import subprocess
import tempfile

import torch
from safetensors.torch import load_file, save_file


def randomize(model, std=0.15, norm_spread=0.2):
    """Weights from N(0, std) and norm gains from 1 + N(0, norm_spread): far from an initialisation's
    zeros and ones, so that every tensor's place shows in the logits."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + norm_spread * torch.randn_like(p))
            else:
                p.normal_(0, std)


def tensors_of(directory):
    """Every tensor of a directory's safetensors files."""
    out = {}
    for f in sorted(os.listdir(directory)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, f)))
    return out


def first_loss(run_dir):
    """The first training loss rank 0 recorded."""
    with open(os.path.join(run_dir, "metrics", "rank0.jsonl")) as f:
        for line in f:
            record = json.loads(line)
            if "loss" in record:
                return record["loss"]
    raise AssertionError(f"no loss in {run_dir}")


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

    def probe_logits(self, probe, model_path, tokens):
        """fsdpp's logits for `tokens` from any model path it loads (tests/train/hf_probe.cpp)."""
        src, out = self.path("tokens.safetensors"), self.path("logits.safetensors")
        save_file({"tokens": tokens.contiguous()}, src)
        self.run(probe, model_path, src, out)
        return load_file(out)["logits"]
