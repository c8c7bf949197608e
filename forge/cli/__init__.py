"""The `forge` command line (`forge.cli.app:app`) and what it prints and draws."""
