"""Step caches on the MiniMax-H3 transformer, one request at a time: diffusers' own cache hooks (`CacheMixin.enable_cache`
with a `FirstBlockCacheConfig`, `TaylorSeerCacheConfig` or `MagCacheConfig`), installed for a
request's denoise loop and removed after it, and the count of the blocks each step computed.

Owns the two pieces diffusers 0.42.1 lacks for H3 (found by running each config on the tiny preset):

- `MiniMaxH3TransformerBlock` is not in diffusers' `TransformerBlockRegistry`, which FirstBlockCache and MagCache
  read a block's outputs from ("Model class ... not registered"). `register_h3_blocks` registers it through
  diffusers' own API: its forward takes `hidden_states` and returns them alone (no encoder stream: H3 packs every
  modality into one sequence).
- H3's modular denoise loop sets no cache context (it is guidance-distilled: one transformer forward per step, no
  unconditional pass), and every stateful hook needs one ("No cache context is set"). `applied` runs the request's
  loop inside `transformer.cache_context("cond")`, the one context of that one forward.

Not offered: `PyramidAttentionBroadcastConfig` and `FasterCacheConfig` key their skips on a current-timestep callback
the loop would have to feed, and FasterCache fails inside H3's attention (IndexError); SeaCache needs a
model-specific `raw_vision_callback` (a function, not a definition's value); `MagCacheConfig` needs the model's
calibrated `mag_ratios` (given in the definition, or refused).

The plan cache is untouched: a skipped block reads no plan on that step, block 0 and `norm_out` read theirs every step,
and a request's plan keys and lease are those of the same request without a step cache.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

KINDS = ("first_block", "taylorseer", "mag")
"""The step caches a definition may name (diffusers' config classes: `_CONFIGS`)."""
_CONFIGS = {"first_block": "FirstBlockCacheConfig", "taylorseer": "TaylorSeerCacheConfig", "mag": "MagCacheConfig"}
_SCALAR = (bool, int, float, str)


class StepCacheError(ValueError):
    """A step-cache definition diffusers' config refuses: names the definition, the parameter and the rule."""


def register_h3_blocks() -> None:
    """Make MiniMax-H3's transformer block known to diffusers' block-level caches (idempotent)."""
    from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3TransformerBlock

    try:
        TransformerBlockRegistry.get(MiniMaxH3TransformerBlock)
    except ValueError:
        TransformerBlockRegistry.register(
            MiniMaxH3TransformerBlock,
            TransformerBlockMetadata(return_hidden_states_index=None, return_encoder_hidden_states_index=None),
        )


@dataclass(frozen=True)
class StepCache:
    """One of diffusers' step caches and its parameters (the config's own keyword arguments)."""

    kind: str
    params: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def parse(cls, data: Mapping[str, Any], source: str) -> StepCache:
        """`{"kind": "first_block", "threshold": 0.04, ...}`: StepCacheError naming `source` and the bad key."""
        import inspect

        import diffusers

        if not isinstance(data, Mapping) or not isinstance(data.get("kind"), str):
            raise StepCacheError(f'{source}: a step cache is an object with a "kind" ({", ".join(KINDS)})')
        kind = data["kind"]
        if kind not in KINDS:
            raise StepCacheError(f"{source}: kind {kind!r} is not one of {', '.join(KINDS)}")
        allowed = inspect.signature(getattr(diffusers, _CONFIGS[kind])).parameters
        params = []
        for key, value in sorted((k, v) for k, v in data.items() if k != "kind"):
            if key not in allowed:
                raise StepCacheError(f"{source}: {kind} takes no parameter {key!r}; it takes {', '.join(allowed)}")
            if isinstance(value, list):
                value = tuple(value)
            items = value if isinstance(value, tuple) else (value,)
            if not all(isinstance(v, _SCALAR) for v in items) or any(
                isinstance(v, float) and not math.isfinite(v) for v in items
            ):
                raise StepCacheError(f"{source}: {kind} {key} must be a finite number, a string or a list of them")
            params.append((key, value))
        if kind == "mag" and "mag_ratios" not in dict(params):
            raise StepCacheError(f"{source}: mag needs the model's calibrated mag_ratios (diffusers' MagCache)")
        out = cls(kind, tuple(params))
        out.config()  # diffusers' own checks of the values
        return out

    def config(self) -> Any:
        """A fresh diffusers config (the hooks it makes hold a request's state; never shared between requests)."""
        import diffusers

        try:
            return getattr(diffusers, _CONFIGS[self.kind])(**{k: list(v) if isinstance(v, tuple) else v
                                                              for k, v in self.params})  # fmt: skip
        except (TypeError, ValueError) as e:
            raise StepCacheError(f"{self.kind}: diffusers refuses {dict(self.params)}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **{k: list(v) if isinstance(v, tuple) else v for k, v in self.params}}


@dataclass
class BlockCounts:
    """Per transformer forward (one per step), how many of its `blocks` transformer blocks computed their attention
    (`attn.to_q` ran) and their feed-forward (`ff.net.2` ran). A block a cache skips runs neither; a cache that
    predicts a module's output (TaylorSeer) skips that module's inner layers. The counts are of those inner layers,
    which a cache's hooks never replace."""

    blocks: int = 0
    attention: list[int] = field(default_factory=list)
    feed_forward: list[int] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return len(self.attention)

    @property
    def skipped(self) -> list[float]:
        """Per step, the block forwards skipped (a block whose attention alone was skipped counts one half)."""
        return [self.blocks - (a + f) / 2 for a, f in zip(self.attention, self.feed_forward, strict=True)]

    @property
    def skipped_fraction(self) -> float:
        """The block forwards skipped over the whole loop (0 without a step cache)."""
        total = self.blocks * self.steps
        return sum(self.skipped) / total if total else 0.0


@contextmanager
def applied(transformer: Any, cache: StepCache | None) -> Iterator[BlockCounts]:
    """`cache`'s hooks on `transformer` for the loop run meanwhile, inside its one cache context; removed after, in
    every outcome (the next request runs without them: diffusers' `disable_cache`). Yields the block counts, filled as
    the loop runs (for `cache` None too: every block computed every step)."""
    blocks = list(getattr(transformer, "transformer_blocks", ()))
    counts = BlockCounts(len(blocks))

    def step(module: Any, args: Any) -> None:
        counts.attention.append(0)
        counts.feed_forward.append(0)

    def attention(module: Any, args: Any, output: Any) -> None:
        if counts.attention:
            counts.attention[-1] += 1

    def feed_forward(module: Any, args: Any, output: Any) -> None:
        if counts.feed_forward:
            counts.feed_forward[-1] += 1

    handles = [transformer.register_forward_pre_hook(step)]
    for block in blocks:
        handles.append(block.get_submodule("attn.to_q").register_forward_hook(attention))
        handles.append(block.get_submodule("ff.net.2").register_forward_hook(feed_forward))
    try:
        if cache is None:
            yield counts
            return
        register_h3_blocks()
        transformer.enable_cache(cache.config())
        try:
            with transformer.cache_context("cond"):
                yield counts
        finally:
            transformer.disable_cache()
    finally:
        for h in handles:
            h.remove()
