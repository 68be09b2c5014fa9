"""Server side of each method: one Flower strategy per method (`<method>.py`), all subclassing
`BaseStrategy` (`base.py`); pure aggregation maths in `aggregate.py`."""
