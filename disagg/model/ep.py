"""Expert parallelism: which experts a rank holds, and the all-to-all dispatch and combine.

Under ``--expert-parallel`` the routed experts of every MoE layer are spread over the EP group
(every executor of the node: ``--dp N`` x ``--tp M`` ranks): rank ``r`` holds experts
``[r*E/size, (r+1)*E/size)`` whole (no intermediate split). Routing is computed where the
tokens are, exactly as without EP (``disagg.model.moe.route``). A layer's forward then
(``ExpertParallel.exchange``):

1. **dispatch**: each (token, choice) pair goes to the rank holding its expert; the counts per
   rank are exchanged first (``all_to_all_single`` of one integer per rank), then the rows,
   their local expert ids and their weights;
2. each rank runs its local experts on the rows it received (weighted, one expert a row);
3. **combine**: the weighted rows go back the way they came and are summed into their tokens.

A rank with no tokens still joins (zero rows: a dummy batch), so every rank runs the same
collectives in the same order. Shared experts and dense layers stay TP-sharded within a DP
rank (``disagg.model.tp``). Under TP the ranks of a DP rank hold the same tokens, so each sends
only its share of the rows (``token_share``) and the TP all-reduce after the MLP puts the
pieces together. The split sizes travel to the host (``all_to_all_single`` takes lists), so an
EP exchange is never captured in a CUDA graph: with more than one EP rank decode runs eagerly.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

EP_NO_FP8 = ("--expert-parallel does not load FP8 checkpoints yet (their experts' scales are "
             "not spread over the ranks): drop --expert-parallel or use a bf16 checkpoint")


class EPError(ValueError):
    """The experts cannot be spread over this many ranks."""


@dataclass
class ExchangeClock:
    """Seconds spent in the all-to-all collectives (dispatch and combine), for the stats."""

    seconds: float = 0.0
    calls: int = 0

    def take(self) -> tuple[float, int]:
        """The time and call count since the last take."""
        out = (self.seconds, self.calls)
        self.seconds, self.calls = 0.0, 0
        return out


@dataclass(frozen=True)
class ExpertParallel:
    rank: int = 0  # in the EP group (every executor of the node)
    size: int = 1
    group: Any = None  # torch.distributed process group (None: the default group)
    clock: ExchangeClock = field(default_factory=ExchangeClock, compare=False)

    def check(self, num_experts: int) -> None:
        if num_experts % self.size:
            raise EPError(f"--expert-parallel: {num_experts} experts do not divide over "
                          f"{self.size} ranks (--dp x --tp)")

    def experts(self, num_experts: int) -> range:
        """The global experts this rank holds."""
        self.check(num_experts)
        per = num_experts // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def place(self, target: tuple[str, int | None, int | None, str],
              num_experts: int) -> tuple[str, int | None, int | None, str] | None:
        """Where a checkpoint tensor (the loader's ``(parameter, expert, fused part, kind)``)
        goes on this rank (more than one EP rank): one of its routed experts is held whole at
        its local index (kind ``replicated``), another rank's is skipped (None), the fused
        ``[E, ...]`` form keeps this rank's experts (kind ``ep_experts``: ``held``); any other
        tensor is unchanged."""
        param_name, expert, part, kind = target
        if self.size == 1 or not param_name.endswith((".moe.gate_up", ".moe.down")):
            return target
        if expert is None:
            return (param_name, None, part, "ep_experts")
        mine = self.experts(num_experts)
        return (param_name, expert - mine.start, part, "replicated") if expert in mine else None

    def held(self, tensor: torch.Tensor, num_experts: int) -> torch.Tensor:
        """This rank's experts of a fused ``[E, ...]`` tensor."""
        mine = self.experts(num_experts)
        return tensor[mine.start:mine.stop]

    def exchange(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                 num_experts: int,
                 compute: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                 ) -> torch.Tensor:
        """The routed experts' weighted sum for this rank's tokens ``x [T, H]`` routed to
        ``experts [T, k]`` (global ids) with ``weights [T, k]``. ``compute(rows [n, H],
        weights [n], local experts [n])`` runs this rank's experts on the rows it received and
        returns their weighted outputs ``[n, H]``."""
        import torch.distributed as dist

        t, k = experts.shape
        per = num_experts // self.size
        flat = experts.reshape(-1)
        dest = torch.div(flat, per, rounding_mode="floor")
        order = torch.argsort(dest, stable=True)  # pairs grouped by destination rank
        token_of = torch.div(order, k, rounding_mode="floor")
        send_counts = torch.bincount(dest, minlength=self.size)
        recv_counts = torch.empty_like(send_counts)
        started = time.perf_counter()
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        sent, got = send_counts.tolist(), recv_counts.tolist()
        n = sum(got)
        rows = x.new_empty((n, x.shape[1]))
        dist.all_to_all_single(rows, x[token_of].contiguous(), got, sent, group=self.group)
        # each row's local expert and weight in one float32 tensor (ids < 2^24 are exact; the
        # weights' own dtype is restored after, exactly)
        meta = torch.stack([(flat[order] - dest[order] * per).to(torch.float32),
                            weights.reshape(-1)[order].to(torch.float32)], dim=1)
        meta_in = meta.new_empty((n, 2))
        dist.all_to_all_single(meta_in, meta, got, sent, group=self.group)
        self.clock.seconds += time.perf_counter() - started
        out_rows = compute(rows, meta_in[:, 1].to(weights.dtype), meta_in[:, 0].long())
        back = x.new_empty((sum(sent), x.shape[1]))
        started = time.perf_counter()
        dist.all_to_all_single(back, out_rows.to(x.dtype).contiguous(), sent, got,
                               group=self.group)
        self.clock.seconds += time.perf_counter() - started
        self.clock.calls += 1
        out = x.new_zeros((t, x.shape[1]))
        out.index_add_(0, token_of, back)
        return out


def token_share(num_tokens: int, rank: int, size: int) -> tuple[int, int]:
    """The rows ``[lo, hi)`` of ``num_tokens`` rows that TP rank ``rank`` of ``size`` sends to
    the experts (the ranks of one DP rank hold the same rows): an even split, the first ranks
    one row more."""
    base, extra = divmod(num_tokens, size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def check_layout(num_heads_ok: Callable[[int], None], num_experts: int | None, devices: int,
                 dp: int, expert_parallel: bool) -> None:
    """Refuse by name, before any executor starts, a node whose ``--dp`` x ``--tp`` ranks or
    ``--expert-parallel`` cannot hold the model: ``num_heads_ok(tp)`` raises when the model
    cannot be split over ``tp`` ranks (``TensorParallel.check``); ``num_experts`` is None for a
    dense model."""
    if devices % dp:
        raise EPError(f"--dp {dp} does not divide the {devices} devices")
    num_heads_ok(devices // dp)
    if not expert_parallel:
        return
    if num_experts is None:
        raise EPError("--expert-parallel needs a mixture-of-experts model (this one is dense)")
    ExpertParallel(0, devices).check(num_experts)


def held_expert(ep: ExpertParallel | None, arch: Any,
                target: tuple[str, int | None, int | None, str] | None,
                ) -> tuple[str, int | None, int | None, str] | None:
    """The loader's target for a checkpoint tensor under ``ep`` (``ExpertParallel.place``;
    unchanged without expert parallelism or for a dense model)."""
    if target is None or ep is None or arch.moe is None:
        return target
    return ep.place(target, arch.moe.num_experts)


def draw_experts(param: torch.Tensor, name: str, seed: int, ep: ExpertParallel | None,
                 moe: Any) -> None:
    """Random weights of a routed-expert parameter ``[local experts, ...]``: each expert from
    its own seed (``seed``, the parameter's name, the expert's global id), so a rank under
    expert parallelism draws exactly the experts one rank holding them all would."""
    first = ep.experts(moe.num_experts).start if ep is not None and ep.size > 1 else 0
    gen = torch.Generator(device=param.device)
    for i in range(param.shape[0]):
        gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode()) * 4099 + first + i)
                        % (1 << 63))
        param[i].normal_(0.0, 0.02, generator=gen)
