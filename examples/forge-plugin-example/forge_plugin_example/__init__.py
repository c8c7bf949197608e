"""An example third-party Forge plugin: the `token_norms` function and the `sorted` batching mode."""
