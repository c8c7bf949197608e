"""What a batch costs a device: its peak bytes, measured on fake tensors (`memory_fit.py`,
`fake_encoder.py`) or estimated (`models.py`, per function kind), and a step's time (`calibrate.py`)."""
