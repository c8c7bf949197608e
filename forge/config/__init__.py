"""Config: the typed schema (each group's dataclass is its defaults), its value checks, the
devices, and the edge that reads Hydra config (`build`)."""
