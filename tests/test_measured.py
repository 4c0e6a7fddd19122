"""What the callback measures in real training runs equals what the plan predicts (issue 15, points 6 and 7).

The shipped configs run through the real CLI and Trainer (shrunk to a few tiny steps); the logged
scalars are read back from the TensorBoard event files.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_rotor.lightning.cli import main

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
QUIET = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
         "--trainer.num_sanity_val_steps=0", "--trainer.log_every_n_steps=1", "--trainer.max_steps=3"]
TINY = {
    "quickstart.yaml": ["--model.init_args.model_kwargs={width: 4, num_classes: 10}", "--data.init_args.num_samples=64",
                        "--data.init_args.batch_size=8", "--data.init_args.image_size=16"],
    "gpt.yaml": ["--model.init_args.model_kwargs={vocab_size: 64, block_size: 16, n_layer: 2, n_head: 2, n_embd: 16, "
                 "dropout: 0.1}", "--data.init_args.num_samples=64", "--data.init_args.seq_len=16",
                 "--data.init_args.vocab_size=64", "--data.init_args.batch_size=4"],
}


def scalars(folder: Path) -> dict[str, list[float]]:
    runs = [p.parent for p in folder.rglob("events.out.tfevents.*")]
    assert len(runs) == 1, runs
    acc = EventAccumulator(str(runs[0]), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.parametrize("configs", [["quickstart.yaml"], ["gpt.yaml"], ["gpt.yaml", "bf16.yaml"]])
def test_measured_peak_equals_the_prediction_in_the_shipped_configs(tmp_path, configs):
    args = [a for name in configs for a in ("--config", str(CONFIGS / name))]
    assert main(["fit", *args, *TINY[configs[0]], *QUIET, f"--trainer.default_root_dir={tmp_path}",
                 f"--trainer.logger.init_args.save_dir={tmp_path}"]) == 0
    logged = scalars(tmp_path)
    measured = logged["rotor/measured_peak_bytes"]
    assert measured, "no step was measured"
    predicted = logged["rotor/predicted_peak_bytes"][-1]
    assert predicted <= logged["rotor/mem_limit_bytes"][-1]
    # the batch's targets and Lightning's logging copies are not activations (docs/memory-model.md, section 5)
    assert measured == [predicted] * len(measured)
