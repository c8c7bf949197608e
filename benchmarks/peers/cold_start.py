"""What any exact tool pays on this machine before its first batch, and whether a target allows it.

Model: a run that computes a model's outputs exactly starts a Python process, imports torch and
the model's `transformers` code, and loads the weights before its first forward, whatever the
tool. `measure` times that in a fresh interpreter (`SCRIPT`: `AutoConfig`, the family's modeling
module, `from_pretrained`, one 8-token forward), from the moment the process is spawned, in the
environment the benchmark gives every variant. A workload then needs at least that cold start
plus its cache-aware floor (`benchmarks/floor.py`: each distinct prefix once, every suffix, no
padding, at the best rate measured): `Target.judge` sets that least time against what a ratio
to the best peer allows, so a run says which targets this machine permits at all.

Both sides are taken at their best (the fastest cold start measured, the floor at its best
rates) and the peer at its median, so the least time is never overstated: "not reachable" means
no exact tool could have met the target in that run, Forge or any other.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass

#: the child: imports, load and one forward, each moment as time.time() (one clock with the parent)
SCRIPT = """
import json, os, sys, time
model_dir, loader, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
import torch
import transformers
from transformers import AutoConfig
from transformers.models.auto import modeling_auto as auto

config = AutoConfig.from_pretrained(model_dir)
mapping = auto.MODEL_FOR_CAUSAL_LM_MAPPING if loader == "causal" else auto.MODEL_MAPPING
cls = mapping[type(config)]  # imports the family's modeling module
imported = time.time()
torch.set_num_threads(threads)
model = cls.from_pretrained(model_dir, dtype=torch.float32).eval()
loaded = time.time()
with torch.inference_mode():
    model(input_ids=torch.ones(1, 8, dtype=torch.long))
done = time.time()
sys.stdout.write(json.dumps({"imported": imported, "loaded": loaded, "forward": done}) + "\\n")
sys.stdout.flush()
os._exit(0)  # no teardown of torch: not part of what comes before a first batch
"""


@dataclass(frozen=True, slots=True)
class ColdStart:
    """A fresh interpreter's way to its first forward, in seconds."""

    imports_s: float  # from the spawn until torch and the family's modeling code are imported (the config read)
    load_s: float  # the model's `from_pretrained` alone
    forward_s: float  # one 8-token forward

    @property
    def ready_s(self) -> float:
        """From the spawn until the model is loaded: what precedes any exact first forward."""
        return self.imports_s + self.load_s


def measure(model_dir: str, loader: str, threads: int, env: dict[str, str]) -> ColdStart:
    """One cold start of `model_dir` (`loader`: causal | encoder) in a fresh interpreter."""
    t0 = time.time()
    p = subprocess.run(
        [sys.executable, "-c", SCRIPT, model_dir, loader, str(threads)], capture_output=True, text=True, env=env
    )
    if p.returncode:
        raise RuntimeError(f"the cold-start probe failed ({p.returncode}):\n{p.stderr[-2000:]}")
    return parse(p.stdout, t0)


def parse(stdout: str, spawned: float) -> ColdStart:
    """The child's moments (its last output line) as a `ColdStart`; `spawned`: when it was spawned."""
    marks = json.loads(stdout.strip().splitlines()[-1])
    return ColdStart(
        marks["imported"] - spawned, marks["loaded"] - marks["imported"], marks["forward"] - marks["loaded"]
    )


def fastest(starts: list[ColdStart]) -> ColdStart:
    """The best of several cold starts, phase by phase (the machine's speed drifts), so that
    `ready_s` is never above any one start's."""
    return ColdStart(min(s.imports_s for s in starts), min(s.load_s for s in starts), min(s.forward_s for s in starts))


@dataclass(frozen=True, slots=True)
class Target:
    """A wall-time target: at least `ratio` x the best peer's median."""

    ratio: float

    def judge(self, peer_s: float, start: ColdStart, floor_s: float) -> tuple[float, float, bool]:
        """(seconds the target allows, least seconds any exact tool needs here, reachable)."""
        allowed = peer_s / self.ratio
        least = start.ready_s + floor_s
        return allowed, least, least <= allowed


#: the first-batch target of issue 20: the first batch at most this long after the model's load
FIRST_BATCH_AFTER_LOAD_S = 2.0


def first_batch_reachable(start: ColdStart) -> bool:
    """Whether a cold start can have its first batch within `FIRST_BATCH_AFTER_LOAD_S` of its
    model's load: not when the imports before the load take longer than that."""
    return start.imports_s <= FIRST_BATCH_AFTER_LOAD_S


def issue_target(function: str, size: int) -> float:
    """Issue 20's ratio to the best peer for `function` on a workload of `size` questions or rows."""
    if function == "score":
        return 3.0 if size >= 2000 else 2.0
    if function == "probe_gen":
        return 5.0 if size >= 3000 else 3.0
    return 1.0  # embed: no slower than sentence-transformers
