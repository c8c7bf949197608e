"""What a process holds before it runs anything: resident memory after each import and load, in order.

    python -m benchmarks rss-floor

Each step runs in one fresh interpreter, in the order listed, and the resident set size (RSS,
`/proc/self/statm`) is read after it: `import torch`; the embedded model's config through
`AutoConfig` (transformers' configuration machinery); `transformers.modeling_utils`; the model
through `AutoModelForCausalLM`; its tokenizer; a pyarrow table (pyarrow imports pandas on the
first array it converts); then Hydra, OmegaConf, rich and `forge.api`. The first five are what
any process that holds a transformers model pays (the peers' scripts included); the last two are
what Forge adds to write Parquet results and compose its config. `generate-cold` reports each
tool's summed peak, against which these floors are read (docs/benchmarks.md).
"""

from __future__ import annotations

import os
import subprocess
import sys

STEPS = """
import sys, time
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE
import os
PAGE = os.sysconf("SC_PAGE_SIZE")
def step(name, fn):
    t = time.perf_counter()
    fn()
    print(f"{name}\\t{rss()}\\t{time.perf_counter() - t:.2f}", flush=True)
step("interpreter", lambda: None)
g = {}
step("import torch", lambda: g.update(torch=__import__("torch")))
def source():
    from forge.runtime.model.embedded import embedded_model_source, materialize_model
    g["dir"] = str(materialize_model(embedded_model_source()))
    from transformers import AutoConfig
    g["config"] = AutoConfig.from_pretrained(g["dir"])
step("transformers config (AutoConfig)", source)
step("import transformers.modeling_utils", lambda: __import__("transformers.modeling_utils"))
def model():
    from transformers import AutoModelForCausalLM
    g["model"] = AutoModelForCausalLM.from_pretrained(g["dir"], dtype=g["torch"].float32).eval()
step("model loaded (AutoModelForCausalLM)", model)
def tokenizer():
    from transformers import AutoTokenizer
    g["tok"] = AutoTokenizer.from_pretrained(g["dir"])
step("tokenizer loaded", tokenizer)
def arrow():
    import pyarrow as pa
    g["table"] = pa.table({"text": pa.array(["a", "b"])})
step("a pyarrow table (pyarrow, and pandas through it)", arrow)
def forge_api():
    import hydra, omegaconf, rich.console, forge.api  # noqa: F401
step("hydra, omegaconf, rich, forge.api", forge_api)
"""


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.parse_args(argv)  # --help only
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", STEPS], capture_output=True, text=True, check=True, env=env)
    rows = [line.split("\t") for line in out.stdout.splitlines() if line.count("\t") == 2]
    print("| step (one fresh process, in order) | RSS after, MiB | added, MiB | s |\n| --- | --- | --- | --- |")
    last = 0
    for name, resident, seconds in rows:
        mib = int(resident) / 2**20
        print(f"| {name} | {mib:,.0f} | {mib - last:+,.0f} | {seconds} |")
        last = mib


if __name__ == "__main__":
    main()
