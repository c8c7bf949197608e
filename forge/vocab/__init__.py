"""The ground floor: the vocabulary every layer shares (token geometry, the records that cross
the engine's seams, small containers). It imports nothing of Forge but `forge.errors`."""
