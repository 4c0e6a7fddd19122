"""Profile a GPT chain and, per block, the selective-checkpointing option (chain version 5).

Option 1 of each block records only the outputs of matmuls and attention (torch's selective
activation checkpointing with `lightning_rotor.selective`'s policy) and recomputes the rest in its
backward. Measured on CPU with `MemoryProbe` (exact live storages, `selective.measure_sac_memory`):

- `saved_size`: bytes alive after the forward under the contexts (output included, input not),
- `fwd_tmp`: the forward's peak above that,
- `bwd_tmp`: the backward's peak above `saved + δ_{k+1} + s_k` with the output kept alive
  (`out_free` 0: what the model charges then),
- times: medians of `--repeats` runs, scaled by the profiled chain's time of the same stage over the
  median of plain recording runs timed the same way (so option 0 and option 1 share one clock).

    python benchmarks/options_profile.py examples/gpt_tiny_options.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lightning_rotor.chain import Chain, StageOption
from lightning_rotor.models.gpt import Block, gpt
from lightning_rotor.profile import profile_chain
from lightning_rotor.selective import measure_sac_memory, run_selective


def run_once(forward, stage, x):
    """(forward seconds, backward seconds) of one recorded run and its backward."""
    x = x.detach().requires_grad_()
    start = time.perf_counter()
    out = forward(stage, x)
    mid = time.perf_counter()
    out.backward(torch.ones_like(out))
    return mid - start, time.perf_counter() - mid


def measure_option(stage, x, s_in, repeats):
    saved, fwd_tmp, bwd_tmp = measure_sac_memory(stage, x, s_in)
    plain = [run_once(lambda s, v: s(v), stage, x) for _ in range(repeats)]
    sac = [run_once(run_selective, stage, x) for _ in range(repeats)]
    stage.zero_grad(set_to_none=True)
    ratio_f = statistics.median(t[0] for t in sac) / statistics.median(t[0] for t in plain)
    ratio_b = statistics.median(t[1] for t in sac) / statistics.median(t[1] for t in plain)
    return saved, fwd_tmp, bwd_tmp, ratio_f, ratio_b


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--embd", type=int, default=128)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = gpt(vocab_size=512, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.embd, dropout=0.0)
    stages = [model.embed, *model.blocks, model.ln_f, model.lm_head]
    names = ["embed", *(f"blocks.{i}" for i in range(args.layers)), "ln_f", "lm_head"]
    idx = torch.randint(0, 512, (args.batch, args.seq))
    chain = profile_chain(stages, idx, names=names, repeats=args.repeats).chain
    options: list[list[StageOption]] = []
    with torch.no_grad():
        values = [idx]
        for stage in stages:
            values.append(stage(values[-1]))
    for k, stage in enumerate(stages):
        if not isinstance(stage, Block):
            options.append([])
            continue
        saved, fwd_tmp, bwd_tmp, rf, rb = measure_option(stage, values[k], chain.sizes[k], args.repeats)
        options.append(
            [
                StageOption(
                    saved_size=saved,
                    fwd_time=chain.fwd_time[k] * rf,
                    bwd_time=chain.bwd_time[k] * rb,
                    fwd_tmp=fwd_tmp,
                    bwd_tmp=bwd_tmp,
                    name="sac: save mm/bmm/addmm/attention outputs",
                )
            ]
        )
        print(
            f"{names[k]}: all saves {chain.saved_size[k]} B, sac saves {saved} B; "
            f"sac forward x{rf:.2f}, backward x{rb:.2f}"
        )
    Chain(**{**chain.__dict__, "options": options}).save(args.out)


if __name__ == "__main__":
    main()
