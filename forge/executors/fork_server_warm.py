"""Imported by a process that forks model workers (the process executor's fork server, a
`forge server`) once transformers is: what every worker's first model load would build, built
once before the forks, so each worker inherits it (`forge.runtime.model.hf_compat.prebuild_load_tables`).

Measured on the embedded model, in processes forked after the same imports: a worker's
`open_worker` took 0.12 s, 0.07 s with transformers' checkpoint conversion table built before
the fork. Each replaced worker and each warm command's worker saves that; a cold run's first
worker does not, since its fork server builds the table on the same path to the first batch.
"""

from __future__ import annotations

from forge.runtime.model.hf_compat import prebuild_load_tables

prebuild_load_tables()
