"""SCAFFOLD + restricted softmax server (FedRS's Tables 1, 4 and 5, last row): SCAFFOLD's server
(`fedskew/strategies/scaffold.py`) with the key `scaffold-rs-server-lr`; the restricted softmax is a
client matter (`fedskew/client_app/scaffold_rs.py`)."""

from fedskew.strategies.scaffold import ScaffoldStrategy


class ScaffoldRSStrategy(ScaffoldStrategy):
    """SCAFFOLD's server for clients that train with the restricted softmax."""

    prefix = "scaffold-rs"
