"""Device check: afd-compute-npu's reference backend (Layered / Mega, W8A8 / W4A8) on a GPU.

``python check_cuda_reference.py cuda > results/cuda_reference_check.json`` on a CUDA host with
afd-core, afd-weights and afd-compute-npu importable. Per scheme, token count and layer it
records whether Layered equals Mega bit for bit on the device, whether the device's output
equals the CPU's, how many elements differ and by how much, and the error against the fp32
dequantized MoE. Not a test: CI has no GPU; results and how they were obtained are in the README.
"""

import json
import sys
import time
import traceback

import torch
from afd_compute_npu import (
    FP32_TOLERANCE,
    ComputeConfig,
    LayeredCompute,
    MegaCommParams,
    MegaCompute,
    ReferenceBackend,
    fp32_dequantized_moe,
)
from afd_weights import QuantScheme, export_quantized_expert_weights

E, H, INTER, K, MAX_T = 8, 256, 128, 2, 512
SCHEMES = [
    (QuantScheme.W8A8, 0),
    (QuantScheme.W4A8_PER_CHANNEL, 0),
    (QuantScheme.W4A8_PER_GROUP, 32),
]
dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"


def weights(scheme, group, device):
    g = torch.Generator().manual_seed(11)
    src = {
        i: (
            (torch.randn(E, 2 * INTER, H, generator=g) * 0.3).to(device),
            torch.randn(E, H, INTER, generator=g).to(device),
        )
        for i in (3, 7)
    }
    return export_quantized_expert_weights(
        src, scheme=scheme, group_size=group, swiglu_limit=10.0, routed_scaling_factor=1.5
    )


def inputs(t, device):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(t, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]).to(torch.int32)
    w = torch.softmax(torch.randn(t, K, generator=g), -1).to(torch.bfloat16)
    return x.to(device), ids.to(device), w.to(device)


def run(scheme, group, device, t):
    wts = weights(scheme, group, device)
    cfg = ComputeConfig(
        max_tokens=MAX_T,
        top_k=K,
        swiglu_limit=wts.swiglu_limit,
        routed_scaling_factor=wts.routed_scaling_factor,
    )
    lay = LayeredCompute(wts, cfg, ReferenceBackend())
    mega = MegaCompute(wts, cfg, ReferenceBackend())
    mega.bind(MegaCommParams(group_name="ffn", world_size=2, rank=0, peer_ranks=(1,)))
    x, ids, w = inputs(t, device)
    out = {}
    for lid in wts.layer_ids:
        a = lay(lid, x, ids, w).clone()
        b = mega(lid, x, ids, w).clone()
        ref = fp32_dequantized_moe(wts, lid, x, ids, w)
        err = float(((a.float() - ref).abs().max() / ref.abs().max()).item())
        out[lid] = (a.cpu(), b.cpu(), err, str(a.device))
    return out


report = {
    "device": dev,
    "torch": torch.__version__,
    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    "cases": [],
}
for scheme, group in SCHEMES:
    for t in (1, 37, 512):
        case = {
            "scheme": scheme.value if hasattr(scheme, "value") else str(scheme),
            "group": group,
            "tokens": t,
        }
        try:
            t0 = time.time()
            got = run(scheme, group, dev, t)
            case["s"] = round(time.time() - t0, 2)
            cpu = run(scheme, group, "cpu", t)
            for lid, (a, b, err, where) in got.items():
                ca = cpu[lid][0]
                case[f"layer{lid}"] = {
                    "on": where,
                    "layered_eq_mega": bool(torch.equal(a, b)),
                    "eq_cpu": bool(torch.equal(a, ca)),
                    "max_abs_diff_vs_cpu": float((a.float() - ca.float()).abs().max()),
                    "max_abs_out": float(ca.float().abs().max()),
                    "n_diff": int((a != ca).sum()),
                    "n": a.numel(),
                    "max_ulps": int(
                        ((a.view(torch.int16).int() - ca.view(torch.int16).int()).abs().max())
                        if a.numel()
                        else 0
                    ),
                    "rel_err_vs_fp32": err,
                    "within_tol": err <= FP32_TOLERANCE,
                }
        except Exception as exc:
            case["error"] = f"{type(exc).__name__}: {exc}"
            case["tb"] = traceback.format_exc()[-1500:]
        report["cases"].append(case)
print(json.dumps(report, indent=1))
