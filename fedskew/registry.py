"""The methods: each name maps to its server strategy, its client trainer and its own run-config keys.

Adding a method means one strategy module (`strategies/<name>.py`), one trainer module
(`client_app/<name>.py`), its records in `fedskew/wire.py` when it sends more than the model, and one
entry here naming them (`wire=`: both sides read it from here). The classes and the wire are
imported lazily by dotted path so that the config validator can list methods without importing
torch code.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fedskew.data import DATASET_INFO
from fedskew.schema import Param, parse_class_list

if TYPE_CHECKING:
    from fedskew.wire import Wire


@dataclass(frozen=True)
class MethodSpec:
    """A registered method: where its strategy and trainer live, its own config keys and its paper
    (authors, title, venue: what `fedskew config` lists beside the name)."""

    name: str
    strategy: str  # "module:Class"
    trainer: str  # "module:Class"
    params: dict[str, Param] = field(default_factory=dict)
    paper: str = ""
    # raised when the method's arithmetic changes under the same config (a fix), so that results of
    # the earlier code no longer share a hash with the new ones (`fedskew.reports.resultfile.config_sha256`)
    revision: int = 0
    # its records beyond the model arrays: the name of its `fedskew.wire.Wire`, the one declaration
    # both its strategy and its trainer read (`DeclaredWire`)
    wire: str = "BASE"

    def wire_spec(self) -> Wire:
        """The method's `fedskew.wire.Wire` (imported lazily, as the classes)."""
        return _load(f"fedskew.wire:{self.wire}")

    def strategy_class(self) -> Any:
        return _load(self.strategy)

    def trainer_class(self) -> Any:
        return _load(self.trainer)

    def resume_note(self, cfg: dict[str, Any]) -> str:
        """'' when a resumed simulation of this method under the validated `cfg` equals the
        uninterrupted run, else why not: its clients keep state across rounds
        (`BaseTrainer.kept_state`) that a resumed run, a new Flower run whose clients start empty,
        does not have."""
        if kept := self.trainer_class().kept_state(cfg):
            return f"{self.name}'s clients keep {kept} across rounds, which a resumed simulation starts without"
        return ""

    def config_keys(self) -> set[str]:
        """The method keys a run of this method can read: its own and those of every registered
        method whose own strategy or trainer class (one that no other method uses as is) its classes
        inherit from: MAP's trainer subclasses FedRS's, so the fedrs- keys count for MAP, while
        FedAvgM, which uses FedAvg's trainer as is, adds nothing to FedAvg's keys. The common keys
        are not included."""
        mine = {*self.strategy_class().__mro__, *self.trainer_class().__mro__}
        users: dict[Any, int] = {}
        for m in METHODS.values():
            for c in {m.strategy_class(), m.trainer_class()}:
                users[c] = users.get(c, 0) + 1
        keys = set(self.params)
        for other in METHODS.values():
            if any(c in mine and users[c] == 1 for c in (other.strategy_class(), other.trainer_class())):
                keys |= set(other.params)
        return keys


