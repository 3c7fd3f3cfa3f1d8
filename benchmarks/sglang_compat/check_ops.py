#!/usr/bin/env python3
"""Check sgl_kernel's ops, as SGLang 0.5.23 uses them for a dense Llama/Qwen3 model, against torch.

What a passing run shows: on this machine's torch, with this process's `import sgl_kernel`
(for instance under LD_PRELOAD=libtorch211_compat.so), each op listed in OPS

  1. exists under torch.ops.sgl_kernel with the schema SGLang 0.5.23's Python calls it with,
  2. has a kernel registered under the dispatch key "CUDA" (a kernel under "CPU" only means
     it was built against a torch whose DispatchKey numbers differ, e.g. 2.14's CUDA == 2.11's CPU),
  3. and, on a GPU, gives the same numbers as a plain-torch reference, within the stated
     tolerance, on random inputs of Qwen3-0.6B and Llama-3-8B shapes (bf16).

It shows nothing about ops that are not listed, about other shapes and dtypes, about speed,
or about CUDA graphs. A pass on a handful of shapes doesn't prove the ABI is compatible either.

Each op runs in a child process, so one that crashes (a segfault from a TensorImpl layout
mismatch, say) is reported as such and the others still run. Report: one JSON object on stdout.

  python check_ops.py              # GPU machine: schemas, registrations and numerics
  python check_ops.py --dry-run    # any machine: import, schemas and registrations only
  python check_ops.py --force-key CPU
      # diagnosis: call the kernel that torch registered under "CPU" (2.14's CUDA number),
      # bypassing normal dispatch, to see what sgl_kernel's CUDA code does with 2.11 tensors

Only the standard library and torch are needed.
"""

import argparse
import json
import os
import subprocess
import sys
import traceback

try:
    import torch
except Exception:  # report it the same way as everything else: one JSON object
    print(json.dumps(dict(error="torch import failed: " + traceback.format_exc()[-1000:])))
    sys.exit(1)

# Model shapes (from the models' config.json): hidden size, MLP intermediate size, attention
# heads, KV heads, head dim, vocab size, RMSNorm epsilon.
MODELS = {
    "qwen3-0.6b": dict(
        hidden=1024, inter=3072, heads=16, kv_heads=8, head_dim=128, vocab=151936, eps=1e-6
    ),
    "llama-3-8b": dict(
        hidden=4096, inter=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256, eps=1e-5
    ),
}
TOKENS = [1, 33, 512]  # one decode token, an odd batch, a prefill chunk

# The ops. "path" says when SGLang 0.5.23 calls the op for a dense Llama/Qwen3 model run with
# `--attention-backend triton --sampling-backend pytorch` on CUDA, and FlashInfer not installed.
# Found by reading the 0.5.23 wheel.
# Ops that 0.5.23 handles with its own JIT kernels (sglang.kernels.*, tvm-ffi) rather than
# sgl_kernel: RoPE (apply_rope_with_cos_sin_cache_inplace), Qwen3's fused QK norm, silu_and_mul
# when the width is a multiple of the vector size. The pytorch sampling backend is plain torch.
OPS = {
    "rmsnorm": dict(
        schema="sgl_kernel::rmsnorm(Tensor($0! -> ) output, Tensor input, Tensor weight, "
        "float eps, bool enable_pdl) -> ()",
        path="yes: RMSNorm.forward_cuda without residual (layers/layernorm.py -> "
        "sgl_kernel.rmsnorm -> _rmsnorm_internal when flashinfer is absent); also "
        "Qwen3's q/k norm when the JIT fused qk-norm is not eligible",
        tol=dict(atol=2e-2, rtol=2e-2),
    ),
    "fused_add_rmsnorm": dict(
        schema="sgl_kernel::fused_add_rmsnorm(Tensor($0! -> ) input, Tensor($1! -> ) residual, "
        "Tensor weight, float eps, bool enable_pdl) -> ()",
        path="yes: RMSNorm.forward_cuda with residual (every decoder layer, final norm)",
        tol=dict(atol=2e-2, rtol=2e-2),
    ),
    "silu_and_mul": dict(
        schema="sgl_kernel::silu_and_mul(Tensor($0! -> ) out, Tensor input) -> ()",
        path="only if intermediate/tp is not a multiple of 16 B / itemsize (layers/activation.py "
        "_act_and_mul); otherwise the JIT kernel. Not called for these two models",
        tol=dict(atol=2e-2, rtol=2e-2),
    ),
    "top_k_renorm_probs": dict(
        schema="sgl_kernel::top_k_renorm_probs(Tensor probs, Tensor($0! -> ) renorm_probs, "
        "Tensor? maybe_top_k_arr, int top_k_val) -> ()",
        path="imported by layers/sampler.py; called only by the flashinfer sampling backend",
        tol=dict(atol=1e-5, rtol=1e-4),
    ),
    "top_p_renorm_probs": dict(
        schema="sgl_kernel::top_p_renorm_probs(Tensor probs, Tensor($0! -> ) renorm_probs, "
        "Tensor? maybe_top_p_arr, float top_p_val) -> ()",
        path="imported by layers/sampler.py; called only by the flashinfer sampling backend",
        tol=dict(atol=1e-5, rtol=1e-4),
    ),
    "apply_token_bitmask_inplace_cuda": dict(
        schema="sgl_kernel::apply_token_bitmask_inplace_cuda(Tensor logits, Tensor bitmask, "
        "Tensor? indices=None) -> ()",
        path="only for grammar-constrained requests (constrained/xgrammar_backend.py)",
        tol=dict(atol=0.0, rtol=0.0),
    ),
    "weak_ref_tensor": dict(
        schema="sgl_kernel::weak_ref_tensor(Tensor tensor) -> Tensor",
        path="only with the experimental 'breakable' CUDA-graph runner backend",
        tol=dict(atol=0.0, rtol=0.0),
    ),
}


