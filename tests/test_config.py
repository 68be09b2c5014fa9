"""Run-config validation: every bad value fails before training with one line naming it."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import tomllib

from fedskew.config import ConfigError, all_params, parse_overrides, to_toml, validate
from tests.conftest import ROOT


def test_defaults_validate_and_pyproject_matches_schema() -> None:
    cfg = validate({})
    assert cfg["method"] == "fedavg" and cfg["dataset"] == "fashion-mnist"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert pyproject == tomllib.loads(to_toml(all_params())), "pyproject's run config must equal the schema"
    assert validate(pyproject) == cfg


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ({"method": "fedfoo"}, "method='fedfoo' is not allowed: must be one of"),
        ({"dataset": "imagenet"}, "dataset='imagenet'"),
        ({"model": "gpt"}, "model='gpt'"),
        (
            {"method": "fedrs", "classifier-bias": True},
            "classifier-bias=True is not allowed: method 'fedrs' reads the classifier's class vectors; a bias is "
            "for: fedavg, fedprox, fedavgm, scaffold, fednova",
        ),
        ({"input-scaling": "none"}, "input-scaling='none' is not allowed: must be one of 'standardise', 'unit'"),
        ({"partition": "weird"}, "partition='weird'"),
        ({"fedrs-alpha": 1.5}, "fedrs-alpha=1.5 is not allowed: must be a float in [0, 1]"),
        ({"fedrs-alpha": -0.1}, "fedrs-alpha=-0.1"),
        ({"fraction-train": 0.0}, "fraction-train=0.0 is not allowed: must be a float in (0, 1]"),
        ({"fraction-train": 1.01}, "fraction-train=1.01"),
        ({"classes-per-client": 11}, "classes-per-client=11 is not allowed: fashion-mnist has 10 classes"),
        ({"classes-per-client": 3, "classes-per-client-mode": "shards"}, "must divide"),
        ({"num-server-rounds": "ten"}, "num-server-rounds='ten' has type str: must be a int"),
        ({"lr": True}, "lr=True has type bool"),
        ({"num-server-rounds": 2.5}, "num-server-rounds=2.5"),
        ({"dataset": 3}, "quote strings"),
        ({"lr": float("nan")}, "lr=nan"),
        ({"device": "tpu"}, "device='tpu'"),
        ({"learning-rate": 0.1}, "learning-rate: unknown run-config key"),
        ({"num-server-round": 3}, "did you mean 'num-server-rounds'"),
    ],
)
def test_bad_values_fail_with_one_clear_line(raw: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate(raw)
    msg = str(info.value)
    assert needle in msg and "\n" not in msg


def test_types_are_coerced_where_safe() -> None:
    cfg = validate({"lr": 1, "num-server-rounds": 3.0})
    assert cfg["lr"] == 1.0 and isinstance(cfg["lr"], float)
    assert cfg["num-server-rounds"] == 3 and isinstance(cfg["num-server-rounds"], int)


def test_parse_overrides_matches_flwr_syntax() -> None:
    assert parse_overrides('method="fedrs" fedrs-alpha=0.5 num-server-rounds=3 run-name="a b"') == {
        "method": "fedrs",
        "fedrs-alpha": 0.5,
        "num-server-rounds": 3,
        "run-name": "a b",
    }
    with pytest.raises(ConfigError, match="quote strings"):
        parse_overrides("method=fedrs")
    with pytest.raises(ConfigError, match="expected key=value"):
        parse_overrides("method")


def test_fuzzed_configs_fail_cleanly() -> None:
    """Random keys, types and ranges: either a valid config or a one-line ConfigError, never another error."""
    rnd = random.Random(0)
    params = all_params()
    values = [0, 1, -1, 2.5, -3.0, 1e9, float("inf"), "", "x", "fedrs", True, False, [1], {"a": 1}, None, 11]
    for _ in range(2000):
        raw = {}
        for _ in range(rnd.randint(1, 4)):
            key = rnd.choice([*params, "bogus-key", "", "seed "])
            raw[key] = rnd.choice([*values, params[key].default] if key in params else values)
        try:
            validate(raw)
        except ConfigError as e:
            assert str(e) and "\n" not in str(e)


def test_cli_rejects_bad_value_fast_with_one_line(tmp_path) -> None:
    """Rejected before anything of Flower starts: its home folder (config.toml, SuperLink state) is
    never created (not a timing: these machines are shared)."""
    home = tmp_path / "flwr-home"
    res = subprocess.run(
        [sys.executable, "-m", "fedskew.cli", "run", "-c", 'fedrs-alpha=2.0 method="fedrs"'],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "FLWR_HOME": str(home)},
        timeout=120,
    )
    assert not home.exists()
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "fedrs-alpha=2.0" in lines[0], res.stderr


def test_cli_rejects_impossible_partition_before_starting_flower() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "fedskew.cli", "run", "-n", "3"], capture_output=True, text=True, cwd=ROOT
    )
    assert res.returncode == 2 and "no client" in res.stderr


# ---------------------------------------------------------------------- up front, before any SuperLink
def write_run_dir(folder, config: str, partition: str | None = json.dumps({"train": [[1]] * 20})):
    """A stopped run's folder as `fedskew run --resume` reads it."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(config)
    (folder / "checkpoint.pt").write_bytes(b"")
    if partition is not None:
        (folder / "partition.json").write_text(partition)
    return folder


