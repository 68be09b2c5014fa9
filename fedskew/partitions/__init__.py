"""Label-skew partitions: labels + seed in, one index array per client out (pure numpy).

Every function takes the training labels, the number of clients and a `numpy.random.Generator`,
and returns a list of disjoint int64 index arrays. `partition()` picks one by run-config name,
`split_local_test()` cuts each client's share into a local train and test part that follow the
client's label distribution, and `stats` counts, measures the skew of and draws the result.
"""

from fedskew.partitions.core import (
    PartitionError,
    classes_per_client_label_quantity,
    classes_per_client_pfllib_pat,
    classes_per_client_pmcn,
    classes_per_client_shards,
    dirichlet,
    iid,
    long_tail,
    map_random,
    partition,
    split_local_test,
)
from fedskew.partitions.stats import class_counts, format_counts, format_skew, partition_skew, plot_counts

__all__ = [
    "PartitionError",
    "class_counts",
    "classes_per_client_label_quantity",
    "classes_per_client_pfllib_pat",
    "classes_per_client_pmcn",
    "classes_per_client_shards",
    "dirichlet",
    "format_counts",
    "format_skew",
    "iid",
    "long_tail",
    "map_random",
    "partition",
    "partition_skew",
    "plot_counts",
    "split_local_test",
]