def _load(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


class DeclaredWire:
    """The `wire` of a strategy or trainer class (`BaseStrategy.wire`, `BaseTrainer.wire`): the
    `fedskew.wire.Wire` its registry entries name (`MethodSpec.wire`, found by the class's dotted
    path, so that neither side imports the other), else its nearest registered base class's, else
    `fedskew.wire.BASE`. The one declaration both sides of a method read."""

    def __get__(self, obj: Any, cls: type) -> Wire:
        return wire_of(cls)


@functools.cache
def wire_of(cls: type) -> Wire:
    for c in cls.__mro__:
        path = f"{c.__module__}:{c.__qualname__}"
        wires = {id(w): w for w in (m.wire_spec() for m in METHODS.values() if path in (m.strategy, m.trainer))}
        if len(wires) > 1:
            raise TypeError(f"{path} serves methods that declare different wires")
        if wires:
            return wires.popitem()[1]
    return _load("fedskew.wire:BASE")


def class_list_rule(text: str, cfg: dict[str, Any]) -> None:
    """A `Param.rule`: `text` is a class list of the configured data set (for an `hf:` data set,
    whose classes are known only from the data, the ids are checked when the strategy starts)."""
    info = DATASET_INFO.get(cfg["dataset"])
    parse_class_list(text, info.num_classes if info else 2**31)


def _fedgen_batch_rule(iterations: int, cfg: dict[str, Any]) -> None:
    """FedGen's generator trains on batches of `batch-size` labels through BatchNorm: at least 2."""
    if cfg["method"] == "fedgen" and iterations > 0 and cfg["batch-size"] < 2:
        raise ValueError(f"the generator trains on batches of batch-size={cfg['batch-size']} labels; it needs >= 2")


def _m(
    name: str, strategy: str, trainer: str, paper: str = "", revision: int = 0, wire: str = "BASE", **params: Param
) -> MethodSpec:
    keys = {f"{name}-{k.rstrip('_').replace('_', '-')}": p for k, p in params.items()}  # lambda_: -lambda
    strategy, trainer = f"fedskew.strategies.{strategy}", f"fedskew.client_app.{trainer}"
    return MethodSpec(name, strategy, trainer, keys, paper, revision, wire)


# FedRS's restricted softmax (`fedskew.client_app.fedrs.FedRSTrainer`), for fedrs and scaffold-rs
RESTRICTED_SOFTMAX = {
    "alpha": Param(float, 0.5, "FedRS: scale of missing classes' logits", low=0.0, high=1.0),
    "scale": Param(str, "binary", "FedRS: 'binary' (paper) or 'count' (authors' code)", choices=("binary", "count")),
    "tau": Param(int, 1, "FedRS: a class is observed when the client has >= tau samples", low=1),
}
SCAFFOLD_SERVER_LR = Param(
    float, 1.0, "SCAFFOLD: server step size eta_g, x + eta_g (mean y_i - x) (paper: 1)", low=0.0, low_open=True
)


def _hpm(name: str, *, soften_student: bool, mu_max: float) -> dict[str, Param]:
    """The inherited private model's keys (`fedskew/client_app/hpm.py`), shared by FedPHP and MAP;
    `soften_student` and `mu_max` default to MAP's paper (true, 1.0) or the authors' code (false, 0.9)."""
    return {
        "transfer": Param(
            str, "distill", f"{name}: HPM transfer term, logit distillation or feature MMD", choices=("distill", "mmd")
        ),
        "transfer_weight": Param(float, 0.1, f"{name}: lambda in (1-lambda) CE + lambda L_tr", low=0.0, high=1.0),
        "temperature": Param(float, 4.0, f"{name}: distillation temperature tau", low=0.0, low_open=True),
        "soften_student": Param(
            bool, soften_student, f"{name}: divide the student's logits by tau too (MAP's paper; false = authors' code)"
        ),
        "mu_bar": Param(float, 0.9, f"{name}: macro momentum; mu = mu_bar (n-1) / (Q T)", low=0.0),
        "mu_max": Param(
            float, mu_max, f"{name}: upper clip of the HPM momentum (MAP's paper 1.0, code 0.9)", low=0.0, high=1.0
        ),
        "mmd_kernels": Param(
            int, 5, f"{name}: number of Gaussian kernels of the MMD (MAP's paper: 5; at most 64)", low=1, high=64
        ),
        "mmd_kernel_mul": Param(float, 2.0, f"{name}: bandwidth ratio between MMD kernels", low=1.0, low_open=True),
    }


METHODS: dict[str, MethodSpec] = {
    spec.name: spec
    for spec in (
        _m(
            "fedavg",
            "fedavg:FedAvgStrategy",
            "fedavg:FedAvgTrainer",
            paper=(
                'McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized Data", '
                "AISTATS 2017"
            ),
        ),
        _m(
            "fedprox",
            "fedprox:FedProxStrategy",
            "fedprox:FedProxTrainer",
            paper='Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020',
            mu=Param(float, 0.01, "FedProx proximal weight: loss + mu/2 ||w - w_global||^2", low=0.0),
        ),
        _m(
            "fedavgm",
            "fedavgm:FedAvgMStrategy",
            "fedavg:FedAvgTrainer",
            paper=(
                'Hsu, Qi & Brown, "Measuring the Effects of Non-Identical Data Distribution for Federated Visual '
                'Classification", arXiv 2019'
            ),
            server_lr=Param(
                float,
                0.1,
                "FedAvgM: server step size eta, x <- x - eta v (0.1: eta / (1 - beta) = 1)",
                low=0.0,
                low_open=True,
            ),
            server_momentum=Param(
                float, 0.9, "FedAvgM: server momentum beta, v <- beta v + (x - avg)", low=0.0, high=1.0, high_open=True
            ),
        ),
        _m(
            "fedrs",
            "fedrs:FedRSStrategy",
            "fedrs:FedRSTrainer",
            wire="FEDRS",
            paper=(
                'Li & Zhan, "FedRS: Federated Learning with Restricted Softmax for Label Distribution Non-IID '
                'Data", KDD 2021'
            ),
            **RESTRICTED_SOFTMAX,
        ),
        _m(
            "scaffold",
            "scaffold:ScaffoldStrategy",
            "scaffold:ScaffoldTrainer",
            wire="SCAFFOLD",
            revision=1,  # 1: update-norm-bound clips its diverging honest updates on 2-class splits
            paper='Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning", ICML 2020',
            server_lr=SCAFFOLD_SERVER_LR,
        ),
        _m(
            "scaffold-rs",
            "scaffold_rs:ScaffoldRSStrategy",
            "scaffold_rs:ScaffoldRSTrainer",
            wire="SCAFFOLD_RS",
            revision=1,  # 1: update-norm-bound clips its diverging honest updates on 2-class splits
            paper="SCAFFOLD (Karimireddy et al., ICML 2020) with FedRS's restricted softmax (Li & Zhan, KDD 2021)",
            server_lr=SCAFFOLD_SERVER_LR,
            **RESTRICTED_SOFTMAX,
        ),
        _m(
            "fednova",
            "fednova:FedNovaStrategy",
            "fednova:FedNovaTrainer",
            wire="FEDNOVA",
            paper=(
                'Wang et al., "Tackling the Objective Inconsistency Problem in Heterogeneous Federated '
                'Optimization", NeurIPS 2020'
            ),
        ),
        _m(
            "feddyn",
            "feddyn:FedDynStrategy",
            "feddyn:FedDynTrainer",
            wire="FEDDYN",
            paper='Acar et al., "Federated Learning Based on Dynamic Regularization", ICLR 2021',
            alpha=Param(
                float,
                0.01,
                "FedDyn: weight alpha of the dynamic regulariser and of h (the authors' code: 0.01)",
                low=0.0,
                low_open=True,
            ),
        ),
        _m(
            "feddc",
            "feddc:FedDCStrategy",
            "feddc:FedDCTrainer",
            wire="FEDDC",
            revision=1,  # 1: grad-clip clips the correction with the loss gradient, as the authors' code
            paper=(
                'Gao et al., "FedDC: Federated Learning with Non-IID Data via Local Drift Decoupling and '
                'Correction", CVPR 2022'
            ),
            alpha=Param(
                float,
                0.01,
                "FedDC: weight alpha of the drift penalty alpha/2 ||theta + h - w||^2 (authors' code: 0.01)",
                low=0.0,
            ),
        ),
        _m(
            "fedmr",
            "fedmr:FedMRStrategy",
            "fedmr:FedMRTrainer",
            wire="FEDMR",
            paper=(
                'Fan et al., "Federated Learning under Partially Class-Disjoint Data via Manifold Reshaping", TMLR 2023'
            ),
            mu1=Param(float, 0.01, "FedMR: weight of the intra-class decorrelation loss", low=0.0),
            mu2=Param(float, 1e-4, "FedMR: weight of the inter-class prototype loss", low=0.0),
            intra_mode=Param(
                str,
                "ref",
                "FedMR intra scale: 'ref' (authors' code; paper's tuned mu1), 'paper_fro' (Eq. 3), 'paper_offdiag'",
                choices=("ref", "paper_fro", "paper_offdiag"),
            ),
            negatives=Param(
                str,
                "all",
                "FedMR inter loss negatives: 'all' classes with a prototype, or 'local' (Eq. 4 literally)",
                choices=("all", "local"),
            ),
            margin=Param(float, 0.0, "FedMR: margin inside the inter-loss hinge (paper: 0)", low=0.0),
            inter_form=Param(
                str,
                "hinge",
                "FedMR inter loss: 'hinge' (Eq. 4) or 'pull' (margin-removed: distance to own prototype)",
                choices=("hinge", "pull"),
            ),
            lite_n=Param(int, -1, "FedMR Lite: inter loss on n samples per batch (-1 all, 0 off)", low=-1),
            grad_share_every=Param(
                int,
                0,
                "FedMR: every n-th batch, log each term's backbone-gradient norm against the CE's (0 = never)",
                low=0,
            ),
            share_fraction=Param(
                float, 1.0, "FedMR privacy: share of clients (fixed, seeded) that upload prototypes", low=0.0, high=1.0
            ),
            private_classes=Param(
                str, "", "FedMR privacy: classes never uploaded, e.g. '3,7' or 'all' ('' = none)", rule=class_list_rule
            ),
        ),
        _m(
            "mupfl",
            "mupfl:MuPFLStrategy",
            "mupfl:MuPFLTrainer",
            wire="MUPFL",
            paper=(
                'Zhang et al., "Multi-level Personalized Federated Learning on Heterogeneous and Long-Tailed '
                'Data" (MuPFL; extends ICME 2023)'
            ),
            bavd=Param(bool, True, "MuPFL: BAVD dropout during local training (and maps for ACMU)"),
            acmu=Param(bool, True, "MuPFL: ACMU cluster update (off = one cluster)"),
            pkcf=Param(bool, True, "MuPFL: PKCF class gradients, feature synthesis, classifier fine-tune"),
            init=Param(
                str,
                "global",
                "MuPFL: a client starts from the global model (Alg. 1 as FedAvg with clustering), its own w~_i"
                " ('personal'), or its w~_i's feature extractor with the global classifier ('cluster', Eq. 14"
                " on the client's path)",
                choices=("global", "personal", "cluster"),
            ),
            alpha=Param(float, 0.5, "MuPFL ACMU: weight of the update cosine vs the map cosine", low=0.0, high=1.0),
            k_min=Param(int, 2, "MuPFL ACMU: smallest number of clusters tried", low=2),
            k_max=Param(int, 6, "MuPFL ACMU: largest number of clusters tried (capped at n-1)", low=2),
            psi_sign=Param(
                str,
                "improvement",
                "MuPFL BAVD: psi = prev - cur loss, or the paper's cur - prev",
                choices=("improvement", "paper"),
            ),
            bavd_rescale=Param(
                bool, False, "MuPFL BAVD: scale kept activations by positions / kept (inverted dropout)"
            ),
            bavd_mask=Param(
                str,
                "sample-topk",
                "MuPFL BAVD: per sample its top-K ('sample-topk', Sec. 3.6), or its own mean ('sample-mean'),"
                " or the map's mean as its threshold ('map-threshold'), or one mask from the batch-mean map"
                " for every sample ('batch')",
                choices=("batch", "sample-mean", "sample-topk", "map-threshold"),
            ),
            bavd_top=Param(
                float,
                0.5,
                "MuPFL BAVD 'sample-topk': the fraction K of each sample-channel slice kept (the paper gives none)",
                low=0.0,
                high=1.0,
                low_open=True,
            ),
            bavd_site=Param(
                str,
                "features",
                "MuPFL BAVD: on the flattened features before the classifier ('features'), after every conv"
                " block ('convs'), or after the last only ('last-conv')",
                choices=("convs", "last-conv", "features"),
            ),
            bavd_reset=Param(
                str,
                "epoch",
                "MuPFL BAVD: map restarts each epoch, each round, or never (client state)",
                choices=("epoch", "round", "never"),
            ),
            features_per_class=Param(
                int,
                20,
                "MuPFL PKCF: synthetic features per class (m; the paper studies 10 to 200, Sec. 4.1; at most 1000: "
                "the server holds classes x m x feature-dim floats and sends them every round)",
                low=1,
                high=1000,
            ),
            tau=Param(
                int,
                30,
                "MuPFL PKCF: classifier fine-tune epochs on the features (the paper studies 10 to 100, Sec. 4.1; "
                "at most 1000)",
                low=0,
                high=1000,
            ),
            feature_batch=Param(int, 64, "MuPFL PKCF: batch size of the classifier fine-tune", low=1),
            feature_init=Param(
                str,
                "extractor",
                "MuPFL PKCF: synthetic features start as the global extractor's outputs (Sec. 3.5, on"
                " N(0,1) inputs), N(0,1) (CReFF), or N(0,1) rescaled to the clients' real-feature norm",
                choices=("normal", "extractor", "rescaled"),
            ),
            feature_lr=Param(float, 1.0, "MuPFL PKCF: SGD lr of the feature synthesis", low=0.0, low_open=True),
            match_iters=Param(
                int,
                100,
                "MuPFL PKCF: gradient-matching iterations per round (CReFF: 100; at most 10,000)",
                low=0,
                high=10_000,
            ),
            distance=Param(
                str,
                "creff",
                "MuPFL PKCF: matching distance, CReFF's row-wise cosine summed over rows and classes,"
                " or the paper's one cosine per class averaged (Eq. 20)",
                choices=("creff", "paper"),
            ),
            n_real=Param(int, 64, "MuPFL PKCF: samples per class for a client's class gradient", low=1),
        ),
        _m(
            "map",
            "map:MAPStrategy",
            "map:MAPTrainer",
            wire="MAP",
            paper=(
                'Li et al., "MAP: Model Aggregation and Personalization in Federated Learning with Incomplete '
                'Classes", TKDE 2024'
            ),
            alpha=Param(
                float, 0.5, "MAP stage 1: restricted-softmax scale of missing classes' logits", low=0.0, high=1.0
            ),
            scale=Param(
                str,
                "binary",
                "MAP: RS rule, 'binary' (paper), 'count', or 'fraction' (authors' code: tau on class"
                " fractions, so every logit x alpha on a client with 2+ classes)",
                choices=("binary", "count", "fraction"),
            ),
            tau=Param(int, 1, "MAP: a class is observed when the client has >= tau samples", low=1),
            **_hpm("MAP", soften_student=True, mu_max=1.0),
            personal_epochs=Param(
                int, 1, "MAP: stage-2 (personalization) epochs under schedule 'epochs' (at most 1000)", low=0, high=1000
            ),
            personal_lr_factor=Param(float, 1.0, "MAP: stage-2 lr = lr * factor (code: 0.2)", low=0.0, low_open=True),
            schedule=Param(
                str,
                "algorithm1",
                "MAP stage lengths: local-epochs split in halves (Alg. 1 as printed: 'algorithm1'),"
                " local-epochs + map-personal-epochs ('epochs'), or the authors' code's steps ('code':"
                " max(E nb, 5), then max(int(0.1 x that), 5); int(Q T) in mu)",
                choices=("algorithm1", "epochs", "code"),
            ),
            hpm_init=Param(
                str,
                "none",
                "MAP: a first participation has no HPM (paper) or the initial model as its HPM ('initial', code)",
                choices=("none", "initial"),
            ),
            uniform_aggregation=Param(
                bool,
                True,
                "MAP: average uploads uniformly (Alg. 1 line 6); false = aggregation-weights (code, FedAvg)",
            ),
        ),
        _m(
            "fedphp",
            "fedphp:FedPHPStrategy",
            "fedphp:FedPHPTrainer",
            wire="FEDPHP",
            paper='Li, Zhan et al., "FedPHP: Federated Personalization with Inherited Private Models", ECML-PKDD 2021',
            **_hpm("FedPHP", soften_student=False, mu_max=0.9),
        ),
        _m(
            "fedproto",
            "fedproto:FedProtoStrategy",
            "fedproto:FedProtoTrainer",
            wire="FEDPROTO",
            paper='Tan et al., "FedProto: Federated Prototype Learning across Heterogeneous Clients", AAAI 2022',
            lambda_=Param(
                float,
                1.0,
                "FedProto: weight of the prototype distance (authors' code 1; its CIFAR-10 command 0.1)",
                low=0.0,
            ),
            weighting=Param(
                str,
                "counts",
                "FedProto: global prototype = sample-weighted mean over the holders (paper) or plain mean (code)",
                choices=("counts", "clients"),
            ),
            inference=Param(
                str,
                "prototype",
                "FedProto: personal prediction by the nearest global prototype (paper) or by the model's head",
                choices=("prototype", "classifier"),
            ),
        ),
        _m(
            "fedgela",
            "fedgela:FedGELAStrategy",
            "fedgela:FedGELATrainer",
            wire="FEDGELA",
            paper=(
                'Fan et al., "Federated Learning with Bilateral Curation for Partially Class-Disjoint Data" '
                "(FedGELA), NeurIPS 2023"
            ),
            head=Param(
                str,
                "paper",
                "FedGELA feature head: 'paper' (FC layer, L2-normalised, x sqrt(E_W)) or 'code' (authors' "
                "MLP + BatchNorm1d, no L2, / temperature)",
                choices=("paper", "code"),
            ),
            ew=Param(
                float,
                300.0,
                "FedGELA head 'paper': classifier length E_W, logits x sqrt(E_W) (paper 1e3..1e6; 300 from "
                "suites/fmnist-fedgela-ew.yaml)",
                low=0.0,
                low_open=True,
            ),
            temperature=Param(
                float,
                0.2,
                "FedGELA head 'code': logits / T (authors' --temperature, default 0.2)",
                low=0.0,
                low_open=True,
            ),
            mode=Param(
                str,
                "all",
                "FedGELA softmax: 'all' C-way, missing logits 0 (code); 'local' over C_k (Eq. 5)",
                choices=("all", "local"),
            ),
            adapt=Param(bool, True, "FedGELA: local adaptation phi_k (false = FedGE ablation, plain ETF)"),
            etf_seed=Param(int, 0, "FedGELA: seed of the server's random simplex ETF", low=0),
            clip=Param(float, 20.0, "FedGELA: local gradient-norm clip (authors' code; 0 = off)", low=0.0),
        ),
        _m(
            "moon",
            "moon:MOONStrategy",
            "moon:MOONTrainer",
            wire="MOON",
            paper='Li, He & Song, "Model-Contrastive Federated Learning", CVPR 2021',
            mu=Param(float, 1.0, "MOON: weight of the model-contrastive loss (authors' code default)", low=0.0),
            temperature=Param(
                float, 0.5, "MOON: temperature tau of the contrastive loss (paper and code)", low=0.0, low_open=True
            ),
        ),
        _m(
            "fedproc",
            "fedproc:FedProcStrategy",
            "fedproc:FedProcTrainer",
            wire="FEDPROC",
            paper=(
                'Mu et al., "FedProc: Prototypical Contrastive Federated Learning on Non-IID Data", FGCS 2023 '
                "(arXiv 2109.12273)"
            ),
            schedule=Param(
                str,
                "anneal",
                "FedProc: prototype-loss weight alpha_t = 1 - (t-1)/(R-1) ('anneal') or fedproc-alpha ('constant')",
                choices=("anneal", "constant"),
            ),
            alpha=Param(float, 0.5, "FedProc 'constant': L = alpha L_pc + (1 - alpha) CE", low=0.0, high=1.0),
            temperature=Param(
                float,
                1.0,
                "FedProc: temperature of the prototypical contrastive loss (1: the public re-implementation's cosine)",
                low=0.0,
                low_open=True,
            ),
        ),
        _m(
            "fedlc",
            "fedavg:FedAvgStrategy",
            "fedlc:FedLCTrainer",
            paper='Zhang et al., "Federated Learning with Label Distribution Skew via Logits Calibration", ICML 2022',
            tau=Param(
                float,
                1.0,
                "FedLC: logits calibrated by -tau * n_y^(-1/4), 0 = FedAvg (paper silent; FL-bench, PFLlib: 1)",
                low=0.0,
            ),
        ),
        _m(
            "fedmmd",
            "fedmmd:FedMMDStrategy",
            "fedmmd:FedMMDTrainer",
            wire="FEDMMD",
            paper='Yao, Huang & Sun, "Two-Stream Federated Learning: Reduce the Communication Costs", VCIP 2018',
            **{
                "lambda": Param(
                    float,
                    1e-3,
                    "FedMMD: weight of the feature MMD to the global model (FedRS ran 1e-4 and 1e-3)",
                    low=0.0,
                )
            },
        ),
        _m(
            "fedaws",
            "fedaws:FedAwSStrategy",
            "fedavg:FedAvgTrainer",
            paper='Yu et al., "Federated Learning with Only Positive Labels", ICML 2020',
            margin=Param(
                float, 0.8, "FedAwS: spreadout margin nu on the class-embedding distance (FedRS authors' code)", low=0.0
            ),
            distance=Param(
                str,
                "cosine",
                "FedAwS: 'cosine' (1 - cos)/2 (FedRS authors' code) or 'euclidean' ||w_c - w_c'||",
                choices=("cosine", "euclidean"),
            ),
            steps=Param(
                int, 30, "FedAwS: server SGD steps on the spreadout regularizer per round (FedRS authors' code)", low=0
            ),
            lr=Param(
                float,
                1e-3,
                "FedAwS: lr of those steps on the sum over class pairs (FedRS code's 0.1 on the C x C mean, C = 10)",
                low=0.0,
            ),
            momentum=Param(
                float,
                0.9,
                "FedAwS: momentum of those steps, fresh each round (FedRS authors' code)",
                low=0.0,
                high=1.0,
                high_open=True,
            ),
        ),
        _m(
            "fedgen",
            "fedgen:FedGenStrategy",
            "fedgen:FedGenTrainer",
            wire="FEDGEN",
            paper=(
                'Zhu, Hong & Zhou, "Data-Free Knowledge Distillation for Heterogeneous Federated Learning", ICML 2021'
            ),
            hidden_dim=Param(int, 256, "FedGen: generator hidden width (authors' code, MNIST/EMNIST)", low=1),
            noise_dim=Param(int, 32, "FedGen: generator noise dimension, eps ~ U[0,1) (authors' code)", low=1),
            lr=Param(float, 3e-4, "FedGen: generator Adam lr, x0.98 a round (authors' MNIST)", low=0.0, low_open=True),
            weight_decay=Param(float, 1e-2, "FedGen: generator Adam weight decay (authors' code)", low=0.0),
            iterations=Param(
                int,
                50,
                "FedGen: generator steps a round, batch = batch-size (authors' code)",
                low=0,
                rule=_fedgen_batch_rule,
            ),
            eta=Param(float, 1.0, "FedGen: weight of the generator's diversity loss (authors' code)", low=0.0),
            alpha=Param(float, 10.0, "FedGen client: weight of CE on generated features, x0.98 a round", low=0.0),
            beta=Param(
                float, 10.0, "FedGen client: weight of the code's latent KL term, x0.98 a round (0: paper)", low=0.0
            ),
            gen_batch_size=Param(int, 32, "FedGen client: labels sampled per mini-batch (authors' code)", low=1),
        ),
        _m(
            "creff",
            "creff:CReFFStrategy",
            "creff:CReFFTrainer",
            wire="CREFF",
            revision=1,  # 1: the feature matching's cosine divides by |a| |b| + 1e-6, as the authors' code
            paper=(
                'Shang et al., "Federated Learning on Heterogeneous and Long-Tailed Data via Classifier '
                'Re-Training with Federated Features", IJCAI 2022'
            ),
            features_per_class=Param(int, 100, "CReFF: federated features per class (authors' code)", low=1),
            match_iters=Param(int, 100, "CReFF: gradient-matching SGD steps a round (authors' code)", low=0),
            feature_lr=Param(
                float, 0.1, "CReFF: SGD lr of the federated features (authors' code)", low=0.0, low_open=True
            ),
            retrain_epochs=Param(int, 300, "CReFF: epochs re-training a fresh classifier (authors' code)", low=0),
            retrain_lr=Param(float, 0.01, "CReFF: SGD lr of the re-training (authors' code)", low=0.0, low_open=True),
            batch_real=Param(int, 32, "CReFF client: samples per class in one gradient draw (authors' code)", low=1),
            real_repeats=Param(int, 10, "CReFF client: draws averaged per class gradient (authors' code)", low=1),
        ),
        _m(
            "ditto",
            "ditto:DittoStrategy",
            "ditto:DittoTrainer",
            wire="DITTO",
            paper=(
                'Li, Hu, Beirami & Smith, "Ditto: Fair and Robust Federated Learning Through Personalization", '
                "ICML 2021"
            ),
            **{
                "lambda": Param(
                    float,
                    1.0,
                    "Ditto: lambda of the personal objective F_k(v) + lambda/2 ||v - w^t||^2 (code: 1)",
                    low=0.0,
                )
            },
            personal_epochs=Param(
                int,
                -1,
                "Ditto: personal epochs per round (-1: local-epochs, as the authors' code; at most 1000)",
                low=-1,
                high=1000,
            ),
        ),
        _m(
            "fedrep",
            "fedrep:FedRepStrategy",
            "fedrep:FedRepTrainer",
            wire="FEDREP",
            revision=1,  # 1: no weight decay on biases, as the authors' code
            paper=(
                'Collins, Hassani, Mokhtari & Shakkottai, "Exploiting Shared Representations for Personalized '
                'Federated Learning", ICML 2021'
            ),
            head_epochs=Param(
                int,
                10,
                "FedRep: head epochs (body frozen) before the local-epochs body epochs (code: 10; at most 1000)",
                low=0,
                high=1000,
            ),
        ),
        _m(
            "fedbabu",
            "fedbabu:FedBABUStrategy",
            "fedbabu:FedBABUTrainer",
            wire="FEDBABU",
            paper=(
                'Oh, Kim & Yun, "FedBABU: Toward Enhanced Representation for Federated Image Classification", ICLR 2022'
            ),
            finetune_epochs=Param(
                int,
                5,
                "FedBABU: fine-tuning epochs of the personalized model (code: 5; at most 1000)",
                low=0,
                high=1000,
            ),
            finetune_lr=Param(
                float, 0.001, "FedBABU: fine-tuning lr (authors' analysis.ipynb: 1e-3)", low=0.0, low_open=True
            ),
            finetune_part=Param(
                str, "full", "FedBABU: fine-tune the whole model (code) or the head only", choices=("full", "head")
            ),
        ),
        _m(
            "fedrod",
            "fedrod:FedRoDStrategy",
            "fedrod:FedRoDTrainer",
            wire="FEDROD",
            paper=(
                'Chen & Chao, "On Bridging Generic and Personalized Federated Learning for Image Classification", '
                "ICLR 2022"
            ),
            gamma=Param(float, 1.0, "FedRoD: balanced softmax, logits + gamma log N_c (1: Ren et al.'s BSM)", low=0.0),
        ),
    )
}


def get_method(name: str) -> MethodSpec:
    """The registered method `name`; raises KeyError listing the known ones."""
    try:
        return METHODS[name]
    except KeyError:
        raise KeyError(f"unknown method {name!r}: known are {', '.join(sorted(METHODS))}") from None
