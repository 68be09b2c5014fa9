"""The partition schemes of the label-skew papers, as pure numpy functions."""

from __future__ import annotations

from typing import Any

import numpy as np

Parts = list[np.ndarray]


class PartitionError(ValueError):
    """The requested partition cannot be built for these labels and this many clients."""


def _as_parts(lists: list[list[int]] | list[np.ndarray]) -> Parts:
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in lists]


def iid(labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> Parts:
    """Shuffle all indices and cut them into `num_clients` near-equal parts."""
    if num_clients > len(labels):
        raise PartitionError(f"iid: {num_clients} clients but only {len(labels)} samples")
    return _as_parts(np.array_split(rng.permutation(len(labels)), num_clients))


def dirichlet(
    labels: np.ndarray,
    num_clients: int,
    alpha: float,
    rng: np.random.Generator,
    min_size: int = 10,
    max_tries: int = 1000,
) -> Parts:
    """NIID-Bench label skew (Li et al., ICDE'22): per class c draw q_c ~ Dir(alpha 1_K).

    A client already holding >= N/K samples gets no more (q_{c,k} := 0, renormalised), and the
    whole draw is repeated until every client holds at least `min_size` samples. Their draws call for
    call (Flower's niid_bench `partition_data_dirichlet`): `default_rng(s)` gives their split at s.
    """
    n, classes = len(labels), np.unique(labels)
    if num_clients * min_size > n:
        raise PartitionError(f"dirichlet: {num_clients} clients x min-partition-size {min_size} > {n} samples")
    for _ in range(max_tries):
        parts: list[list[int]] = [[] for _ in range(num_clients)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(labels == c))
            q = rng.dirichlet(np.full(num_clients, alpha))
            q = q * np.array([len(p) < n / num_clients for p in parts])
            q = q / q.sum() if q.sum() > 0 else np.full(num_clients, 1 / num_clients)
            cuts = (np.cumsum(q) * len(idx)).astype(int)[:-1]
            for k, chunk in enumerate(np.split(idx, cuts)):
                parts[k] += chunk.tolist()
        if min(len(p) for p in parts) >= min_size:
            return _as_parts(parts)
    raise PartitionError(
        f"dirichlet: no draw in {max_tries} gave every client >= {min_size} samples "
        f"(dirichlet-alpha={alpha}, {num_clients} clients); lower min-partition-size or raise alpha"
    )


def _split_class_among(
    labels: np.ndarray, holders: dict[int, list[int]], num_clients: int, rng: np.random.Generator
) -> Parts:
    """Split each class's shuffled samples evenly among the clients that hold it."""
    parts: list[list[int]] = [[] for _ in range(num_clients)]
    for c, clients in holders.items():
        idx = rng.permutation(np.flatnonzero(labels == c))
        for k, chunk in zip(clients, np.array_split(idx, len(clients)), strict=True):
            parts[k] += chunk.tolist()
    return _as_parts(parts)


def _classes_for(labels: np.ndarray, m: int) -> np.ndarray:
    """The classes of `labels`, refusing `m` classes a client when there are fewer."""
    classes = np.unique(labels)
    if m > len(classes):
        raise PartitionError(f"classes-per-client={m} > {len(classes)} classes")
    return classes


def classes_per_client_pmcn(labels: np.ndarray, num_clients: int, m: int, rng: np.random.Generator) -> Parts:
    """FedGELA/FedMR "PρCς" (App. C.1.2): deal classes 0..C-1 in order, m per client, until each
    class is dealt once; fill the remaining slots with distinct random classes; then split each
    class evenly among its holders. Every client gets exactly m distinct classes.
    """
    classes = _classes_for(labels, m)
    num_classes = len(classes)
    if num_clients * m < num_classes:
        raise PartitionError(
            f"classes-per-client={m} x {num_clients} clients < {num_classes} classes: some class would have no client"
        )
    owned: list[list[int]] = [[] for _ in range(num_clients)]
    for i, c in enumerate(classes):
        owned[i // m].append(int(c))
    for k in range(num_clients):
        rest = [int(c) for c in classes if c not in owned[k]]
        owned[k] += rng.choice(rest, m - len(owned[k]), replace=False).tolist()
    holders: dict[int, list[int]] = {int(c): [] for c in classes}
    for k, cs in enumerate(owned):
        for c in cs:
            holders[c].append(k)
    return _split_class_among(labels, holders, num_clients, rng)


def classes_per_client_shards(labels: np.ndarray, num_clients: int, m: int, rng: np.random.Generator) -> Parts:
    """FedRS "C10-100-m" (§5.2): concatenate K random permutations of the C classes; client k
    takes slice [k m, (k+1) m), i.e. m distinct classes when m divides C; each class is split
    evenly among its holders.
    """
    classes = np.unique(labels)
    if len(classes) % m:
        raise PartitionError(f"shards: classes-per-client={m} must divide {len(classes)} classes")
    order = np.concatenate([rng.permutation(classes) for _ in range(num_clients)])
    holders: dict[int, list[int]] = {int(c): [] for c in classes}
    for k in range(num_clients):
        for c in order[k * m : (k + 1) * m]:
            holders[int(c)].append(k)
    empty = [c for c, h in holders.items() if not h]
    if empty:
        raise PartitionError(f"shards: classes {empty} fell to no client; use more clients")
    return _split_class_among(labels, holders, num_clients, rng)


def classes_per_client_label_quantity(labels: np.ndarray, num_clients: int, m: int, rng: np.random.Generator) -> Parts:
    """NIID-Bench's quantity-based label skew "#C=m" (Li et al., ICDE'22; their `partition_data`
    "noniid-#label<m>", Flower's niid_bench `partition_data_label_quantity`): client k holds class
    k mod C plus m - 1 other distinct classes drawn uniformly at random; each class's shuffled samples
    are split evenly among its holders in client order. Client sizes vary with the number of holders
    a class draws. Needs at least C clients, so that every class has one. The draws are theirs call
    for call (a class index `rng.choice(C, 1)` until it is a new one, then one shuffle a class), so
    that `np.random.default_rng(s)` gives their split at their seed s index for index.
    """
    classes = _classes_for(labels, m)
    num_classes = len(classes)
    if num_clients < num_classes:
        raise PartitionError(
            f"label-quantity: {num_clients} clients < {num_classes} classes: client k holds class k mod "
            f"{num_classes}, so some class would have no client; use at least {num_classes} clients"
        )
    holders: dict[int, list[int]] = {int(c): [] for c in classes}
    for k in range(num_clients):
        held = [int(classes[k % num_classes])]
        while len(held) < m:
            c = int(classes[rng.choice(num_classes, 1)[0]])
            if c not in held:
                held.append(c)
        for c in held:
            holders[c].append(k)
    return _split_class_among(labels, holders, num_clients, rng)


def classes_per_client_pfllib_pat(labels: np.ndarray, num_clients: int, m: int, rng: np.random.Generator) -> Parts:
    """PFLlib's "pat" split with balance off (`dataset/utils/dataset_utils.py`, `separate_data`):
    class by class in label order, the class goes to the first h = ceil(K m / C) clients that hold
    fewer than m classes (K = 20, m = 2: clients 0-3 hold {0, 1}, 4-7 {2, 3}, ...), its shuffled
    samples cut into h parts, the first h - 1 of sizes drawn uniformly from [int(s / 10), int(s)),
    s = n_c / h, the last the rest. Their floor max(s / 10, least_samples / C) is s / 10 unless s
    is under 10 least_samples / C; they cut the class in data-set order, here after a shuffle. A
    class that finds no client with room is refused (theirs divides by zero).
    """
    classes = np.unique(labels)
    room = [m] * num_clients
    reach = int(np.ceil(num_clients / len(classes) * m))
    parts: list[list[int]] = [[] for _ in range(num_clients)]
    for c in classes:
        holders = [k for k in range(num_clients) if room[k] > 0][:reach]
        idx = rng.permutation(np.flatnonzero(labels == c))
        if not holders or len(idx) < len(holders):
            raise PartitionError(
                f"pfllib-pat: class {int(c)} ({len(idx)} samples) finds {len(holders)} clients with room "
                f"({num_clients} clients x classes-per-client={m}); use more clients or classes a client"
            )
        share = len(idx) / len(holders)
        sizes = rng.integers(int(share / 10), int(share), size=len(holders) - 1).tolist()
        for k, chunk in zip(holders, np.split(idx, np.cumsum(sizes)), strict=True):
            parts[k] += chunk.tolist()
            room[k] -= 1
    return _as_parts(parts)


def long_tail(
    labels: np.ndarray,
    num_clients: int,
    imbalance_factor: float,
    alpha: float,
    rng: np.random.Generator,
    min_size: int = 10,
) -> Parts:
    """MuPFL/CReFF long-tailed + Dirichlet: keep n_c = floor(n_max IF^(-c/(C-1))) samples of class
    c (c in label order, so class 0 is the head), then split with `dirichlet`.
    """
    classes = np.unique(labels)
    n_max = max(int((labels == c).sum()) for c in classes)
    keep = []
    for i, c in enumerate(classes):
        n_c = int(n_max * imbalance_factor ** (-i / max(len(classes) - 1, 1)))
        idx = np.flatnonzero(labels == c)
        keep.append(rng.choice(idx, min(n_c, len(idx)), replace=False))
    kept = np.sort(np.concatenate(keep))
    parts = dirichlet(labels[kept], num_clients, alpha, rng, min_size=min_size)
    return _as_parts([kept[p] for p in parts])


def map_random(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    sigma: float = 0.3,
    min_size: int = 5,
    max_tries: int = 1000,
) -> Parts:
    """MAP's `split="map"`: client k draws n_k ~ U{2..C} distinct classes with weight 1/n_k,
    scaled by s_k ~ LogNormal(0, sigma); each class column is normalised over clients and class c
    is cut into consecutive slices of those shares. Redrawn until every client has `min_size`
    samples (the authors drop small clients instead; Flower's client count is fixed).
    """
    classes = np.unique(labels)
    num_classes = len(classes)
    if num_classes < 2:
        raise PartitionError("map-random needs at least 2 classes")
    for _ in range(max_tries):
        weights = np.zeros((num_clients, num_classes))
        for k in range(num_clients):
            n_k = rng.integers(2, num_classes + 1)
            weights[k, rng.choice(num_classes, n_k, replace=False)] = 1.0 / n_k
        weights *= rng.lognormal(0.0, sigma, size=(num_clients, 1))
        col = weights.sum(axis=0)
        if (col == 0).any():
            continue
        shares = weights / col
        parts: list[list[int]] = [[] for _ in range(num_clients)]
        for j, c in enumerate(classes):
            idx = rng.permutation(np.flatnonzero(labels == c))
            cuts = np.round(np.cumsum(shares[:, j]) * len(idx)).astype(int)[:-1]
            for k, chunk in enumerate(np.split(idx, cuts)):
                parts[k] += chunk.tolist()
        if min(len(p) for p in parts) >= min_size:
            return _as_parts(parts)
    raise PartitionError(f"map-random: no draw in {max_tries} gave every client >= {min_size} samples")


def split_local_test(
    part: np.ndarray, labels: np.ndarray, fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Cut one client's indices into (train, test), per class: floor(fraction n_c) of class c go to
    test, so the local test split follows the client's label distribution. If that leaves the
    test split empty while fraction > 0, one sample of the client's largest class goes to test.
    """
    train, test = [], []
    for c in np.unique(labels[part]):
        idx = rng.permutation(part[labels[part] == c])
        n_test = int(np.floor(fraction * len(idx)))
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    tr, te = np.concatenate(train), np.concatenate(test)
    if fraction > 0 and len(te) == 0 and len(tr) > 1:
        counts = np.bincount(labels[tr])
        pick = int(np.flatnonzero(labels[tr] == counts.argmax())[0])
        te, tr = tr[pick : pick + 1], np.delete(tr, pick)
    return np.sort(tr), np.sort(te)


def partition(labels: np.ndarray, num_clients: int, cfg: dict[str, Any], seed: int) -> Parts:
    """Dispatch on `cfg["partition"]` with the run-config keys of that scheme."""
    if num_clients < 1:
        raise PartitionError(f"need at least one client, got {num_clients}")
    rng = np.random.default_rng(seed)
    name = cfg["partition"]
    if name == "iid":
        return iid(labels, num_clients, rng)
    if name == "dirichlet":
        return dirichlet(labels, num_clients, cfg["dirichlet-alpha"], rng, cfg["min-partition-size"])
    if name == "classes-per-client":
        fn = {
            "pmcn": classes_per_client_pmcn,
            "shards": classes_per_client_shards,
            "label-quantity": classes_per_client_label_quantity,
            "pfllib-pat": classes_per_client_pfllib_pat,
        }[cfg["classes-per-client-mode"]]
        return fn(labels, num_clients, cfg["classes-per-client"], rng)
    if name == "long-tail":
        return long_tail(
            labels,
            num_clients,
            cfg["imbalance-factor"],
            cfg["dirichlet-alpha"],
            rng,
            cfg["min-partition-size"],
        )
    if name == "map-random":
        return map_random(labels, num_clients, rng, cfg["map-sigma"], min(cfg["min-partition-size"], 5))
    raise PartitionError(f"unknown partition {name!r}")
