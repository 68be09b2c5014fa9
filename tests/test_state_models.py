"""Client state store and the models' features / classifier split."""

from __future__ import annotations

import pytest
import torch
from flwr.app import RecordDict

from fedskew.client_app.state import ROUND_KEY, ClientState, StateTooLargeError
from fedskew.models import MODELS, build_model
from fedskew.records import Number

COUNTER = {"n": Number(int, 0, 10)}


def test_state_round_trips_in_context_state() -> None:
    record = RecordDict()
    st = ClientState(record, max_mb=1, partition_id=3)
    assert st.load_tensors("hpm") is None and st.load_values("counter", COUNTER) is None
    st.save_tensors("hpm", {"w": torch.arange(6.0).view(2, 3)})
    st.save_values("counter", {"n": 2})
    again = ClientState(record, max_mb=1, partition_id=3)  # next round: same context.state
    assert torch.equal(again.load_tensors("hpm")["w"], torch.arange(6.0).view(2, 3))
    assert again.load_values("counter", COUNTER) == {"n": 2}


def test_state_over_its_bound_is_refused_with_a_clear_message() -> None:
    st = ClientState(RecordDict(), max_mb=0.5, partition_id=7)
    st.save_tensors("a", {"w": torch.zeros(60_000)})  # 0.23 MB
    st.save_tensors("a", {"w": torch.zeros(100_000)})  # replacing 'a' does not count it twice
    with pytest.raises(StateTooLargeError, match=r"partition 7 .* state-max-mb=0.5.*state-dir"):
        st.save_tensors("b", {"w": torch.zeros(60_000)})


def test_state_on_disk_survives_a_new_context(tmp_path) -> None:
    st = ClientState(RecordDict(), max_mb=0, partition_id=1, directory=tmp_path / "p1")
    st.save_tensors("big", {"w": torch.ones(300_000)})  # no bound on disk
    st.save_values("counter", {"n": 5})
    fresh = ClientState(RecordDict(), max_mb=0, partition_id=1, directory=tmp_path / "p1")
    assert fresh.load_tensors("big")["w"].sum() == 300_000 and fresh.load_values("counter", COUNTER) == {"n": 5}
    assert not list((tmp_path / "p1").glob("*.tmp"))


def test_round_tensors_refuse_another_form_and_a_state_from_a_discarded_attempt(tmp_path) -> None:
    like = {"w": torch.zeros(2, 3), "b": torch.zeros(3)}
    for directory in (None, tmp_path / "p2"):
        st = ClientState(RecordDict(), max_mb=1, partition_id=2, directory=directory)
        assert st.load_round_tensors("c", like, 2) is None  # none yet
        st.save_round_tensors("c", {"w": torch.ones(2, 3), "b": torch.ones(3)}, 4)
        assert st.load_round_tensors("c", like, 4) is None  # written by round 4's discarded attempt
        assert st.load_round_tensors("c", like, 3) is None  # ahead of a resumed round 3
        got = st.load_round_tensors("c", like, 5)
        assert list(got) == ["w", "b"] and torch.equal(got["w"], torch.ones(2, 3))
        assert st.load_round_tensors("c", {"w": torch.zeros(3, 2), "b": torch.zeros(3)}, 5) is None
        assert st.load_round_tensors("c", {"w": torch.zeros(2, 3)}, 5) is None
        assert st.load_round_tensors("c", {**like, "w": torch.zeros(2, 3, dtype=torch.float64)}, 5) is None
        st.save_tensors("c", {"w": torch.ones(2, 3), "b": torch.ones(3), ROUND_KEY: torch.ones(4, dtype=torch.int64)})
        assert st.load_round_tensors("c", like, 5) is None  # a damaged round tag
        st.save_tensors("c", {"w": torch.ones(2, 3), "b": torch.ones(3)})
        assert st.load_round_tensors("c", like, 5) is None  # none


def test_model_sized_states_of_resnet18_under_the_default_bound(tmp_path) -> None:
    """One float32 copy of ResNet-18's parameters (SCAFFOLD's c_i, FedDyn's g_k: 42.6 MB) fits
    `state-max-mb=64`; FedDC's two (c_i and h_i: 85 MB) do not, and go to `state-dir`."""
    params = {k: torch.zeros_like(p) for k, p in build_model("resnet18", "cifar10").named_parameters()}
    st = ClientState(RecordDict(), max_mb=64, partition_id=0)
    st.save_round_tensors("control", params, 1)
    with pytest.raises(StateTooLargeError, match="state-dir"):
        st.save_round_tensors("feddc-drift", params, 1)
    on_disk = ClientState(RecordDict(), max_mb=64, partition_id=0, directory=tmp_path / "p0")
    on_disk.save_round_tensors("control", params, 1)
    on_disk.save_round_tensors("feddc-drift", params, 1)
    assert on_disk.load_round_tensors("feddc-drift", params, 2) is not None


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("dataset", ["fashion-mnist", "cifar10"])
def test_models_split_features_and_bias_free_classifier(name: str, dataset: str) -> None:
    if name == "resnet18" and dataset == "fashion-mnist":
        pytest.skip("covered on cifar10; slow on CPU")
    model = build_model(name, dataset)
    size, ch = (28, 1) if dataset == "fashion-mnist" else (32, 3)
    x = torch.randn(2, ch, size, size)
    h = model.features(x)
    assert h.shape == (2, model.feature_dim)
    assert model.classifier.bias is None and model.classifier.weight.shape == (10, model.feature_dim)
    assert torch.allclose(model(x), h @ model.classifier.weight.T)


@pytest.mark.parametrize(("name", "dim", "params"), [("map-lenet", 256, 9_392), ("mupfl-cnn", 1024, 62_336)])
def test_papers_fmnist_networks_have_their_sizes(name: str, dim: int, params: int) -> None:
    """MAP spec §5.3 (the authors' LeNet: 9.4 k parameters, d = 256) and MuPFL spec (two 5x5 convs
    32/64 and one linear layer: about 62 k parameters, d = 1024); BAVD finds both conv ReLUs."""
    from fedskew.losses.mupfl import attach_bavd

    model = build_model(name, "fashion-mnist")
    assert model.feature_dim == dim and sum(p.numel() for p in model.parameters()) == params
    assert len(attach_bavd(model)) == 2
