"""Gradients as a user sees them, fsdpp's fully_shard beside PyTorch 2.15's, world 2 over Gloo, both
started by `fsdpp launch`: the model of tests/fsdp/grad_probe.cpp (four linear layers, one for each
of 2.15's gradient dtype rules: a bfloat16 parameter with a float32 grad_dtype, a float32 parameter
computing in float32 with a bfloat16 grad_dtype, a float32 parameter computing in bfloat16 with
grad_dtype none, and one with it unset), the first layer a unit of its own, the rest the root, one step of 3 microbatches with
gradient sync on the last. Each rank records the unsharded parameters' .grad after every
microbatch, what a hook on each unsharded parameter receives, and the sharded .grad after the
reduce-scatter; everything must be equal, dtype and bits, with reduce_dtype unset and bfloat16.

    test_torch_grads.py FSDPP_CLI FSDPP_TEST_GRAD_PROBE
    test_torch_grads.py --torch-rank CASE OUT_PREFIX   (one rank of PyTorch's side)
"""
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_torch_fsdp import launch  # noqa: E402
import torch_moe  # noqa: E402

MICRO, BATCH = 3, 4
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, None: None}


class Probe(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l0, self.l1 = torch.nn.Linear(6, 8), torch.nn.Linear(8, 8)
        self.l2, self.l3 = torch.nn.Linear(8, 4), torch.nn.Linear(4, 3)
        self.l0.to(torch.bfloat16)

    def forward(self, x):
        h = torch.tanh(self.l0(x.to(self.l0.weight.dtype)))
        h = torch.tanh(self.l1(h.to(self.l1.weight.dtype)))
        h = torch.tanh(self.l2(h.to(self.l2.weight.dtype)))
        return self.l3(h.to(self.l3.weight.dtype)).float()


def torch_rank(case_path, out_prefix):
    import torch.distributed as dist
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    with safe_open(case_path, "pt") as f:
        case = json.loads(f.metadata()["fsdpp.case"])
    tensors = load_file(case_path)
    inputs, targets = tensors.pop("inputs"), tensors.pop("targets")
    model = Probe()
    model.load_state_dict(tensors, strict=True)
    for name, p in model.named_parameters():
        if name.startswith("l0."):
            p.grad_dtype = torch.float32
        elif name.startswith("l1."):
            p.grad_dtype = torch.bfloat16
        elif name.startswith("l2."):
            p.grad_dtype = None
    keep = {id(p) for p in model.l1.parameters()}
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=DTYPES[case["reduce_dtype"]],
                                  param_dtype_override_fn=lambda p: torch.float32 if id(p) in keep else None)
    fully_shard(model.l0, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    fsdp_params = [fp for m in (model.l0, model) for fp in m._get_fsdp_state()._fsdp_param_group.fsdp_params]

    out, microbatch, hooked = {}, [0], False
    local = inputs.size(1) // world
    for j in range(MICRO):
        microbatch[0] = j
        model.set_requires_gradient_sync(j + 1 == MICRO)
        x, y = inputs[j, rank * local:(rank + 1) * local], targets[j, rank * local:(rank + 1) * local]
        loss = (model(x) - y).pow(2).mean() / MICRO
        if not hooked:  # the unsharded parameters exist from the first forward on
            for fp in fsdp_params:
                fp._unsharded_param.register_hook(
                    lambda g, name=fp._param_fqn: out.__setitem__(f"hook{microbatch[0]}.{name}", g.detach().clone()))
            hooked = True
        loss.backward()
        for fp in fsdp_params:
            if fp._unsharded_param.grad is not None:
                out[f"mb{j}.{fp._param_fqn}"] = fp._unsharded_param.grad.clone()
    for name, p in model.named_parameters():
        if p.grad is not None:
            out[f"sharded.{name}"] = p.grad.to_local().clone()
    save_file({k: v.contiguous() for k, v in out.items()}, f"{out_prefix}{rank}.safetensors")
    dist.barrier()
    dist.destroy_process_group()


def compare(a_path, b_path):
    """The differences between two ranks' records, as lines."""
    from safetensors.torch import load_file
    a, b = load_file(a_path), load_file(b_path)
    problems = [f"{k}: only {'fsdpp' if k in a else 'PyTorch'} has it" for k in sorted(set(a) ^ set(b))]
    for k in sorted(set(a) & set(b)):
        if a[k].dtype != b[k].dtype:
            problems.append(f"{k}: fsdpp {a[k].dtype}, PyTorch {b[k].dtype}")
        elif not torch.equal(a[k], b[k]):
            problems.append(f"{k}: values differ by up to {(a[k].double() - b[k].double()).abs().max().item():.3g}")
    return problems, sorted(a)


def main():
    if sys.argv[1] == "--torch-rank":
        torch_rank(sys.argv[2], sys.argv[3])
        torch_moe.exit_rank()
    fsdpp, probe_bin = sys.argv[1], sys.argv[2]
    from safetensors.torch import save_file
    torch.manual_seed(7)
    weights = Probe().state_dict()
    inputs, targets = torch.randn(MICRO, BATCH, 6), torch.randn(MICRO, BATCH, 3)
    failures = 0
    with tempfile.TemporaryDirectory() as work:
        for reduce_dtype in [None, "bfloat16"]:
            case = os.path.join(work, f"case-{reduce_dtype}.safetensors")
            save_file({**{k: v.contiguous() for k, v in weights.items()}, "inputs": inputs, "targets": targets}, case,
                      metadata={"fsdpp.case": json.dumps({"reduce_dtype": reduce_dtype})})
            sides = {}
            for side, command in [("fsdpp", [probe_bin]),
                                  ("torch", [sys.executable, os.path.abspath(__file__), "--torch-rank"])]:
                prefix = os.path.join(work, f"{side}-{reduce_dtype}-rank")
                launch(fsdpp, command + [case, prefix], os.path.join(work, f"{side}-{reduce_dtype}.log"))
                sides[side] = prefix
            for rank in range(2):
                problems, keys = compare(f"{sides['fsdpp']}{rank}.safetensors", f"{sides['torch']}{rank}.safetensors")
                print(f"reduce_dtype {reduce_dtype}, rank {rank}: {len(keys)} gradients recorded, "
                      f"{len(problems)} differences")
                for p in problems:
                    print("  FAILED:", p)
                failures += len(problems)
                if not any(k.startswith("mb1.") for k in keys) or not any(k.startswith("sharded.") for k in keys):
                    print("  FAILED: no unsharded gradient after microbatch 1, or no sharded gradient")
                    failures += 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
