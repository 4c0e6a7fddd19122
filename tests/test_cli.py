"""`lightning-rotor fit|validate|test|predict`: LightningCLI with rotor, on the shipped configs."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_rotor.cli import main as console_main
from lightning_rotor.lightning.cli import main

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
QUICKSTART = str(CONFIGS / "quickstart.yaml")
TINY = [  # the quickstart, shrunk to run in seconds
    "--model.init_args.model_kwargs={width: 4, num_classes: 10}",
    "--data.init_args.num_samples=64",
    "--data.init_args.batch_size=8",
    "--data.init_args.image_size=16",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--trainer.num_sanity_val_steps=0",
    "--trainer.log_every_n_steps=1",
]


def test_quickstart_fits_and_logs_rotor_scalars(tmp_path):
    code = main(
        [
            "fit",
            "--config",
            QUICKSTART,
            "--trainer.max_steps=3",
            f"--trainer.default_root_dir={tmp_path}",
            f"--trainer.logger.init_args.save_dir={tmp_path}",
            *TINY,
        ]
    )
    assert code == 0
    runs = list((tmp_path / "quickstart").glob("version_*"))
    assert len(runs) == 1
    acc = EventAccumulator(str(runs[0]), size_guidance={"scalars": 0})
    acc.Reload()
    scalars = acc.Tags()["scalars"]
    for tag in (
        "rotor/budget_bytes",
        "rotor/predicted_peak_bytes",
        "rotor/measured_peak_bytes",
        "rotor/recomputed_stages",
        "train/loss",
    ):
        assert tag in scalars, tag
    assert "rotor/model/memory_curve" in acc.Tags()["images"]
    limit = acc.Scalars("rotor/budget_bytes")[-1].value
    assert 0 < acc.Scalars("rotor/measured_peak_bytes")[-1].value <= limit
    assert (runs[0] / "config.yaml").exists()


def test_print_config_shows_the_rotor_strategy(capsys):
    assert main(["fit", "--config", QUICKSTART, "--print_config"]) == 0
    config = yaml.safe_load(capsys.readouterr().out)
    strategy = config["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_rotor.lightning.RotorStrategy"
    assert strategy["init_args"]["mem_limit"] == "75%"
    assert config["model"]["init_args"]["model"] == "resnet18"


@pytest.mark.parametrize(
    "configs", [["gpt.yaml"], ["gpt.yaml", "bf16.yaml"], ["quickstart.yaml", "ddp.yaml"], ["offload.yaml"]]
)
def test_every_config_parses(capsys, configs):
    args = [a for name in configs for a in ("--config", str(CONFIGS / name))]
    assert main(["fit", *args, "--print_config"]) == 0
    config = yaml.safe_load(capsys.readouterr().out)
    assert "Rotor" in config["trainer"]["strategy"]["class_path"]
    if "bf16.yaml" in configs:
        assert config["trainer"]["precision"] == "bf16-mixed"
    if "gpt.yaml" in configs:
        assert config["trainer"]["strategy"]["init_args"]["mem_limit"] == 0.6
    if "offload.yaml" in configs:
        init_args = config["trainer"]["strategy"]["init_args"]
        assert (init_args["offload"], init_args["host_limit"]) == ("12GB/s", "2GiB")


@pytest.mark.parametrize(
    ("extra", "value"),
    [
        (["--trainer.strategy.offload=12GB/s"], "12GB/s"),
        (["--trainer.strategy=rotor", "--trainer.strategy.offload=1.5e10"], 1.5e10),
        (["--trainer.strategy.offload=true"], True),
    ],
)
def test_offload_on_the_command_line(capsys, extra, value):
    assert main(["fit", "--config", QUICKSTART, *extra, "--print_config"]) == 0
    strategy = yaml.safe_load(capsys.readouterr().out)["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_rotor.lightning.RotorStrategy"
    assert strategy["init_args"]["offload"] == value


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--trainer.strategy.offload=fast"], "offload='fast' is neither True/False nor a bandwidth"),
        (["--trainer.strategy.host_limit=1GiB"], "host_limit='1GiB' bounds offloaded copies; give offload= too"),
        (["--trainer.strategy.offload=12GB/s", "--trainer.strategy.host_limit=10%"], "is a fraction"),
    ],
)
def test_bad_offload_is_one_line(tmp_path, capfd, extra, message):
    code = main(
        ["fit", "--config", QUICKSTART, "--trainer.max_steps=1", f"--trainer.default_root_dir={tmp_path}"]
        + extra
        + TINY
    )
    err = capfd.readouterr().err.strip()
    assert code in (1, 2) and "Traceback" not in err
    assert err.startswith("lightning-rotor: error: ") and message in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--trainer.strategy.discover=bogus"], "discover='bogus' is not a discovery method; use one of auto"),
        (["--trainer.strategy.repeats=0"], "repeats must be an integer >= 1, got 0"),
    ],
)
def test_a_refused_setting_is_one_line_naming_it(tmp_path, capfd, extra, message):
    """Any setting RotorConfig refuses is told in its own line (jsonargparse's dump of every argument was told)."""
    code = main(
        ["fit", "--config", QUICKSTART, "--trainer.max_steps=1", f"--trainer.default_root_dir={tmp_path}"] + extra
    )
    err = capfd.readouterr().err.strip()
    assert code in (1, 2) and "Traceback" not in err
    assert err.startswith("lightning-rotor: error: ") and message in err and len(err.splitlines()) == 1


def test_strategy_name_on_the_command_line(tmp_path, capsys):
    assert console_main(["fit", "--config", QUICKSTART, "--trainer.strategy=rotor", "--print_config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["trainer"]["strategy"] == "rotor"
    code = console_main(
        [
            "fit",
            "--config",
            QUICKSTART,
            "--trainer.strategy=rotor",
            "--trainer.max_steps=1",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.logger=false",
            *TINY,
        ]
    )
    assert code == 0


def test_infeasible_budget_is_one_line(tmp_path, capsys):
    code = main(
        [
            "fit",
            "--config",
            QUICKSTART,
            "--trainer.strategy.init_args.mem_limit=1KiB",
            "--trainer.max_steps=1",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.logger=false",
            *TINY,
        ]
    )
    assert code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("lightning-rotor: error:") and "smallest feasible budget" in err[-1]


@pytest.mark.parametrize("command", ["validate", "predict"])
def test_evaluation_subcommands_run_the_plain_model(tmp_path, command):
    code = console_main(
        [
            command,
            "--config",
            QUICKSTART,
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.logger=false",
            "--trainer.limit_val_batches=2",
            "--trainer.limit_predict_batches=2",
            *TINY,
        ]
    )
    assert code == 0


def _config(tmp_path, text: str) -> str:
    path = tmp_path / "extra.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "extra",
    [
        [
            "--config",
            "YAML:trainer:\n  strategy:\n    class_path: lightning_rotor.RotorStrategy\n    init_args:\n"
            "      mem_limit: lots\n",
        ],
        ["--trainer.strategy.mem_limit=lots"],
        ["--trainer.strategy=rotor", "--trainer.strategy.mem_limit=lots"],
    ],
)
def test_unparsable_budget_is_one_line(tmp_path, capfd, extra):
    extra = [_config(tmp_path, e[5:]) if e.startswith("YAML:") else e for e in extra]
    code = main(
        [
            "fit",
            "--config",
            QUICKSTART,
            "--trainer.max_steps=1",
            f"--trainer.default_root_dir={tmp_path}",
            *extra,
            *TINY,
        ]
    )
    err = capfd.readouterr().err.strip()
    assert code in (1, 2)
    assert err.startswith("lightning-rotor: error: cannot parse budget 'lots'") and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    "extra",
    [
        ["--config", "YAML:trainer:\n  strategy:\n    class_path: rotor\n    init_args:\n      mem_limit: 40%\n"],
        ["--config", "YAML:trainer:\n  strategy: rotor\n", "--trainer.strategy.mem_limit=40%"],
        ["--trainer.strategy=rotor", "--trainer.strategy.mem_limit=40%"],
        ["--trainer.strategy", "rotor", "--trainer.strategy.mem_limit=40%"],
    ],
)
def test_strategy_name_takes_nested_options(tmp_path, capsys, extra):
    extra = [_config(tmp_path, e[5:]) if e.startswith("YAML:") else e for e in extra]
    assert main(["fit", "--config", QUICKSTART, *extra, "--print_config"]) == 0
    strategy = yaml.safe_load(capsys.readouterr().out)["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_rotor.lightning.RotorStrategy"
    assert strategy["init_args"]["mem_limit"] == "40%"


def test_ddp_spawn_name_keeps_its_start_method(capsys):
    assert (
        main(
            [
                "fit",
                "--config",
                QUICKSTART,
                "--trainer.strategy=rotor_ddp_spawn",
                "--trainer.strategy.slots=400",
                "--print_config",
            ]
        )
        == 0
    )
    strategy = yaml.safe_load(capsys.readouterr().out)["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_rotor.lightning.RotorDDPStrategy"
    assert strategy["init_args"]["start_method"] == "spawn"


@pytest.mark.parametrize("loader", ["train_dataloader", "val_dataloader", "predict_dataloader"])
def test_a_data_loader_asked_before_setup_says_so_in_one_line(loader):
    from lightning_rotor.lightning.data import SyntheticImages, SyntheticTokens

    for data in (
        SyntheticImages(num_samples=8, val_samples=4, batch_size=4),
        SyntheticTokens(num_samples=8, val_samples=4, batch_size=4),
    ):
        with pytest.raises(
            RuntimeError, match=rf"^{type(data).__name__}: call setup\(\) before asking for a dataloader$"
        ):
            getattr(data, loader)()
        data.setup("fit")
        assert len(getattr(data, loader)()) > 0
