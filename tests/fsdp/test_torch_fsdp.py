"""fsdpp's fully_shard against PyTorch's own FSDP2 (torch.distributed.fsdp.fully_shard), world 2
over Gloo, both started by `fsdpp launch`: the same model (tests/fsdp/torch_moe.py is fsdpp's MoE
transformer in PyTorch), the same initial weights and batches (one safetensors file both read), 10
AdamW steps. Compares every step's loss and every final parameter.

    test_torch_fsdp.py FSDPP_CLI FSDPP_TEST_FSDP_STEPS
    test_torch_fsdp.py --torch-rank CASE OUT      (one rank of PyTorch's side, under fsdpp launch)

Setups:
  f32-moe      the tiny MoE config (configs/tiny.json), float32
  f32-dense    the same without experts (a plain transformer), float32
  bf16-keep    param_dtype bfloat16, reduce_dtype float32, router gates and norms kept in float32
               (fsdpp: param_dtype_override; PyTorch: param_dtype_override_fn)
  bf16-accum   as bf16-keep with reduce_dtype unset, over 3 microbatches, a float32 grad_dtype on
               the router gates and norms and none on the rest: PyTorch 2.15 accumulates every
               unsharded gradient in its parameter's own dtype (float32) then, and reduces in
               float32; fsdpp must too. Switched off: the other parameters accumulating in their
               compute dtype (bfloat16), as before 2.15.
  bf16-reduce  as bf16-accum with reduce_dtype bfloat16, which 2.15 makes the accumulation dtype
               of every parameter, the float32 grad_dtype ones included. Switched off:
               reduce_dtype float32.

PyTorch's side runs each setup twice: with torch.optim.AdamW's default (for-loop) update, and with
torch.optim.AdamW(fused=True), ATen's fused CPU kernel, which fsdp::AdamW runs on the CPU. Checks:
  - float32 with torch.optim.AdamW: within 1e-5 relative (losses, and |a - b| / |b| per parameter).
  - every setup with torch.optim.AdamW(fused=True): bitwise equal, losses and parameters. This is the
    bfloat16 bound and why it is zero: both sides run the same LibTorch kernels, and a bfloat16
    rounding is a function of its float32 input alone (round to nearest even), so equal float32
    values can only round to equal bfloat16 values. Any difference in what is computed in which
    dtype does show: the bound is tight.
  - the bfloat16 setups with the feature switched off on fsdpp's side only (the override; the
    float32 accumulation) against PyTorch with it on: must differ.
With the for-loop torch.optim.AdamW, bfloat16 setups are reported, not checked: its update rounds
differently from the fused kernel's (separate operations, each rounded to float32), and bfloat16
compute turns such one-ulp float32 differences into bfloat16 roundings that differ after a few
steps.
FSDPP_VERBOSE=1 prints every step's losses.
"""
import fnmatch
import json
import os
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_moe  # noqa: E402

STEPS = 10
SEQ = 32
GLOBAL_BATCH = 8
CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "configs", "tiny.json")
KEEP_FLOAT32 = ["*.router.gate.weight", "*norm*"]
F32_BOUND = 1e-5
VERBOSE = bool(os.environ.get("FSDPP_VERBOSE"))


