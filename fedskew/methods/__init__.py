"""The methods' cards, one module per method: its strategy and trainer, its run-config keys, its
wire records and its paper (`fedskew.methods.card.MethodSpec`). `fedskew/registry.py` is their index."""
