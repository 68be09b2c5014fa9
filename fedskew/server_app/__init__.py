"""Server side: the ServerApp entry (`app.py`), the round loop and central evaluation, and the
results writer (`results.py`)."""
