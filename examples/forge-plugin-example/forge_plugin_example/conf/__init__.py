"""Config groups this plugin adds: function/token_norms.yaml, batching/sorted.yaml."""
