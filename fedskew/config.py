"""Run-config schema and validation, shared by the CLI, the ServerApp and the ClientApp.

Every key a user can set lives here (common keys) or on the method's card
(`fedskew/methods/<name>.py`, keys prefixed by the method name). Validation turns the raw
`context.run_config` (TOML types) into a plain dict of checked, typed values, or raises
`ConfigError` with one line naming the key, the value and what is allowed.
The types, `Param` and `ConfigError`, are `fedskew.schema`'s (a module that imports nothing of
fedskew, below the cards); `ConfigError` is importable from here too, beside `validate`.

Keys whose value sets how much is allocated or how long a loop runs have an upper bound where a
larger value can only be a mistake (an 8 TB allocation or a client that never ends its round,
found only after the run started): `local-epochs`, `map-personal-epochs`, `ditto-personal-epochs`,
`fedrep-head-epochs` and `fedbabu-finetune-epochs` at most 1000,
`num-server-rounds` 100,000, `round-retries` 100, `torch-threads` 1024 (and, in a simulation, a
few times the cores: `fedskew.resources`), `hf-image-size` 1024, `map-sigma` 5, and MuPFL's
`features-per-class` 1000, `tau` 1000, `match-iters` 10,000, MAP's `mmd-kernels` 64 (the reasons
in their help texts); `round-timeout` is at least 1 s.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from fedskew.data import DATASET_INFO, HF_PREFIX, is_hf
from fedskew.registry import METHODS
from fedskew.schema import ConfigError, Param, parse_bindings

DATASETS = ("fashion-mnist", "mnist", "cifar10", "cifar100", "svhn")
AUGMENTATIONS = ("auto", "none", "crop", "crop-flip")
MODELS = ("lenet", "map-lenet", "mupfl-cnn", "pfl-cnn", "pfllib-cnn", "mlp", "tfcnn", "vgg11", "resnet8", "resnet18")
PARTITIONS = ("iid", "dirichlet", "classes-per-client", "long-tail", "map-random")


def folder_name_rule(value: str, cfg: dict[str, Any]) -> None:
    """A `Param.rule`: one folder name, so that results stay inside out-dir."""
    if value in (".", "..") or any(c in value for c in "/\\\0"):
        raise ValueError("must be one folder name (no '/', '\\', '.' or '..')")


def path_rule(value: str, cfg: dict[str, Any]) -> None:
    """A `Param.rule`: a path the file system can hold (no NUL character)."""
    if "\0" in value:
        raise ValueError("a path holds no NUL character")


def bindings_rule(value: str, cfg: dict[str, Any]) -> None:
    """A `Param.rule`: `partition-bindings` pairs node ids with partitions of the run (below
    num-partitions when it is set)."""
    beyond = [p for p in parse_bindings(value).values() if cfg["num-partitions"] and p >= cfg["num-partitions"]]
    if beyond:
        raise ValueError(f"partition {beyond[0]} is not one of the num-partitions={cfg['num-partitions']}")


def off_or_at_least_one_rule(value: float, cfg: dict[str, Any]) -> None:
    """A `Param.rule`: 0 (off) or a multiple of at least 1 (`update-norm-bound`: a bound under the
    median would clip half of the honest updates every round)."""
    if 0 < value < 1:
        raise ValueError("must be 0 (off) or at least 1")


def classifier_bias_rule(value: bool, cfg: dict[str, Any]) -> None:
    """A `Param.rule`: a classifier bias only for a method whose card says it treats the classifier as
    any other layer (`MethodSpec.any_classifier`); the others read its class vectors W as the whole
    logit map (restricted softmax, logit calibration, a fixed ETF, class-vector statistics)."""
    if value and not METHODS[cfg["method"]].any_classifier:
        takers = ", ".join(name for name, spec in METHODS.items() if spec.any_classifier)
        raise ValueError(f"method {cfg['method']!r} reads the classifier's class vectors; a bias is for: {takers}")


# Keys that change no number of a run (a run's saved config is compared and hashed without them):
START_KEYS = ("resume", "overwrite")  # how a run starts, not what it computes: saved as false
PLACE_KEYS = ("out-dir", "run-name", "data-root")  # where things are: moving a folder changes no result
OUTPUT_KEYS = ("tensorboard", "wandb-project", "plots")  # copies and pictures of the metrics

COMMON: dict[str, Param] = {
    "method": Param(str, "fedavg", "the federated method (strategy + client trainer)"),
    "dataset": Param(
        str,
        "fashion-mnist",
        "the data set: " + ", ".join(DATASETS) + " (`fedskew data get NAME`) or 'hf:<Hub repo or saved folder>'",
    ),
    "data-root": Param(str, "", "folder holding the data files ('' = ./data, then system paths)"),
    "hf-subset": Param(str, "", "hf: the Hub data set's configuration name ('' = its default)"),
    "hf-image-column": Param(str, "", "hf: column of the images ('' = the Image feature, else image/img)"),
    "hf-label-column": Param(str, "", "hf: column of the labels ('' = the first ClassLabel, else label/labels/...)"),
    "hf-image-size": Param(  # high: fedskew.data.MAX_IMAGE_SIZE
        int, 0, "hf: resize images to N x N (0 = keep; they must be square, one size)", low=0, high=256
    ),
    "hf-test-fraction": Param(
        float,
        0.2,
        "hf: share of train carved off (fixed seed) as the central test set when there is no 'test' split",
        low=0.0,
        high=0.9,
        low_open=True,
    ),
    "augment": Param(
        str,
        "auto",
        "training augmentation, on the device: 'crop' (random crop after padding 4 px at 32x32), 'crop-flip' "
        "(+ horizontal flip), 'none'; 'auto' = crop-flip for cifar10/100, crop for svhn, else none",
        choices=AUGMENTATIONS,
    ),
    "model": Param(str, "lenet", "the network", choices=MODELS),
    "classifier-bias": Param(
        bool,
        False,
        "give the network's linear classifier a bias, as some peers' networks have (niid_bench's CNN); only "
        "for methods that treat the classifier as any other layer",
        rule=classifier_bias_rule,
        neutral=True,
    ),
    "input-scaling": Param(
        str,
        "standardise",
        "pixels to [0, 1], then 'standardise' (the data set's per-channel mean and std) or 'unit' (nothing "
        "more: torchvision's ToTensor alone, as niid_bench)",
        choices=("standardise", "unit"),
        neutral=True,
    ),
    "partition": Param(str, "classes-per-client", "how labels are split", choices=PARTITIONS),
    "classes-per-client": Param(int, 2, "classes each client holds (classes-per-client)", low=1),
    "classes-per-client-mode": Param(
        str,
        "pmcn",
        "'pmcn': FedGELA/FedMR PmCn dealing (any m); 'shards': FedRS exact-m shards (m divides C); "
        "'label-quantity': NIID-Bench #C=m (client k holds class k mod C plus m-1 random; >= C clients); "
        "'pfllib-pat': PFLlib's pathological split (classes in order to the first clients with room, "
        "unequal random parts)",
        choices=("pmcn", "shards", "label-quantity", "pfllib-pat"),
    ),
    "dirichlet-alpha": Param(float, 0.5, "Dirichlet concentration", low=0.0, low_open=True),
    "min-partition-size": Param(int, 10, "Dirichlet resamples until every client has this many", low=1),
    "imbalance-factor": Param(float, 10.0, "long-tail: largest/smallest class size", low=1.0),
    "map-sigma": Param(
        float,
        0.3,
        "map-random: log-normal sigma of client sizes (MAP: 0.3; at most 5, where one client already holds "
        "e^15 times another's share)",
        low=0.0,
        high=5.0,
    ),
    "local-test-fraction": Param(
        float, 0.2, "share of each client's data kept as its local test split", low=0.0, high=0.9
    ),
    "num-server-rounds": Param(int, 20, "federated rounds (at most 100,000: 100 x FedRS's 1000)", low=1, high=100_000),
    "fraction-train": Param(float, 0.5, "share of clients sampled each round", low=0.0, high=1.0, low_open=True),
    "local-epochs": Param(
        int, 1, "local epochs per round (the papers use 1 to 10; at most 1000: a round must end)", low=1, high=1000
    ),
    "batch-size": Param(int, 64, "local mini-batch size", low=1),
    "lr": Param(float, 0.01, "local SGD learning rate", low=0.0, low_open=True),
    "lr-warmup-rounds": Param(
        int, 0, "linear lr warm-up: round r trains at lr * min(r / N, 1); 0 = off (MAP/FedRS code: 5)", low=0
    ),
    "lr-decay": Param(
        float,
        1.0,
        "lr decay over rounds: round r trains at lr * lr-decay ** floor((r - 1) / lr-decay-every) (MuPFL: 0.995, 3)",
        low=0.0,
        high=1.0,
        low_open=True,
    ),
    "lr-decay-every": Param(int, 1, "rounds between two lr decay steps", low=1),
    "momentum": Param(float, 0.9, "local SGD momentum", low=0.0, high=1.0, high_open=True),
    "weight-decay": Param(float, 1e-4, "local SGD weight decay", low=0.0),
    "grad-clip": Param(
        float, 0.0, "clip each local step's gradient norm to this (0 = off; MAP/FedRS code: 100)", low=0.0
    ),
    "aggregation-weights": Param(
        str,
        "num-examples",
        "weight client models by sample count or uniformly",
        choices=("num-examples", "uniform"),
    ),
    "seed": Param(int, 0, "seed of every RNG (partition, sampling, init, training)", low=0),
    "partition-seed": Param(
        int,
        -1,
        "seed of the data split alone (the partition and each client's local test split); -1 = `seed`. A "
        "fixed value keeps one split over the seeds, as peers whose runs share one (niid_bench: 42)",
        low=-1,
        neutral=True,  # at -1 every run splits as before the key
    ),
    "eval-every": Param(int, 1, "central evaluation every N rounds (the last round always)", low=1),
    "eval-batch-size": Param(int, 1024, "batch size of evaluation", low=1),
    "class-metrics": Param(
        bool,
        True,
        "per-class record of the global model each evaluated round (per-class, balanced, worst-class and, on a "
        "long tail, head/middle/tail accuracy; classifier norms; class holders) and per-class.png",
    ),
    "personalized-central-eval": Param(
        bool,
        False,
        "each sampled client also evaluates its personalized model on the central test set: accuracy on the "
        "classes it holds and on those it lacks (one test-set pass per client and round)",
    ),
    "tensorboard": Param(bool, True, "write TensorBoard event files (metrics, per-class heatmap) in the run folder"),
    "plots": Param(
        bool,
        True,
        "draw accuracy.png, per-class.png and partition.png in the run folder, and the per-class heatmap in "
        "TensorBoard (false: none of them; about a second less a run)",
    ),
    "wandb-project": Param(str, "", "also log to this Weights & Biases project when wandb is installed ('' = off)"),
    "device": Param(str, "auto", "'auto' (cuda when present), 'cpu', 'cuda' or 'cuda:N'"),
    "compute-dtype": Param(
        str,
        "float32",
        "the clients' arithmetic (training and evaluation); the wire stays float32 (replies rounded to it). "
        "'float64': for comparing numerical paths, e.g. the batched engine against the per-client one",
        choices=("float32", "float64"),
        neutral=True,
    ),
    "torch-threads": Param(
        int,
        1,
        "torch CPU threads per ClientApp (0 = torch default; at most 1024, in a simulation 4 x the cores)",
        low=0,
        high=1024,
    ),
    "engine": Param(
        str,
        "flower",
        "how `fedskew run` and suites run the clients: 'flower' (a Flower simulation, one ClientApp call per "
        "message) or 'batched' (one process; the sampled clients of the methods that allow it trained as one "
        "stacked model: docs/usage.md, 'Batched engine')",
        choices=("flower", "batched"),
    ),
    "batched-chunk": Param(
        int,
        0,
        "batched engine: clients per stacked model (0 = a round's clients on a CPU, as many as fit on a GPU)",
        low=0,
    ),
    "min-nodes": Param(int, 1, "the server waits for this many connected nodes before round 1", low=1),
    "num-partitions": Param(
        int,
        0,
        "partitions the nodes serve (fedskew run: -n); a node reporting another count serves nothing; 0 = the "
        "count a strict majority of the nodes reports (nodes with their own data report 0)",
        low=0,
    ),
    "partition-bindings": Param(
        str,
        "",
        "'NODE:PARTITION,...': each named partition is served by that node id alone (an operator's decision "
        "when two nodes claim one partition, which then serves neither: docs/threat-model.md); '' = none",
        rule=bindings_rule,
        neutral=True,
    ),
    "max-update-ratio": Param(
        float,
        10.0,
        "a reply whose update ||w - w_sent|| exceeds this times max(||w_sent||, 1) is refused (0 = no bound)",
        low=0.0,
    ),
    "update-norm-bound": Param(
        float,
        3.0,
        "each accepted update is clipped to this times the round's median update norm (Sun et al. 2019; "
        "0 = off, else at least 1)",
        low=0.0,
        rule=off_or_at_least_one_rule,
        # hashed as runs from before the key: it changes a run only in the rounds it clips, which a result
        # file records per seed (`clipped-updates`); what that moves: docs/notes/update-ratio.md
        neutral=True,
    ),
    "statistic-norm-bound": Param(
        float,
        100.0,
        "an uploaded class statistic (prototype, class gradient) whose norm exceeds this times the round's "
        "median is dropped, as if its client had not held the class (0 = off, else at least 1)",
        low=0.0,
        rule=off_or_at_least_one_rule,
        neutral=True,  # drops no honest statistic measured (docs/notes/update-ratio.md)
    ),
    "robust-aggregation": Param(
        str,
        "none",
        "how the round's updates (and the server state built from them) are combined: 'none' (each method's "
        "mean), or the coordinate-wise 'median' or 'trimmed-mean' (Yin et al. 2018; every client weighs alike)",
        choices=("none", "median", "trimmed-mean"),
        neutral=True,
    ),
    "trim-fraction": Param(
        float,
        0.1,
        "trimmed-mean: share of the clients dropped at each end of every coordinate",
        low=0.0,
        high=0.5,
        high_open=True,
        neutral=True,
    ),
    "round-timeout": Param(
        float, 600.0, "seconds the server waits for a round's replies (at least 1: a reply takes longer)", low=1.0
    ),
    "min-replies": Param(int, 1, "usable replies a round needs (else it is retried, then the run stops)", low=1),
    "round-retries": Param(
        int, 1, "times a round with too few usable replies is sent again (at most 100)", low=0, high=100
    ),
    "checkpoint-every": Param(int, 5, "write checkpoint.pt every N rounds (0 = never)", low=0),
    "resume": Param(bool, False, "continue from the run folder's checkpoint.pt (`fedskew run --resume DIR`)"),
    "overwrite": Param(
        bool,
        False,
        "start afresh in a run folder that holds an earlier run's results, which move to its aside-<time> "
        "folder (`fedskew run --overwrite`); without it such a folder is refused",
    ),
    "state-max-mb": Param(float, 64.0, "bound on a client's persistent state kept in context.state", low=0.0),
    "out-dir": Param(str, "outputs", "results folder (made absolute by `fedskew run`)", rule=path_rule),
    "run-name": Param(
        str, "", "results subfolder of out-dir ('' = method-dataset-partition-seed-time)", rule=folder_name_rule
    ),
    "max-num-examples": Param(
        int,
        0,
        "nodes with their own data: the most examples a reply may claim (0 = the data set's training-set size)",
        low=0,
    ),
}


def _device_ok(value: str) -> bool:
    """auto, cpu, cuda or cuda:N with N in ASCII digits (`str.isdigit` takes other scripts' digits too,
    which torch refuses) below 128 (torch keeps the index in 8 bits: cuda:128 would be cuda:-128)."""
    if value in ("auto", "cpu", "cuda"):
        return True
    index = value.removeprefix("cuda:")
    return (
        value.startswith("cuda:") and 0 < len(index) <= 3 and all(c in "0123456789" for c in index) and int(index) < 128
    )


def validate(raw: Mapping[str, Any]) -> dict[str, Any]:
    """Check a raw run config and return it typed, with defaults for absent keys.

    Raises `ConfigError` (one line) for an unknown key, a wrong type or an out-of-range value.
    """
    method = COMMON["method"].check("method", raw.get("method", COMMON["method"].default))
    if method not in METHODS:
        raise ConfigError(f"method={method!r} is not allowed: must be one of " + ", ".join(sorted(METHODS)))
    schema = all_params()
    unknown = [k for k in raw if not isinstance(k, str) or k not in schema]
    if unknown:
        key = unknown[0]
        hint = difflib.get_close_matches(str(key), list(schema), n=1)
        raise ConfigError(f"{key}: unknown run-config key" + (f" (did you mean {hint[0]!r}?)" if hint else ""))
    cfg = {key: p.check(key, raw.get(key, p.default)) for key, p in schema.items()}
    _check_cross(cfg)
    return cfg


def all_params() -> dict[str, Param]:
    """Every known key: the common ones plus every registered method's own."""
    schema = dict(COMMON)
    for spec in METHODS.values():
        schema.update(spec.params)
    return schema