def write_evil_cifar(root):
    import pickle

    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (folder / name).write_bytes(pickle.dumps({b"data": print, b"labels": [1]}))
    return root


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["-n", "0"], "--num-supernodes"),
        (["-j", "0"], "--actors"),
        (["-c", "seed=9223372036854775808"], "seed=9223372036854775808"),
        (["-c", "num-server-rounds=1e20"], "num-server-rounds="),
        (["-c", 'method="fedmr" fedmr-private-classes="abc"'], "fedmr-private-classes='abc'"),
        (["-c", 'device="cuda"'], "CUDA"),
        (["-c", 'device="cuda:0"'], "CUDA"),
        (["-c", 'run-name="../x"'], "run-name='../x'"),
        (["-c", 'run-name="/tmp/x"'], "run-name='/tmp/x'"),
        (["-c", 'data-root="{tmp}/missing"'], "missing"),
        (["-c", 'data-root="{tmp}/file"'], "not a folder"),
        (["-c", 'dataset="cifar10" data-root="{tmp}/evil"'], "refusing"),
        (["--resume", "{tmp}/notjson"], "config.json"),
        (["--resume", "{tmp}/list"], "config.json"),
        (["--resume", "{tmp}/badtype"], "seed='x'"),
        (["--resume", "{tmp}/nopartition"], "partition.json"),
        (["--resume", "{tmp}/badpartition"], "partition.json"),
        (["--resume", "{tmp}/lenet", "-c", 'model="mlp"'], "model='mlp'"),
        (["--resume", "{tmp}/lenet", "-c", 'method="fedrs"'], "method='fedrs'"),
    ],
)
def test_cli_refuses_up_front_with_one_line(tmp_path, monkeypatch, capsys, args: list[str], needle: str) -> None:
    """Each fails with one line and exit 2, before any SuperLink starts (`no_superlink`)."""
    import torch

    from fedskew import cli

    def no_superlink(*a, **k):
        raise AssertionError("a SuperLink was started")

    monkeypatch.setattr(cli, "run_simulation", no_superlink)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    (tmp_path / "file").write_text("x")
    write_evil_cifar(tmp_path / "evil")
    write_run_dir(tmp_path / "notjson", "{not json")
    write_run_dir(tmp_path / "list", "[1, 2]")
    write_run_dir(tmp_path / "badtype", '{"seed": "x"}')
    write_run_dir(tmp_path / "nopartition", "{}", partition=None)
    write_run_dir(tmp_path / "badpartition", "{}", partition='{"train": 5}')
    write_run_dir(tmp_path / "lenet", '{"model": "lenet", "method": "fedavg"}')
    code = cli.main(["run", *[a.replace("{tmp}", str(tmp_path)) for a in args]])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and needle in err[0], err


def test_fedskew_config_lists_every_method_with_its_paper(capsys: pytest.CaptureFixture[str]) -> None:
    from fedskew.cli import main
    from fedskew.registry import METHODS

    assert main(["config"]) == 0
    out = capsys.readouterr().out.splitlines()
    method_line = next(line for line in out if line.startswith("method "))
    assert "[one of " + ", ".join(METHODS) + "]" in method_line
    listed = {line.split()[0]: line for line in out if line.startswith("  ")}
    for name, spec in METHODS.items():
        assert spec.paper, f"method {name} names no paper (registry: _m(..., paper=...))"
        assert spec.paper in listed[name], f"fedskew config does not show {name}'s paper"
