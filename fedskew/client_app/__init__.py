"""Client side: the ClientApp entry (`app.py`), the trainer base (`base.py`), one trainer per method
(`<method>.py`) and the per-client state store (`state.py`)."""
