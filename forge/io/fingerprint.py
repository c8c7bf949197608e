"""What differs between the fingerprint a run directory's run started with and a resume's: the
settings and the input content that decide results (`forge.io.store.RunStore` refuses a resume
over any difference, naming each)."""

from __future__ import annotations


def fingerprint_changes(old: dict, new: dict, where: str = "") -> list[str]:
    """What differs between two fingerprints, in words: 'layers: [1, 2] -> [1, 4]'."""
    changes = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changes += fingerprint_changes(a, b, f"{where}{key}.")
        elif a != b:
            changes.append(f"{where}{key}: {a!r} -> {b!r}")
    return changes


def same_input_located_alike(old: dict, new: dict) -> dict:
    """`new`, its input's location (`path`, `dataset`) taken from `old` where both inputs hold the
    same bytes (size and sha256): a file moved or copied elsewhere, or rows a `forge.Session` wrote
    to a folder of its own, is the same input, and the content is what decides results."""
    a, b = old.get("input"), new.get("input")
    if not (isinstance(a, dict) and isinstance(b, dict)) or not a.get("sha256"):
        return new
    if (a.get("sha256"), a.get("bytes")) != (b.get("sha256"), b.get("bytes")):
        return new
    return {**new, "input": {**b, **{k: a[k] for k in ("path", "dataset") if k in a and k in b}}}