def torch_rank(case_path, out_path):
    """One rank of PyTorch's side, started by `fsdpp launch` (env:// from its variables)."""
    import torch.distributed as dist
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    with safe_open(case_path, "pt") as f:
        meta = f.metadata()
    config, case = json.loads(meta["fsdpp.model_config"]), json.loads(meta["fsdpp.case"])
    tensors = load_file(case_path)
    batches = tensors.pop("batches")
    model = torch_moe.MoETransformer(config)
    model.load_state_dict(tensors, strict=True)

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, None: None}
    keep = {id(p) for n, p in model.named_parameters()
            if any(fnmatch.fnmatchcase(n, g) for g in case.get("float32_params", []))}
    for n, p in model.named_parameters():
        for pattern, dtype in case.get("grad_dtype_params", []):
            if fnmatch.fnmatchcase(n, pattern):
                p.grad_dtype = dtypes[dtype]
                break
    policy = MixedPrecisionPolicy(
        param_dtype=dtypes[case.get("param_dtype")], reduce_dtype=dtypes[case.get("reduce_dtype")],
        param_dtype_override_fn=(lambda p: torch.float32 if id(p) in keep else None) if keep else None)
    for block in model.layers:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)

    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": case["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=case["lr"], betas=tuple(case["betas"]), eps=case["eps"],
                            **({"fused": True} if case.get("optimizer") == "fused" else {"foreach": False}))
    steps, micro, global_batch = batches.shape[:3]
    local = global_batch // world
    losses = torch.zeros(steps, dtype=torch.float64)
    for s in range(steps):
        opt.zero_grad(set_to_none=False)
        total = 0.0
        for j in range(micro):
            model.set_requires_gradient_sync(j + 1 == micro)
            rows = batches[s, j, rank * local:(rank + 1) * local]
            logits, aux = model(rows[:, :-1])
            loss = torch_moe.lm_loss(logits, rows[:, 1:])
            ((loss + aux) / micro if aux is not None else loss / micro).backward()
            total += loss.item()
        opt.step()
        mean = torch.tensor([total / (micro * world)], dtype=torch.float64)
        dist.all_reduce(mean)
        losses[s] = mean[0]
    full = {n: p.full_tensor().contiguous() for n, p in model.named_parameters()}
    if rank == 0:
        full["losses"] = losses
        save_file(full, out_path)
    # Both ranks leave together: a rank tearing its group down while the other still uses it can
    # abort at exit.
    dist.barrier()
    dist.destroy_process_group()


def write_case(path, config, weights, batches, case):
    from safetensors.torch import save_file
    tensors = {n: t.contiguous() for n, t in weights.items()}
    tensors["batches"] = batches
    save_file(tensors, path, metadata={"fsdpp.model_config": json.dumps(config), "fsdpp.case": json.dumps(case)})


def launch(fsdpp, command, log):
    # MKL's own choice of kernels on both sides, as in this PyTorch process (Note [MKL's kernels on
    # other vendors' CPUs], include/fsdpp/base/mkl_dispatch.hpp: fsdpp_test_fsdp_steps does not ask
    # for others; the variable keeps it so should that change).
    env = {**os.environ, "FSDPP_MKL_VENDOR_CHECK": "1"}
    r = subprocess.run([fsdpp, "launch", "--nproc", "2", "--"] + command, capture_output=True, text=True, timeout=600,
                       env=env)
    with open(log, "w") as f:
        f.write(r.stdout + r.stderr)
    if r.returncode != 0:
        sys.stdout.write(r.stdout[-3000:] + r.stderr[-3000:])
        raise SystemExit(f"FAILED: {' '.join(command[:2])} exited with {r.returncode} (log {log})")


def compare(a_path, b_path):
    """The largest relative loss difference, and the parameter with the largest relative difference
    (|a - b| / |b| over the whole tensor)."""
    from safetensors.torch import load_file
    a, b = load_file(a_path), load_file(b_path)
    if set(a) != set(b):
        raise SystemExit(f"FAILED: different tensors: {sorted(set(a) ^ set(b))}")
    la, lb = a.pop("losses"), b.pop("losses")
    loss = ((la - lb).abs() / lb.abs()).max().item()
    worst, name = 0.0, ""
    for n in a:
        d = ((a[n].double() - b[n].double()).norm() / b[n].double().norm()).item()
        if d > worst:
            worst, name = d, n
    return loss, name, worst, la.tolist(), lb.tolist()


