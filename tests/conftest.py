"""Shared test fixtures: Flower's TaskIdentity for building messages, and real `flwr run` jobs."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def app_folder(parent: Path) -> Path:
    """This checkout's app as `flwr build` and `flwr run` accept it wherever the checkout sits: a
    folder named `fedskew` under `parent` (the same one on every call) holding what the FAB needs
    (Flower refuses an app folder whose name is not a valid app name, e.g. a clone in /tmp/tmp.x1Y)."""
    from fedskew.run.launcher import stage_app

    dest = parent / "app" / "fedskew"
    return dest if dest.is_dir() else stage_app(ROOT, dest)


@pytest.fixture(autouse=True, scope="session")
def _flower_env() -> None:
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
    os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")


@pytest.fixture(autouse=True, scope="session")
def _one_thread_a_worker() -> None:
    """Under pytest-xdist (`make test`: a worker a core), one torch thread a worker: two workers of
    two threads each on two cores would only take turns."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _in_process_runs_draw_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ServerApp runs of `tests.harness` (hundreds of them) start from the app's defaults with
    `plots` and `tensorboard` off, unless a test's config turns them on: the pictures and event files
    cost about a second a run, and the `flwr run` tests (tests/test_end_to_end.py) check them."""
    from tests import harness

    defaults = {**harness.app_defaults(), "plots": False, "tensorboard": False}
    monkeypatch.setattr(harness, "app_defaults", lambda: dict(defaults))


@pytest.fixture
def task_identity() -> None:
    """Lets tests build `Message`s without a running Flower runtime (internal API)."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id = TaskIdentity.node_id = TaskIdentity.task_id = 1


# A small, fast federated job on real Fashion-MNIST: few clients, few rounds (the `flwr run` jobs
# below add `data-root` of `small_data`: a quarter of each class).
SMALL_JOB: dict[str, Any] = {
    "num-server-rounds": 2,
    "fraction-train": 1.0,
    "partition": "classes-per-client",
    "classes-per-client": 2,
    "local-epochs": 1,
}


SMALL_DATA_SHARE = 4  # `small_data` keeps the first 1/4 of each class of each split


def write_idx(path: Path, array: Any, gz: bool = False) -> None:
    """`array` as an unsigned-byte IDX file: magic 0x0000 0x08 ndim, big-endian dims, the bytes
    (with `gz`, gzipped at `path` + ".gz")."""
    import gzip

    import numpy as np

    data = bytes([0, 0, 0x08, array.ndim]) + np.asarray(array.shape, dtype=">u4").tobytes()
    data += np.ascontiguousarray(array, dtype=np.uint8).tobytes()
    if gz:
        path.with_name(path.name + ".gz").write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)


@pytest.fixture(scope="session")
def small_data(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A `data-root` holding real Fashion-MNIST cut to the first quarter of every class, in both
    splits (15,000 training and 2,500 test images, in file order), so that a test's `flwr run` job
    spends its seconds on the mechanism it checks rather than on training; skips without the data."""
    import numpy as np

    from fedskew.data import load_dataset
    from fedskew.data.readers import IDX_FILES

    try:
        x_tr, y_tr, x_te, y_te = load_dataset("fashion-mnist", "")
    except FileNotFoundError as e:
        pytest.skip(f"Fashion-MNIST is needed: {e}")
    root = tmp_path_factory.mktemp("small-data")
    (root / "fashion-mnist").mkdir()
    for split, x, y in (("train", x_tr, y_tr), ("test", x_te, y_te)):
        firsts = [np.flatnonzero(y == c)[: (y == c).sum() // SMALL_DATA_SHARE] for c in range(10)]
        keep = np.sort(np.concatenate(firsts))
        write_idx(root / "fashion-mnist" / IDX_FILES[f"{split}-x"], x[keep, 0])
        write_idx(root / "fashion-mnist" / IDX_FILES[f"{split}-y"], y[keep].astype(np.uint8))
    return str(root)


@pytest.fixture(scope="session")
def _sim_link() -> Iterator[Callable[[Any], Any]]:
    """One private SuperLink and Ray head per resources and `FEDSKEW_*` environment (which their
    processes inherit at start), shared by a test process's `flwr run` jobs (as a suite's cells
    share one): starting and stopping them costs about 15 s a job."""
    from fedskew.run.launcher import simulation_link

    links: dict[Any, Any] = {}
    with contextlib.ExitStack() as stack:

        def link_for(resources: Any) -> Any:
            key = (resources, tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("FEDSKEW_"))))
            if key not in links:
                links[key] = stack.enter_context(simulation_link(ROOT, resources))
            return links[key]

        yield link_for


@pytest.fixture
def flwr_job(tmp_path: Path, _sim_link: Callable[[Any], Any], small_data: str):
    """Run a real simulation through `flwr run` on a private SuperLink, on `small_data` unless the
    job names its own `data-root`; return (summary, run_dir)."""
    from fedskew.run.launcher import prepare_config, resources_for, run_simulation

    def run(
        overrides: dict[str, Any], num_supernodes: int = 5, name: str = "job", actors: int | None = None
    ) -> tuple[dict, Path]:
        """`actors`: clients trained at once (default: every core busy)."""
        merged = {**SMALL_JOB, "data-root": small_data, **overrides, "out-dir": str(tmp_path / "out"), "run-name": name}
        cfg, subm = prepare_config(ROOT, merged, num_supernodes)
        resources = resources_for(cfg, actors)
        link = _sim_link(resources)
        summary = run_simulation(ROOT, subm, num_supernodes, stream=False, resources=resources, link=link)
        run_dir = Path(summary["run_dir"])
        assert json.loads((run_dir / "summary.json").read_text()) == summary
        return summary, run_dir

    return run


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# The tests that run for tens of seconds (real `flwr run` jobs, deployments, subprocess benchmarks),
# scheduled first: pytest-xdist hands tests out in collection order, so a long one left to the end
# would keep one worker busy while the others sit idle.
LONG_FIRST = (
    "test_ray_cluster.py",
    "test_multihost.py",
    "test_end_to_end.py",
    "test_careless.py::test_a_real_run",
    "test_interrupt.py",
    "test_clientexec.py",
    "test_fedmr.py::test_fedmr_flwr_run",
    "test_fedgela.py::test_fedgela_end_to_end",
    "test_map.py::test_flwr",
    "test_mupfl.py::test_mupfl_runs_end_to_end",
    "test_hf.py::test_an_hf_folder_through_a_real_flwr_run",
    "test_benchmarks.py",
    "test_batched.py::test_runs_trained_together",
    "test_actor_pool.py",
    "test_reliability.py",
    "test_hostile.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.nodeid.split("/")[-1]
        return next((i for i, prefix in enumerate(LONG_FIRST) if name.startswith(prefix)), len(LONG_FIRST))

    items.sort(key=rank)  # stable: the order within each file is kept
