"""The driver: a run (`engine.execute`) and a plan (`plan.plan`) from a typed `RunSpec`, their
report, and the disk check before a run. It sits under the CLI and over everything else."""
