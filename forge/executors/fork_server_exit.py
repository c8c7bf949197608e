"""Imported by the process executor's fork server alone (its first preload), never by the driver.

Model: the fork server ends when the driver exits (it reads end of file on its pipe and raises
SystemExit). Python would then tear down every module it preloaded, torch and transformers
included: 0.7 s of a CPU core, after the command has returned, on a machine whose next
command may already be starting. The fork server holds nothing to flush or free (its workers
are separate processes, which end with `os._exit` as multiprocessing forks them), so this
module's exit handler, registered before any other in that process and therefore run last,
ends it at once once the others have run.
"""

from __future__ import annotations

import atexit
import os

atexit.register(os._exit, 0)
