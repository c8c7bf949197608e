"""Config: the typed schemas (`schema`: the core's keys; `modes`: the batching modes'), each group's
dataclass the one home of its defaults, their value checks, the devices, the nodes YAML extends
(`nodes`) and the reference written from them (`docs`). The edge that reads Hydra config is
`forge.cli.build`."""
