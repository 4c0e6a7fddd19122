"""The GPU-like chains profiled on a real GPU: measured times beside the roofline's, for issue 28's figures.

`benchmarks/gpu_chains.py` builds the offloading chains with sizes measured on CPU and times from a
per-op roofline (a V100 in fp32). This script profiles the same models, at full depth and the same
batch, on the GPU it runs on (`profile_chain`, timed, `offload=True`), writes each chain beside the
modelled ones, and prints one table: per chain, the measured step time without recomputation against
the roofline's, and the largest difference of the size fields against the CPU-measured chain.

    python benchmarks/gpu_chain_times.py --out benchmarks/results/gpu_chains_h200   # a CUDA machine
    python benchmarks/gpu_chain_times.py --models gpt2_medium --batch 1 --depth 2 --device cpu  # a smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_chains import OUT, SPECS, sequential_stages  # noqa: E402

from lightning_rotor.budget import format_bytes  # noqa: E402
from lightning_rotor.chain import Chain  # noqa: E402
from lightning_rotor.profile import profile_chain  # noqa: E402
from lightning_rotor.simulate import no_recompute_peak  # noqa: E402

SIZES = ("out_size", "saved_size", "fwd_tmp", "bwd_tmp", "offloadable")


def profiled(name: str, device: torch.device, batch: int | None, depth: int | None, repeats: int) -> Chain:
    """The chain of `SPECS[name]` profiled on `device` with measured times."""
    spec = SPECS[name]
    torch.manual_seed(0)
    model = spec.build(depth).train().to(device)
    found = sequential_stages(model)
    x, y = spec.sample(batch or spec.batch, device)
    profile = profile_chain(
        list(found.modules),
        x,
        names=list(found.names),
        loss_tmp=lambda o: spec.loss(o, y),
        repeats=repeats,
        warmup=1,
        offload=True,
    )
    return profile.chain


def size_gap(measured: Chain, modelled: Chain) -> str:
    """The largest difference of the size fields, in bytes and relative to the no-recompute peak."""
    if measured.length != modelled.length:
        return f"{measured.length} stages against {modelled.length}"
    gap = max(
        abs(a - b) for field in SIZES for a, b in zip(getattr(measured, field), getattr(modelled, field), strict=True)
    )
    return f"{format_bytes(gap)} ({100 * gap / max(no_recompute_peak(modelled), 1):.2f}% of the peak)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(SPECS), choices=list(SPECS))
    parser.add_argument("--out", default=str(OUT.parent / "gpu_chains_measured"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=None, help="override every model's batch (smoke runs)")
    parser.add_argument("--depth", type=int, default=None, help="blocks of the transformers (smoke runs)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    what = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU"
    rows = [
        f"Profiled on {what}, torch {torch.__version__}, fp32 (TF32 {torch.backends.cuda.matmul.allow_tf32}), "
        f"{args.repeats} timing rounds: `python benchmarks/gpu_chain_times.py {' '.join(argv or sys.argv[1:])}`",
        "",
        "| chain | stages | batch | measured step, no recomputation | roofline (V100 fp32) | no-recompute peak "
        "| largest size difference to the CPU-measured chain | profile s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in args.models:
        start = time.perf_counter()
        chain = profiled(name, device, args.batch, args.depth, args.repeats)
        seconds = time.perf_counter() - start
        chain.save(out / f"{name}.json")
        modelled_path = OUT / f"{name}.json"
        modelled = Chain.load(modelled_path) if modelled_path.exists() else None
        full = args.batch is None and args.depth is None and modelled is not None
        rows.append(
            f"| {name} | {chain.length} | {args.batch or SPECS[name].batch} | {1e3 * chain.no_recompute_time():.1f} ms "
            f"| {f'{1e3 * modelled.no_recompute_time():.1f} ms' if modelled else '-'} "
            f"| {format_bytes(no_recompute_peak(chain))} | {size_gap(chain, modelled) if full else '-'} "
            f"| {seconds:.0f} |"
        )
        print(rows[-1], flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    (out / "README.md").write_text("# GPU-like chains, times measured\n\n" + "\n".join(rows) + "\n")
    print(json.dumps({"written": str(out)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
