"""The core: token geometry, admission, the scheduler, the run loop and the driver (`engine`, `plan`)."""
