"""A device group as the packer sees it: one consumer, its figures those of its tightest stage.

Model: the group runs a batch stage after stage (accelerate's dispatch: each stage's layers on
its member, the hidden states handed on), so

- its budget for batching=memory is the measured model's weights plus the activation room of
  its tightest stage (`Placement.activation_bytes`): a batch the packer admits against it fits
  every stage, since each prices its activations as the whole model's (`forge.runtime.placement.stages`);
- its limits are those declared, max_batch_tokens lowered to what that room holds in rows of
  max_seq_len (`placement.activation_bound`), so a batch of whole sequences fits in any mode;
  rows behind a shared prefix each hold its KV, which the four limits do not bound (max_rows
  is left as declared: bounding it by full-length rows would starve every mode): only
  batching=memory prices it, as on a single device, so plan and run groups with it;
- a simulated group's step time is each stage's share of the model's weights times its
  member's step time for the whole model, plus, per token, the hidden state handed from stage
  to stage over the link (tokens x hidden bytes per hop), plus, per step, the offloaded
  weights streamed in (over the link from the CPU; from disk at `DISK_GB_PER_S`) and run on
  the first member.
"""

from __future__ import annotations

from dataclasses import replace

from forge.batching.cost import CostModel
from forge.errors import ForgeError
from forge.runtime.placement.device_map import Placement, activation_bound
from forge.vocab.geometry import Device, Limits, StepTime

DISK_GB_PER_S = 2.0  # an NVMe drive's sequential reads, for disk offload's price in the plan


def group_limits(device: Device, placement: Placement, cost: CostModel) -> Limits:
    """The declared limits, max_batch_tokens lowered to what the tightest stage's room holds."""
    lim = device.limits
    tokens = lim.max_batch_tokens
    while tokens > lim.pad(lim.max_seq_len) and activation_bound(cost, lim, tokens) > placement.activation_bytes:
        tokens = max(lim.pad(lim.max_seq_len), int(tokens * 0.9) // lim.pad_multiple * lim.pad_multiple)
    return Limits(tokens, lim.max_rows, lim.max_seq_len, lim.pad_multiple)


def group_step_time(device: Device, placement: Placement) -> StepTime | None:
    """A simulated group's step time (None: its members are not simulated)."""
    sims = [m.sim for m in device.group]
    if any(s is None for s in sims):
        return None
    full = placement.model_bytes
    shares = [s.weights_bytes / full for s in placement.stages]
    a = sum(f * s.seconds_per_step for f, s in zip(shares, sims) if s is not None)
    b = sum(f * s.seconds_per_slot for f, s in zip(shares, sims) if s is not None)
    c = sum(f * s.seconds_per_score for f, s in zip(shares, sims) if s is not None)
    link = device.link_gb_per_s * 1e9
    b += placement.transfer_bytes_per_token / link
    if placement.offload is not None and sims[0] is not None:
        off = placement.offloaded_bytes / full
        a += off * sims[0].seconds_per_step
        b += off * sims[0].seconds_per_slot
        c += off * sims[0].seconds_per_score
        a += placement.offloaded_bytes / (link if placement.offload == "cpu" else DISK_GB_PER_S * 1e9)
    return StepTime(a, b, c)


def group_consumer(device: Device, placement: Placement, cost: CostModel) -> Device:
    """The group as one consumer: limits, budget and step time of its tightest stage."""
    if not device.group:
        raise ForgeError(f"device {device.name} is not a group")
    step = group_step_time(device, placement)
    overhead = device.batch_overhead_tokens
    if overhead is None and step is not None:
        overhead = step.overhead_tokens
    return replace(
        device,
        limits=group_limits(device, placement, cost),
        memory_bytes=cost.weight_bytes + placement.activation_bytes,
        sim=step,
        batch_overhead_tokens=overhead,
    )
