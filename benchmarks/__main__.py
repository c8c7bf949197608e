"""`python -m benchmarks NAME [options]`: run one benchmark by name; without a name, list them.

Each benchmark's `--help` gives its options: the common ones (`--rounds`, `--rows`, `--seed`,
`--only`, `--out`) come from benchmarks/harness.py, the rest are its own. benchmarks/README.md
says what each measures; docs/benchmarks.md holds the figures.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys

#: name -> (module, the extra its peers need, or ""), in the order listed, by group
GROUPS: dict[str, dict[str, tuple[str, str]]] = {
    "against the real peers (benchmarks/peers/)": {
        "peers": ("benchmarks.peers.bench_peers", "bench"),
        "embed": ("benchmarks.peers.bench_embed", "minilm"),
        "token-states": ("benchmarks.peers.bench_token_states", "bench-token-states"),
        "generate": ("benchmarks.peers.bench_generate", "bench"),
        "generate-cold": ("benchmarks.peers.gen_cold", "bench"),
    },
    "scale and batching (benchmarks/scale/)": {
        "scale": ("benchmarks.scale.bench_scale", ""),
        "mix": ("benchmarks.scale.bench_mix", ""),
        "packer": ("benchmarks.scale.bench_packer", ""),
        "strategies": ("benchmarks.scale.bench_strategies", ""),
        "tree-mask": ("benchmarks.scale.bench_tree_mask", ""),
        "ray": ("benchmarks.scale.bench_ray", "bench"),
        "datasets": ("benchmarks.scale.bench_datasets", "datasets"),
    },
    "start-up (benchmarks/startup/)": {
        "startup": ("benchmarks.startup.bench_startup", ""),
    },
    "trackers": {
        "trackers": ("benchmarks.bench_trackers", "trackers"),
    },
    "faults": {
        "faults": ("benchmarks.fault_scenarios", ""),
        "soak": ("benchmarks.soak", ""),
        "kill-halfway": ("benchmarks.bench_kill_halfway", ""),
    },
    "helpers, not benchmarks": {
        "realistic": ("benchmarks.peers.realistic", ""),
        "compare-trees": ("benchmarks.dev.compare_trees", ""),
        "capture": ("benchmarks.dev.bench_capture", ""),
        "tracker-cost": ("benchmarks.dev.tracker_cost", "trackers"),
        "rss-floor": ("benchmarks.dev.rss_floor", ""),
    },
}
BENCHMARKS = {name: entry for group in GROUPS.values() for name, entry in group.items()}


def summary(module: str) -> str:
    """The first paragraph of a module's docstring, read without importing it (torch is slow)."""
    spec = importlib.util.find_spec(module)
    with open(spec.origin) as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    return " ".join(doc.split("\n\n")[0].split())


def listing() -> str:
    lines = [__doc__.splitlines()[0], ""]
    width = max(map(len, BENCHMARKS))
    for group, entries in GROUPS.items():
        lines.append(f"{group}:")
        for name, (module, extra) in entries.items():
            needs = f" [needs pip install -e '.[{extra}]']" if extra else ""
            lines.append(f"  {name:<{width}}  {summary(module)}{needs}")
        lines.append("")
    lines.append("python -m benchmarks NAME --help: a benchmark's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(listing())
        return
    name, rest = args[0], args[1:]
    if name not in BENCHMARKS:
        print(listing(), file=sys.stderr)
        sys.exit(f"\npython -m benchmarks: no benchmark {name!r}")
    # every benchmark parses sys.argv, as it does when run as its own module (soak.py's parser is its own)
    sys.argv = [f"python -m benchmarks {name}", *rest]
    importlib.import_module(BENCHMARKS[name][0]).main()


if __name__ == "__main__":
    main()
