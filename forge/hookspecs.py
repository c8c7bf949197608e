"""Every Forge hook, in one place. Plugins implement them with `@forge.hookimpl`.

Built-in plugins (batching modes, the token ledger, the progress bar) register through
the same entry-point group, `forge`, as third-party ones.

Each hook gets the `run` it belongs to (`forge.run.RunContext`); plugins keep their
per-run state in `run.state[<plugin name>]`, never in module globals.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("forge")
hookimpl = pluggy.HookimplMarker("forge")


@hookspec
def forge_batching_modes():
    """Offer batching modes.

    :return: a dict mapping a mode name (what `batching.mode` selects) to a factory that
        takes the mode's options as keyword arguments and returns a `forge.batching.Packer`.
    """


@hookspec
def forge_run_start(run):
    """A run (or a plan) starts.

    :param run: the `RunContext`: function, batching mode, devices, run directory, config.
    """


@hookspec
def forge_items_received(run, items):
    """Items were read from the input and admitted to the run.

    :param run: the `RunContext`.
    :param items: list of `forge.Item` received in this chunk.
    """


@hookspec
def forge_items_skipped(run, items, reason):
    """Received items that will not run (too long, over `budget.max_tokens`).

    :param run: the `RunContext`.
    :param items: list of `forge.Item` skipped.
    :param reason: why, e.g. ``"too_long"`` or ``"budget.max_tokens"``.
    """


@hookspec
def forge_input_failed(run, record_id, reason):
    """An input record could not become an item (malformed line, no text). It counts as
    received and failed, with zero tokens.

    :param run: the `RunContext`.
    :param record_id: the record's id, or ``"line N"`` where it has none.
    :param reason: one line saying what is wrong with it.
    """


@hookspec
def forge_batch_routed(run, batch, device):
    """A batch was cut and sent to a device.

    :param run: the `RunContext`.
    :param batch: the `forge.Batch`; `batch.retry` is true for re-runs of a failed batch's items.
    :param device: the `forge.Device` that will run it.
    """


@hookspec
def forge_batch_completed(run, batch, device, stats):
    """A device finished a batch.

    :param run: the `RunContext`.
    :param batch: the `forge.Batch`.
    :param device: the `forge.Device` that ran it.
    :param stats: `forge.run.BatchStats`: seconds, prefix tokens computed and served from cache.
    """


@hookspec
def forge_batch_failed(run, batch, device, reason, will_retry):
    """A batch failed on a device.

    :param run: the `RunContext`.
    :param batch: the `forge.Batch`.
    :param device: the `forge.Device`.
    :param reason: one line: the error.
    :param will_retry: true when its items are re-routed one by one (then they count again
        as retries, not as new routing); false when the items are recorded as failed.
    """


@hookspec
def forge_run_end(run, report):
    """The run ended; plugins add their figures to the report before it is written.

    :param run: the `RunContext`.
    :param report: the `report.json` dict, to be updated in place.
    """
