"""`Forward`: what a function needs from the forward pass. Forge computes nothing else."""

from __future__ import annotations

from dataclasses import dataclass

from forge.errors import ForgeError

LOGITS = ("targets", "all")


@dataclass(frozen=True)
class Forward:
    """What a function needs from the forward pass; Forge computes and keeps nothing else.

    Every value an `ItemView` offers is the item's own, the same in every layout:
    ``hidden[L]`` and ``captured[name]`` hold its tokens after its prefix, in order."""

    layers: tuple[int, ...] = ()  # hidden-state indices kept for each item (0 = embeddings, N = final normed)
    targets: bool = False  # log-probabilities of each item's target tokens (the LM head runs only there)
    # hook points kept per item (`view.captured[name]`): resid_pre.L, resid_post.L, attn_out.L, mlp_in.L,
    # mlp_out.L, attn_pattern.L ([heads, own tokens, all tokens]; eager attention), or a module path
    capture: tuple[str, ...] = ()
    logits: str | None = None  # "targets": float32 logits at each target's position; "all": at every own token
    head: bool = False  # the function calls `view.head(states)` (its float32 logits are priced per token)

    def __post_init__(self) -> None:
        if isinstance(self.capture, str) or not all(isinstance(c, str) and c for c in self.capture):
            raise ForgeError(f"Forward(capture={self.capture!r}): give a tuple of hook point names")
        object.__setattr__(self, "capture", tuple(dict.fromkeys(self.capture)))
        if self.logits is not None and self.logits not in LOGITS:
            raise ForgeError(f"Forward(logits={self.logits!r}); choose one of: {', '.join(LOGITS)} (or None)")
        if self.logits == "targets" and not self.targets:
            object.__setattr__(self, "targets", True)  # logits at the targets' positions need the targets

    @property
    def lm_head(self) -> bool:
        """The LM head runs on the batch's final states (so every layer runs)."""
        return self.targets or self.logits is not None