# ------------------------------------------------------------------------------------------
# Plain-torch references (fp32 math, cast to the input dtype at the end, as the kernels do)


def ref_rmsnorm(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def ref_fused_add_rmsnorm(x, res, w, eps):
    s = x.float() + res.float()  # residual += input (sum kept in fp32)
    out = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * w.float()
    return out.to(x.dtype), s.to(res.dtype)  # (new input, new residual)


def ref_silu_and_mul(x):
    d = x.shape[-1] // 2
    a, b = x[..., :d].float(), x[..., d:].float()
    return (torch.nn.functional.silu(a) * b).to(x.dtype)


def ref_top_k_renorm(probs, k):  # probs [B, V] fp32, k [B] int
    out = torch.zeros_like(probs)
    for i in range(probs.shape[0]):
        v, idx = probs[i].topk(int(k[i]))
        out[i, idx] = v / v.sum()
    return out


def ref_top_p_renorm(probs, p):  # keep the smallest top set with mass >= p
    out = torch.zeros_like(probs)
    for i in range(probs.shape[0]):
        v, idx = probs[i].sort(descending=True)
        keep = (v.cumsum(0) - v) < p[i]  # include the token that crosses p
        out[i, idx[keep]] = v[keep] / v[keep].sum()
    return out


def ref_apply_bitmask(logits, bitmask):  # bit t%32 of word t//32 set = token t allowed
    vocab = logits.shape[-1]
    tok = torch.arange(vocab, device=logits.device)
    allowed = ((bitmask[:, tok // 32] >> (tok % 32)) & 1).bool()
    return logits.masked_fill(~allowed, float("-inf"))


# ------------------------------------------------------------------------------------------
# Per-op cases. Each yields (case_name, run_kernel() -> tensors, reference tensors).


def cases(op, device):
    g = torch.Generator(device=device).manual_seed(0)
    bf16 = torch.bfloat16

    def randn(*shape, dtype=bf16):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(dtype)

    for mname, m in MODELS.items():
        if op in ("rmsnorm", "fused_add_rmsnorm"):
            # Full hidden size, and the per-head shape of Qwen3's q/k norm fallback.
            widths = [("hidden", m["hidden"])] + (
                [("head_dim", m["head_dim"])] if op == "rmsnorm" else []
            )
            for wname, width in widths:
                for t in TOKENS:
                    rows = t * (m["heads"] if wname == "head_dim" else 1)
                    x, w = randn(rows, width), randn(width) * 0.1 + 1.0
                    name = f"{mname}/{wname}={width}/rows={rows}"
                    if op == "rmsnorm":

                        def run(x=x, w=w, eps=m["eps"]):
                            out = torch.empty_like(x)
                            call(op, out, x, w, eps, True)
                            return [out]

                        yield name, run, [ref_rmsnorm(x, w, m["eps"])]
                    else:
                        res = randn(rows, width)

                        def run(x=x, w=w, res=res, eps=m["eps"]):
                            xi, ri = x.clone(), res.clone()
                            call(op, xi, ri, w, eps, True)
                            return [xi, ri]

                        yield name, run, list(ref_fused_add_rmsnorm(x, res, w, m["eps"]))
        elif op == "silu_and_mul":
            for t in TOKENS:
                x = randn(t, 2 * m["inter"])

                def run(x=x):
                    out = torch.empty(x.shape[0], x.shape[1] // 2, device=device, dtype=x.dtype)
                    call(op, out, x)
                    return [out]

                yield f"{mname}/inter={m['inter']}/tokens={t}", run, [ref_silu_and_mul(x)]
        elif op in ("top_k_renorm_probs", "top_p_renorm_probs"):
            b, v = 4, m["vocab"]
            probs = torch.softmax(randn(b, v, dtype=torch.float32) * 3, dim=-1)
            if op == "top_k_renorm_probs":
                k = torch.tensor([1, 20, 50, 1000], device=device, dtype=torch.int32)

                def run(probs=probs, k=k):
                    out = torch.empty_like(probs)
                    call(op, probs, out, k, 0)
                    return [out]

                yield f"{mname}/vocab={v}/k={k.tolist()}", run, [ref_top_k_renorm(probs, k)]
            else:
                # Put each row's p halfway between two cumulative sums, so that the kept set is
                # unambiguous in fp32 (p is not near any cumulative sum).
                srt = probs.sort(dim=-1, descending=True).values.cumsum(-1)
                ranks = [0, 9, 99, 999]
                p = torch.stack([(srt[i, r] + srt[i, r + 1]) / 2 for i, r in enumerate(ranks)])

                def run(probs=probs, p=p):
                    out = torch.empty_like(probs)
                    call(op, probs, out, p.float(), 0.0)
                    return [out]

                yield (
                    f"{mname}/vocab={v}/keep={[r + 2 for r in ranks]}",
                    run,
                    [ref_top_p_renorm(probs, p)],
                )
        elif op == "apply_token_bitmask_inplace_cuda":
            b, v = 8, m["vocab"]
            logits = randn(b, v, dtype=torch.float32)
            words = (v + 31) // 32
            bitmask = torch.randint(
                -(2**31), 2**31 - 1, (b, words), generator=g, device=device, dtype=torch.int64
            ).to(torch.int32)

            def run(logits=logits, bitmask=bitmask):
                lg = logits.clone()
                call(op, lg, bitmask, None)
                return [lg]

            yield f"{mname}/vocab={v}/batch={b}", run, [ref_apply_bitmask(logits, bitmask)]
        elif op == "weak_ref_tensor":
            x = randn(33, m["hidden"])[:, : m["hidden"] // 2]  # a strided view

            def run(x=x):
                y = call(op, x)
                same = (
                    y.data_ptr() == x.data_ptr()
                    and y.shape == x.shape
                    and y.stride() == x.stride()
                    and y.dtype == x.dtype
                )
                return [y.clone() if same else torch.full_like(x, float("nan"))]

            yield f"{mname}/view={tuple(x.shape)}", run, [x]


FORCE_KEY = None


def call(op, *args):
    overload = getattr(torch.ops.sgl_kernel, op).default
    if FORCE_KEY:
        return overload.redispatch(
            torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, FORCE_KEY)), *args
        )
    return overload(*args)


def compare(outs, refs, tol):
    worst = 0.0
    for o, r in zip(outs, refs, strict=True):
        o, r = o.float(), r.float()
        fin = torch.isfinite(r)
        if not torch.equal(torch.isfinite(o), fin) or not torch.equal(o[~fin], r[~fin]):
            return False, float("inf")  # -inf/NaN pattern differs
        diff = (o[fin] - r[fin]).abs()
        if diff.numel():
            worst = max(worst, diff.max().item())
        if not torch.allclose(o[fin], r[fin], **tol):
            return False, worst
    return True, worst


# ------------------------------------------------------------------------------------------


def environment():
    env = dict(
        python=sys.version.split()[0],
        torch=torch.__version__,
        cuda_available=torch.cuda.is_available(),
        ld_preload=os.environ.get("LD_PRELOAD", ""),
    )
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    try:
        with open("/proc/self/maps") as f:
            env["compat_shim_loaded"] = "libtorch211_compat" in f.read()
    except OSError:
        pass
    return env


def import_sgl_kernel():
    try:
        import sgl_kernel

        return dict(
            ok=True,
            version=getattr(sgl_kernel, "__version__", "?"),
            common_ops=getattr(getattr(sgl_kernel, "common_ops", None), "__file__", "?"),
        )
    except Exception as e:  # ImportError, OSError (undefined symbol), ...
        return dict(ok=False, error=f"{type(e).__name__}: {e}"[-2000:])


def registration(op):
    name = "sgl_kernel::" + op
    schemas = [str(s) for s in torch._C._jit_get_schemas_for_operator(name)]
    r = dict(schema_found=bool(schemas), schema_matches=OPS[op]["schema"] in schemas)
    if schemas and not r["schema_matches"]:
        r["schemas"] = schemas
    if schemas:
        r["kernel_keys"] = [
            k
            for k in (
                "CUDA",
                "CPU",
                "CompositeImplicitAutograd",
                "CompositeExplicitAutograd",
                "Meta",
            )
            if torch._C._dispatch_has_kernel_for_dispatch_key(name, k)
        ]
        # a kernel CUDA tensors reach: one under "CUDA", or a composite one of torch ops
        # (standin/common_ops.py); "CPU" alone is what 2.14's CUDA number reads as on 2.11
        r["cuda_kernel"] = bool({"CUDA", "CompositeExplicitAutograd"} & set(r["kernel_keys"]))
    return r


def child(op, device):
    """Runs in a subprocess: all cases of one op. Prints one JSON line."""
    imp = import_sgl_kernel()
    if not imp["ok"]:
        print(json.dumps(dict(op=op, error="import: " + imp["error"])))
        return
    results = []
    for name, run, refs in cases(op, device):
        try:
            outs = run()
            if device == "cuda":
                torch.cuda.synchronize()
            ok, err = compare(outs, refs, OPS[op]["tol"])
            results.append(dict(case=name, ok=ok, max_abs_err=err))
        except Exception as e:
            results.append(dict(case=name, ok=False, error=f"{type(e).__name__}: {e}"[:600]))
    print(json.dumps(dict(op=op, cases=results)))


def main():
    global FORCE_KEY
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--dry-run", action="store_true", help="import and registrations only (no GPU needed)"
    )
    ap.add_argument(
        "--ops", default=",".join(OPS), help="comma-separated subset of: " + ",".join(OPS)
    )
    ap.add_argument("--force-key", choices=["CPU", "CUDA"], help="redispatch to this key's kernel")
    ap.add_argument("--timeout", type=int, default=240, help="seconds per op child process")
    ap.add_argument(
        "--device",
        default="cuda",
        help="device for the numeric checks (cpu: only to test this script's plumbing)",
    )
    ap.add_argument("--_child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    FORCE_KEY = a.force_key
    if a._child:
        child(a._child, a.device)
        return

    ops = [o for o in a.ops.split(",") if o]
    report = dict(environment=environment(), force_key=a.force_key, device=a.device)
    report["import"] = import_sgl_kernel()
    report["ops"] = {}
    for op in ops:
        entry = dict(path=OPS[op]["path"], tolerance=OPS[op]["tol"])
        if report["import"]["ok"]:
            entry.update(registration(op))
        report["ops"][op] = entry

    run_numerics = (
        not a.dry_run
        and report["import"]["ok"]
        and (report["environment"]["cuda_available"] or a.device != "cuda")
    )
    if run_numerics:
        for op in ops:
            cmd = [sys.executable, os.path.abspath(__file__), "--_child", op, "--device", a.device]
            if a.force_key:
                cmd += ["--force-key", a.force_key]
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
                last = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
                if last:
                    res = json.loads(last[-1])
                    report["ops"][op]["cases"] = res.get("cases")
                    if "error" in res:
                        report["ops"][op]["error"] = res["error"]
                else:
                    report["ops"][op]["error"] = (
                        f"child exited with {p.returncode} (signal "
                        f"{-p.returncode if p.returncode < 0 else 'none'}); "
                        f"stderr tail: {p.stderr[-800:]}"
                    )
            except subprocess.TimeoutExpired:
                report["ops"][op]["error"] = f"timeout after {a.timeout}s"
            cs = report["ops"][op].get("cases") or []
            report["ops"][op]["passed"] = (
                bool(cs) and all(c["ok"] for c in cs) and "error" not in report["ops"][op]
            )

    regs_ok = report["import"]["ok"] and all(
        e.get("schema_matches") and e.get("cuda_kernel") for e in report["ops"].values()
    )
    report["summary"] = dict(
        imported=report["import"]["ok"],
        schemas_and_cuda_kernels_ok=regs_ok,
        numerics_run=run_numerics,
        numerics_ok=(
            all(e.get("passed") for e in report["ops"].values()) if run_numerics else None
        ),
    )
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
