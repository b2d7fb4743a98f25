"""A step on its way from the runner (``disagg.engine.runner.ModelRunner.launch``) to whoever
waits for its tokens: the executor's reply, the in-process engine's driver."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from disagg.engine.sampling import LogprobRows
from disagg.protocol import TokenLogprobs


class Launched:
    """A step on its way: ``wait()`` returns (sampled tokens, hidden rows, counts) once the
    device is done. Tokens still on the device were queued for a copy into pinned host memory
    behind ``event`` at launch, so nothing waits for the device before ``wait()``."""

    def __init__(self, tokens: list[int] | torch.Tensor, ctx: torch.Tensor | None = None,
                 counts: list[int] | None = None, event: torch.cuda.Event | None = None):
        self.tokens, self.ctx, self.counts, self.event = tokens, ctx, counts, event
        self.logprobs: LogprobRows | None = None  # sampled tokens' (rows that asked), by slot
        self.prompt: LogprobRows | None = None  # prompt rows' (chunks with prompt_rows)
        # a step with late_mask chunks: its forward pass is queued, its tokens are picked by
        # ``with_masks`` once their masks arrive (until then there is nothing to wait for)
        self.picker: Callable[[Mapping[int, bytes | memoryview]], Launched] | None = None
        # such a step's forward pass, recorded before its tokens are picked (None on a CPU)
        self.forward: torch.cuda.Event | None = None

    def with_masks(self, masks: Mapping[int, bytes | memoryview]) -> Launched:
        """The step picked with its late chunks' grammar masks (by slot); a step that had
        none is returned as it is."""
        if self.picker is None:
            return self
        out = self.picker(masks)
        out.prompt, out.forward = self.prompt, self.forward
        return out

    def forward_done(self) -> bool:
        """The device has finished the step's forward pass (what its picking may still wait
        for is then only the pick itself): always on a CPU."""
        return self.forward is None or self.forward.query()

    def logprob_maps(self) -> tuple[dict[int, TokenLogprobs] | None,
                                    dict[int, list[TokenLogprobs]] | None]:
        """After ``wait()``: the step's sampled-token logprobs by slot and prompt logprobs by
        slot (``StepResult.logprobs`` / ``prompt_logprobs``), None where none was asked."""
        return (None if self.logprobs is None else dict(self.logprobs.host()),
                None if self.prompt is None else self.prompt.grouped())

    def wait(self) -> tuple[list[int], torch.Tensor | None, list[int] | None]:
        if self.picker is not None:
            raise RuntimeError("the step's grammar masks never arrived (late_mask chunks)")
        if isinstance(self.tokens, torch.Tensor):
            if self.event is not None:
                self.event.synchronize()
            self.tokens = self.tokens.tolist()
        return self.tokens, self.ctx, self.counts
