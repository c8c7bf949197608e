"""Hooks inside a model: hook points, their captures and interventions (`points.py`), a function's
`intervene:` entries checked (`interventions.py`), per-row parameters resolved as rows are read
(`row_steer.py`) and gathered per slot in a batch (`row_tables.py`)."""