def main():
    if sys.argv[1] == "--torch-rank":
        torch_rank(sys.argv[2], sys.argv[3])
        torch_moe.exit_rank()
    fsdpp, steps_bin = sys.argv[1], sys.argv[2]
    # fsdpp's side computes RMSNorm and SwiGLU by the ATen compositions PyTorch's modules are
    # written as, and its products by ATen's (its single-pass kernels and MKL's bfloat16 products
    # round differently: tests/models/test_model.cpp and test_matmul.cpp bound that).
    base = {**json.load(open(CONFIG)), "fused_kernels": False, "own_products": False}
    configs = {"moe": base, "dense": {**base, "experts": 0}}
    torch.manual_seed(1234)
    weights = {name: torch_moe.MoETransformer(c).state_dict() for name, c in configs.items()}
    g = torch.Generator().manual_seed(99)
    # Batches: windows of this file's own bytes (text a model learns from in a few steps, which
    # changes only with the test: the for-loop AdamW comparison's difference depends on the data).
    text = torch.tensor(list(open(os.path.abspath(__file__), "rb").read()), dtype=torch.int64)
    opt = {"lr": 3e-3, "weight_decay": 0.1, "betas": [0.9, 0.95], "eps": 1e-8}
    f32 = {**opt, "param_dtype": None, "reduce_dtype": None}
    keep = {**opt, "param_dtype": "bfloat16", "reduce_dtype": "float32", "float32_params": KEEP_FLOAT32}
    accum = {**opt, "param_dtype": "bfloat16", "reduce_dtype": None, "float32_params": KEEP_FLOAT32,
             "grad_dtype_params": [[g, "float32"] for g in KEEP_FLOAT32]}
    reduce_bf16 = {**accum, "reduce_dtype": "bfloat16"}
    setups = [  # name, model, microbatches, policy, fsdpp's policy with the feature switched off
        ("f32-moe", "moe", 1, f32, None),
        ("f32-dense", "dense", 1, f32, None),
        ("bf16-keep", "moe", 1, keep, ("without the float32 override", {**keep, "float32_params": []})),
        ("bf16-accum", "moe", 3, accum, ("accumulating the rest in bfloat16",
                                         {**accum, "grad_dtype_params": accum["grad_dtype_params"] + [["*", "bfloat16"]]})),
        ("bf16-reduce", "moe", 3, reduce_bf16, ("reducing in float32", {**reduce_bf16, "reduce_dtype": "float32"})),
    ]
    failures = []

    def report(label, result, check, why):
        loss, name, param, lf, lt = result
        print(f"{label}: losses {lt[0]:.5f} -> {lt[-1]:.5f}; largest relative difference: loss {loss:.2e}, "
              f"parameter {param:.2e}{f' ({name})' if name else ''}")
        if VERBOSE:
            print("  fsdpp  ", " ".join(f"{x:.7f}" for x in lf))
            print("  pytorch", " ".join(f"{x:.7f}" for x in lt))
        if not check(loss, param):
            failures.append(f"{label}: {why}")

    with tempfile.TemporaryDirectory() as work:
        for i, (label, model, micro, policy, off) in enumerate(setups):
            starts = torch.randint(0, len(text) - SEQ - 1, (STEPS, micro, GLOBAL_BATCH, 1), generator=g)
            batches = text[starts + torch.arange(SEQ + 1)]

            def run(side, case, tag):
                case_path = os.path.join(work, f"{i}.{tag}.case.safetensors")
                out = os.path.join(work, f"{i}.{tag}.out.safetensors")
                write_case(case_path, configs[model], weights[model], batches, case)
                command = ([sys.executable, os.path.abspath(__file__), "--torch-rank", case_path, out]
                           if side == "torch" else [steps_bin, case_path, out])
                launch(fsdpp, command, os.path.join(work, f"{i}.{tag}.log"))
                return out

            mine = run("fsdpp", policy, "fsdpp")
            torch_adamw = run("torch", policy, "torch-adamw")
            torch_fused = run("torch", {**policy, "optimizer": "fused"}, "torch-fused")
            label = f"{label}, {micro} microbatch{'es' if micro > 1 else ''}"
            if policy["param_dtype"] is None:
                report(f"{label}, torch.optim.AdamW", compare(mine, torch_adamw),
                       lambda loss, param: max(loss, param) <= F32_BOUND, f"outside {F32_BOUND:g}")
            else:
                report(f"{label}, torch.optim.AdamW (reported, not checked)", compare(mine, torch_adamw),
                       lambda loss, param: True, "")
            report(f"{label}, torch.optim.AdamW(fused=True)", compare(mine, torch_fused),
                   lambda loss, param: loss == 0 and param == 0, "not bitwise equal")
            if off:
                report(f"{label}, fsdpp {off[0]}, torch.optim.AdamW(fused=True)",
                       compare(run("fsdpp", off[1], "fsdpp-off"), torch_fused),
                       lambda loss, param: loss > 0 and param > 0, "equal although a feature is off on one side")
    for f in failures:
        print("FAILED:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
