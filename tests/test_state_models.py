"""Client state store and the models' features / classifier split."""

from __future__ import annotations

import logging

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


# ----------------------------------------------------------------------------- finite extremes
@pytest.mark.parametrize("value", [1e30, 3e38, -1e7])
def test_a_state_holding_a_value_beyond_the_reply_bound_is_lost(tmp_path, caplog, value: float) -> None:
    """The value bound replies are held to (+-1e6) holds for what a client reads back from its state
    (context.state or state-dir): beyond it the state is lost, with a warning naming it; at the bound
    it loads."""
    for directory in (None, tmp_path / "p4"):
        caplog.clear()
        st = ClientState(RecordDict(), 64, 4, directory)
        st.save_tensors("moon-previous", {"w": torch.tensor([0.5, value]), "n": torch.tensor(7)})
        with caplog.at_level(logging.WARNING, logger="fedskew.client"):
            assert st.load_tensors("moon-previous") is None, directory
        assert "'moon-previous' refused, treated as lost" in caplog.text and "beyond +-1e+06" in caplog.text
        st.save_tensors("moon-previous", {"w": torch.tensor([0.5, -1e6]), "n": torch.tensor(2**40)})
        assert st.load_tensors("moon-previous")["w"][1] == -1e6  # at the bound; integers are counters


def _extreme(state: RecordDict, name: str) -> None:
    """The client's stored tensors `name` with one entry set to 1e30 (their round tag kept)."""
    st = ClientState(state, 64, 0)
    tensors = st.load_tensors(name)
    first = next(k for k, v in tensors.items() if v.is_floating_point())
    tensors[first].view(-1)[0] = 1e30
    st.save_tensors(name, tensors)


def test_a_moon_previous_model_or_a_fedrep_head_at_1e30_restarts_the_client_as_new(caplog) -> None:
    """The issue's cases: the node answers (no exception), as a new client would: MOON without a
    negative, FedRep from the initial head, and a reply within every bound."""
    from flwr.app import ArrayRecord

    from fedskew.client_app.fedrep import HEAD, FedRepTrainer
    from fedskew.client_app.moon import MOONTrainer
    from fedskew.models import body_state
    from fedskew.records import VALUE_BOUND
    from tests.test_trainers import global_content, make_data, make_trainer

    def message(body_only: bool, server_round: int) -> RecordDict:
        content = global_content(server_round=server_round)
        if body_only:  # FedRep's server sends the body alone
            content["arrays"] = ArrayRecord(body_state(content["arrays"].to_torch_state_dict()))
        return content

    cases = (
        (MOONTrainer, "moon-previous", {"method": "moon"}),
        (FedRepTrainer, HEAD, {"method": "fedrep", "fedrep-head-epochs": 1}),
    )
    for cls, name, over in cases:
        caplog.clear()
        body_only = cls is FedRepTrainer
        state = RecordDict()
        make_trainer(cls, make_data(), state=state, **over).fit(message(body_only, 1))
        _extreme(state, name)
        new = make_trainer(cls, make_data(), server_round=2, **over).fit(message(body_only, 2))
        with caplog.at_level(logging.WARNING, logger="fedskew.client"):
            again = make_trainer(cls, make_data(), state=state, server_round=2, **over).fit(message(body_only, 2))
        assert f"{name!r} refused, treated as lost" in caplog.text
        assert again["metrics"]["train-loss"] == new["metrics"]["train-loss"]  # as a new client
        for k, v in again["arrays"].to_torch_state_dict().items():
            assert torch.equal(v, new["arrays"].to_torch_state_dict()[k]) and v.abs().max() < VALUE_BOUND
