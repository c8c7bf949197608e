"""`forge probe RUN_DIR`: a linear probe per layer on a probe_gen run's activations.

Model: every labelled item goes to the test set when a hash of its id falls below the test
fraction, else to training, so the split depends on the id alone (not on order, not on a
seed, the same on every rerun and for every layer). Per layer, features are standardised
on the training set and scikit-learn's `LogisticRegression` is fitted; test accuracy gets a
95% Wilson score interval (binomial, k correct of n test items). Chance is the test accuracy
of always answering the training set's most frequent class.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from forge.errors import ForgeError

Z95 = 1.959963984540054  # two-sided 95% normal quantile
MIN_ITEMS = 10  # labelled items below which no probe is fitted


@dataclass(frozen=True)
class LayerProbe:
    """One layer's probe, as written to probe.json."""

    layer: int  # hidden-state index as probe_gen saved it
    accuracy: float  # correct / test_items
    ci_low: float  # 95% Wilson interval on the accuracy
    ci_high: float
    correct: int  # test items predicted right
    test_items: int
    train_items: int
    train_accuracy: float  # on the items it was fitted to (a gap to `accuracy` is overfitting)


def in_test(item_id: str, test_fraction: float) -> bool:
    """Whether `item_id` is a test item: the first 8 bytes of its SHA-256, as a fraction of 2^64."""
    digest = hashlib.sha256(str(item_id).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < test_fraction


def wilson(correct: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion correct / n."""
    if n == 0:
        return 0.0, 1.0
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def fit_probes(
    ids: Sequence[str],
    labels: Sequence[Any],
    layers: dict[int, np.ndarray],
    *,
    test_fraction: float = 0.25,
    c: float = 1.0,
    max_iter: int = 2000,
) -> dict[str, Any]:
    """Fit one probe per layer; the result is what probe.json holds (without the run's paths)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    if not 0 < test_fraction < 1:
        raise ForgeError(f"--test-fraction={test_fraction}: must be between 0 and 1 (exclusive)")
    keep = [i for i, label in enumerate(labels) if label is not None]
    if not keep:
        raise ForgeError(
            "no labels: the run's input rows carry no `label`; add a label column to the input and run probe_gen again"
        )
    try:
        classes = sorted({_key(labels[i]) for i in keep}, key=lambda v: (type(v).__name__, v))
    except TypeError:
        bad = next(labels[i] for i in keep if not isinstance(labels[i], (int, str, bool, float)))
        raise ForgeError(f"label {bad!r}: labels must be numbers or strings") from None
    if len(classes) < 2:
        raise ForgeError(f"labels have one class only ({classes[0]!r}, {len(keep)} items); a probe needs two or more")
    if len(keep) < MIN_ITEMS:
        raise ForgeError(f"too few labelled items ({len(keep)}); a probe needs at least {MIN_ITEMS}")
    y = np.array([classes.index(_key(labels[i])) for i in keep])
    test = np.array([in_test(ids[i], test_fraction) for i in keep])
    if test.all() or not test.any():
        raise ForgeError(
            f"too few labelled items ({len(keep)}) to split {test_fraction:.0%} / "
            f"{1 - test_fraction:.0%} by id; add items or change --test-fraction"
        )
    if len(np.unique(y[~test])) < 2:
        raise ForgeError("the training split holds one class only; add items or change --test-fraction")
    majority = np.bincount(y[~test], minlength=len(classes)).argmax()
    chance = float(np.mean(y[test] == majority))
    test_ids = sorted(str(ids[i]) for i, t in zip(keep, test) if t)
    fits = []
    for layer in sorted(layers):
        x = np.asarray(layers[layer], np.float64)[keep]
        model = make_pipeline(StandardScaler(), LogisticRegression(C=c, max_iter=max_iter))
        model.fit(x[~test], y[~test])
        correct = int(np.sum(model.predict(x[test]) == y[test]))
        n_test = int(test.sum())
        low, high = wilson(correct, n_test)
        fits.append(
            LayerProbe(
                layer,
                correct / n_test,
                low,
                high,
                correct,
                n_test,
                int((~test).sum()),
                float(np.mean(model.predict(x[~test]) == y[~test])),
            )
        )
    return {
        "layers": [asdict(f) for f in fits],
        "classes": classes,
        "chance": chance,
        "items": len(ids),
        "labelled": len(keep),
        "interval": "Wilson score, 95%",
        "split": {
            "method": "sha256(id) < test_fraction",
            "test_fraction": test_fraction,
            "test_items": len(test_ids),
            "test_ids_sha256": hashlib.sha256("\n".join(test_ids).encode()).hexdigest(),
        },
        "probe": {"model": "StandardScaler + LogisticRegression", "C": c, "max_iter": max_iter},
    }


def _key(label: Any) -> Any:
    """Labels as comparable class keys (JSON gives ints, strings or booleans)."""
    return int(label) if isinstance(label, bool) else label


def probe_run(
    run_dir: str | Path, out: Path | None = None, plot: Path | None = None, test_fraction: float = 0.25, c: float = 1.0
) -> dict[str, Any]:
    """Fit probes on a probe_gen run; write probe.json and probe.png (default: in the run dir)."""
    from forge import load_activations

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ForgeError(f"{run_dir}: no such run directory")
    try:
        ids, labels, layers = load_activations(run_dir)
    except ForgeError as exc:
        raise ForgeError(f"{run_dir} is not a probe_gen run with activations ({exc})") from None
    if not ids:
        raise ForgeError(f"{run_dir}: the run committed no activations; finish it (resume=true) first")
    result = fit_probes(
        ids, labels, {layer: t.numpy() for layer, t in layers.items()}, test_fraction=test_fraction, c=c
    )
    out = out or run_dir / "probe.json"
    plot = plot or run_dir / "probe.png"
    result = {"run_dir": str(run_dir), **result, "plot": str(plot)}
    out.write_text(json.dumps(result, indent=2))
    draw(result, plot)
    return result


def draw(result: dict[str, Any], path: Path) -> None:
    """Test accuracy per layer with its interval, and the chance line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["layers"]
    x = [r["layer"] for r in rows]
    acc = np.array([r["accuracy"] for r in rows])
    err = np.array([[a - r["ci_low"] for a, r in zip(acc, rows)], [r["ci_high"] - a for a, r in zip(acc, rows)]])
    fig, ax = plt.subplots(figsize=(max(4.0, 0.6 * len(x) + 2), 3.5))
    ax.errorbar(x, acc, yerr=err, fmt="o-", capsize=4, label="test accuracy (95% Wilson)")
    ax.axhline(result["chance"], color="grey", linestyle="--", label=f"chance (majority) {result['chance']:.3f}")
    ax.set_xticks(x)
    ax.set_xlabel("layer")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"linear probe per layer ({result['split']['test_items']} test items)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def probe_table(result: dict[str, Any]):
    """`forge probe`'s table of `probe_run`'s result: accuracy with its interval per layer."""
    from rich.table import Table

    table = Table(
        title=f"linear probes: {result['split']['test_items']} test / "
        f"{result['labelled'] - result['split']['test_items']} train items, "
        f"chance {result['chance']:.3f}"
    )
    for col in ("layer", "test accuracy", "95% interval (Wilson)", "train accuracy"):
        table.add_column(col)
    for r in result["layers"]:
        table.add_row(
            str(r["layer"]),
            f"{r['accuracy']:.3f}",
            f"{r['ci_low']:.3f} - {r['ci_high']:.3f}",
            f"{r['train_accuracy']:.3f}",
        )
    return table
