"""Every Forge hook, in one place. Plugins implement them with `@forge.hookimpl`.

Built-in plugins (batching modes, the token ledger, the progress bar) register through
the same entry-point group, `forge`, as third-party ones.

Grouped by phase, as pytest's are: what plugins offer (read once, when a run or a listing
is set up), then a run's life (its start, its input, its batches, its end), then the fault
points tests use. The annotations are what Forge passes and expects (`TYPE_CHECKING` imports:
importing this module stays light); an implementation may take any subset of a hook's
parameters, by name.

Each run hook gets the `run` it belongs to (`forge.vocab.records.RunContext`); plugins keep their
per-run state in `run.state[<plugin name>]`, never in module globals.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from forge.batching.base import Packer
    from forge.executors.base import Executor
    from forge.function import Function
    from forge.tracker import Tracker
    from forge.vocab.geometry import Batch, Device, Item
    from forge.vocab.records import BatchStats, RunContext, Skipped

hookspec = pluggy.HookspecMarker("forge")
hookimpl = pluggy.HookimplMarker("forge")


# ----------------------------------------------------------------------------- what plugins offer


@hookspec
def forge_batching_modes() -> dict[str, Callable[..., Packer]]:
    """Offer batching modes.

    :return: a dict mapping a mode name (what `batching.mode` selects) to a factory, usually
        a `forge.batching.Packer` subclass, that takes the mode's config and returns a packer. The
        config is an instance of the factory's `config_schema`, a dataclass extending
        `forge.config.modes.Batching` (that class itself where it declares none): the one home
        of the mode's keys and defaults, which the run's config is checked against.
    """


@hookspec
def forge_functions() -> dict[str, type[Function] | str]:
    """Offer functions.

    :return: a dict mapping a function name (what `function.name` in its config says) to its
        `forge.function.Function` subclass, or to an import path ``"package.module:Class"``
        that is imported only when the function is used (so listing stays cheap). A config
        that names a registered function needs no `_target_`.
    """


@hookspec
def forge_executors() -> dict[str, Callable[..., Executor] | str]:
    """Offer executors: where batches run (`runtime.executor` selects one).

    :return: a dict mapping an executor name to a factory, or to its import path
        ``"package.module:Class"`` (imported only when used; the built-in executors' classes are
        their own factories), called as
        ``factory(function, cache_tokens, runtime, plugins=..., hook=...)``: the function, each
        device's prefix-cache capacity in tokens, the runtime settings (a `forge.config.schema.Runtime`),
        the extra plugin modules workers register, and the hook relay. It returns a
        `forge.executors.Executor`.
    """


@hookspec
def forge_config_searchpath() -> str | list[str]:
    """Offer config directories: Forge's Hydra search-path plugin appends them after Forge's
    own `conf/`, so `function=<name>` and `batching=<name>` find a plugin's YAML files.

    :return: a config module path such as ``"pkg://my_plugin.conf"`` (a package holding
        `function/<name>.yaml`, `batching/<name>.yaml`, ...), a ``"file://DIR"``, or a list of them.
    """


@hookspec
def forge_trackers() -> dict[str, Callable[..., Tracker] | str]:
    """Offer trackers: where a run's figures are logged (`trackers=[<name>, ...]` selects them).

    :return: a dict mapping a tracker name to a factory, usually a `forge.tracker.Tracker`
        subclass, or to its import path ``"package.module:Class"`` (imported only when a run
        selects it). The factory is called with no arguments in the driver process, on the
        trackers' own thread; its `config_schema` (a dataclass extending
        `forge.config.schema.TrackerSettings`) holds the keys `trackers.<name>.*` and their
        defaults. A config option `trackers/<name>.yaml` (offered through
        `forge_config_searchpath`) makes the name selectable on the command line.
    """


# ----------------------------------------------------------------------------- a run: its start, its input


@hookspec
def forge_run_start(run: RunContext) -> None:
    """A run (or a plan) starts.

    :param run: the `RunContext`: function, batching mode, devices, run directory, config.
    """


@hookspec
def forge_items_received(run: RunContext, items: list[Item]) -> None:
    """Items were read from the input and admitted to the run.

    :param run: the `RunContext`.
    :param items: list of `forge.Item` received in this chunk.
    """


@hookspec
def forge_items_skipped(run: RunContext, items: list[Item], reason: str) -> None:
    """Received items that will not run (too long, over `budget.max_tokens`). Input records
    skipped before they became items come through `forge_input_skipped`.

    :param run: the `RunContext`.
    :param items: list of `forge.Item` skipped.
    :param reason: why, e.g. ``"too_long"`` or ``"budget.max_tokens"``.
    """


@hookspec
def forge_items_truncated(run: RunContext, items: list[Item], tokens: int) -> None:
    """Received items cut to the longest sequence a device takes (`too_long=truncate`).

    :param run: the `RunContext`.
    :param items: list of `forge.Item` as received (before the cut).
    :param tokens: tokens cut off them, in all.
    """


@hookspec
def forge_items_failed(run: RunContext, items: list[Item], reason: str) -> None:
    """Received items failed at admission, before any work (no device can ever take them,
    or too long under `too_long=error`).

    :param run: the `RunContext`.
    :param items: list of `forge.Item`.
    :param reason: one line: why, and the fix.
    """


@hookspec
def forge_input_failed(run: RunContext, record_id: str, reason: str) -> None:
    """An input record could not become an item (malformed line, bad id, no text, over
    `input.max_row_bytes`). It counts as received and failed, with zero tokens.

    :param run: the `RunContext`.
    :param record_id: the record's id, or ``"line N"`` where it has none.
    :param reason: one line saying what is wrong with it.
    """


@hookspec
def forge_input_skipped(run: RunContext, record: Skipped) -> None:
    """An input record that is deliberately not run (a repeat of an id that
    `input.duplicate_ids=first|last` drops). It counts as received and skipped, with zero tokens.

    :param run: the `RunContext`.
    :param record: the `forge.vocab.records.Skipped`: its id, its reason (where, why, what is kept
        instead), its reason's kind (what the report counts) and its line where known.
    """


# ----------------------------------------------------------------------------- a run: its batches


@hookspec
def forge_batch_routed(run: RunContext, batch: Batch, device: Device) -> None:
    """A batch was cut and sent to a device.

    :param run: the `RunContext`.
    :param batch: the `forge.Batch`; `batch.retry` is true for re-runs of a failed batch's items.
    :param device: the `forge.Device` that will run it.
    """


@hookspec
def forge_batch_completed(run: RunContext, batch: Batch, device: Device, stats: BatchStats) -> None:
    """A device finished a batch.

    :param run: the `RunContext`.
    :param batch: the `forge.Batch`.
    :param device: the `forge.Device` that ran it.
    :param stats: `forge.vocab.records.BatchStats`: seconds, prefix tokens computed and served from cache,
        and the token slots of each forward step it ran (`stats.steps`), which the ledger holds to the
        device's step budget (`device.steps()`, a `forge.vocab.geometry.StepBudget`).
    """


@hookspec
def forge_batch_failed(run: RunContext, batch: Batch, device: Device, reason: str, will_retry: bool) -> None:
    """A batch attempt failed on a device (an error, out of memory, a timeout, a lost worker).

    :param run: the `RunContext`.
    :param batch: the `forge.Batch`.
    :param device: the `forge.Device`.
    :param reason: one line: the error.
    :param will_retry: true when its items go back to the scheduler (whole, split, or one by
        one; their tokens count as retried); false when the items are recorded as failed.
    """


@hookspec
def forge_batch_discarded(run: RunContext, batch: Batch, device: Device, reason: str) -> None:
    """A result arrived for items already committed (a late result after re-routing): it is
    dropped, the first commit stands.

    :param run: the `RunContext`.
    :param batch: the `forge.Batch` holding the duplicate items only.
    :param device: the `forge.Device` that ran it.
    :param reason: one line, e.g. ``"late result after a timeout"``.
    """


@hookspec
def forge_batch_late(run: RunContext, batch: Batch, device: Device) -> None:
    """A result arrived for an attempt given up after a timeout (and counted as retried).
    What of it is not committed yet is committed now (then `forge_batch_completed` fires
    for that part, `forge_batch_discarded` for the rest).

    :param run: the `RunContext`.
    :param batch: the `forge.Batch` of the late attempt, whole.
    :param device: the `forge.Device` that ran it.
    """


# ----------------------------------------------------------------------------- a run: set-aside items, commits, end


@hookspec
def forge_items_resumed(run: RunContext, items: list[Item]) -> None:
    """Received items that an earlier session of this run committed: not run again.

    :param run: the `RunContext`.
    :param items: list of `forge.Item`.
    """


@hookspec
def forge_items_unfinished(run: RunContext, items: list[Item], reason: str) -> None:
    """Received items that are neither committed nor failed when the run stops early
    (interrupted, or stopped for a recurring failure or a write error). A resume runs them.

    :param run: the `RunContext`.
    :param items: list of `forge.Item`.
    :param reason: one line: why the run stopped.
    """


@hookspec
def forge_commit_failed(run: RunContext, items: list[Item], reason: str) -> None:
    """Completed items whose shard could not be written (a full disk, say): they are not
    committed after all, and the run stops; a resume runs them again.

    :param run: the `RunContext`.
    :param items: list of `forge.Item` that were completed but not committed.
    :param reason: one line: the write error.
    """


@hookspec
def forge_run_end(run: RunContext, report: dict[str, Any]) -> None:
    """The run (or plan) ended; plugins add their figures to the report before it is written.

    The report is a typed `forge.driver.report.Report`; a plugin gets it as report.json's dict
    (`Report.as_dict()`, `schema_version` and all) and adds its keys to that dict in place (the
    ledger adds `items`, `tokens`, `balanced`, ...). The keys it adds are kept in
    `Report.plugins` and written into report.json at its top level, beside the engine's; the
    returned report reads them as `report["items"]`. The engine's own keys are read-only: a
    plugin that replaces or removes one is not obeyed, and the report's warnings say so.

    :param run: the `RunContext`.
    :param report: report.json's dict so far, to add keys to in place.
    """


# ----------------------------------------------------------------------------- faults (tests)


@hookspec
def forge_fault(point: str, device: Device | None, batch: Batch | None) -> None:
    """A named point in a batch's life, where a test plugin may inject a fault (kill the
    process, hang, raise). Production code registers no implementation.

    Points: ``before_forward`` and ``after_forward`` (in the worker process, around the
    forward pass), ``write_shard`` (in the driver, with a shard written under its temporary
    name and not yet put in place; `batch` is None), ``commit_record`` (in the driver, with
    the shard in place and its journal record not yet written; `batch` is None).

    :param point: the point's name.
    :param device: the `forge.Device` (None for ``write_shard`` and ``commit_record``).
    :param batch: the `forge.Batch` (None for ``write_shard`` and ``commit_record``).
    """