def _check_cross(cfg: dict[str, Any]) -> None:
    for key, p in all_params().items():
        if p.rule is not None:
            try:
                p.rule(cfg[key], cfg)
            except ValueError as e:
                raise ConfigError(f"{key}={cfg[key]!r} is not allowed: {e}") from None
    if not _device_ok(cfg["device"]):
        raise ConfigError(
            f"device={cfg['device']!r} is not allowed: must be 'auto', 'cpu', 'cuda' or 'cuda:N' (N in 0-127)"
        )
    name = cfg["dataset"]
    if is_hf(name):  # its classes are known only from the data: checked when it is partitioned
        if not name[len(HF_PREFIX) :].strip():
            raise ConfigError(f"dataset={name!r} is not allowed: name a Hub repo or a folder after 'hf:'")
        return
    if name not in DATASET_INFO:
        raise ConfigError(
            f"dataset={name!r} is not allowed: must be one of {', '.join(map(repr, DATASETS))} or 'hf:<repo or folder>'"
        )
    num_classes = DATASET_INFO[name].num_classes
    m = cfg["classes-per-client"]
    if cfg["partition"] == "classes-per-client" and m > num_classes:
        raise ConfigError(f"classes-per-client={m} is not allowed: {cfg['dataset']} has {num_classes} classes")
    if cfg["partition"] == "classes-per-client" and cfg["classes-per-client-mode"] == "shards" and num_classes % m:
        raise ConfigError(
            f"classes-per-client={m} is not allowed with classes-per-client-mode='shards': "
            f"it must divide the {num_classes} classes (or use mode 'pmcn')"
        )


def to_toml(params: dict[str, Param]) -> str:
    """`key = default  # help` lines for pyproject's [tool.flwr.app.config]."""
    import json

    lines = []
    for key, p in params.items():
        value = ("true" if p.default else "false") if p.kind is bool else json.dumps(p.default)
        if p.kind is float:
            value = repr(float(p.default))
        lines.append(f"{key} = {value}")
    return "\n".join(lines)


def parse_overrides(text: str) -> dict[str, Any]:
    """Parse flwr's `--run-config 'k1=v1 k2="s"'` syntax (TOML values) into a dict."""
    import tomllib

    out: dict[str, Any] = {}
    for item in _split_top(text):
        if "=" not in item:
            raise ConfigError(f'{item!r}: expected key=value (strings in quotes: key="value")')
        key, value = item.split("=", 1)
        key = key.strip()
        try:
            out[key] = tomllib.loads(f"v = {value.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            raise ConfigError(
                f'{key}={value.strip()}: not a TOML value (quote strings: {key}="{value.strip()}")'
            ) from None
    return out


def _split_top(text: str) -> list[str]:
    """Split on whitespace outside quotes and brackets."""
    items, cur, quote, depth = [], "", "", 0
    for ch in text:
        if quote:
            cur += ch
            if ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
            cur += ch
        elif ch in "[{":
            depth += 1
            cur += ch
        elif ch in "]}":
            depth -= 1
            cur += ch
        elif ch.isspace() and depth == 0:
            if cur:
                items.append(cur)
            cur = ""
        else:
            cur += ch
    if cur:
        items.append(cur)
    return items
