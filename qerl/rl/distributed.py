"""Data-parallel training over torch.distributed: the process group and the few collectives the trainer needs.

One process per GPU (or per CPU worker with gloo), started by `torchrun`. Every rank holds the whole adapter and
optimizer. A step's prompts are split into contiguous shards of whole GRPO groups (advantages stay exact); each rank's
loss is normalized by the *global* batch (token count, sequence count), so summing the ranks' gradients gives the
one-process gradient, and the identical optimizer steps keep the adapters equal. Without a process group (a plain
`qerl train`) every helper here is the identity, so the one-process path is unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from qerl.debug import variable
from qerl.errors import one_line

T = TypeVar("T")


class DistributedError(RuntimeError):
    """A collective failed: another rank died, or one did not arrive within the timeout."""


@dataclass(frozen=True)
class Group:
    """This process's place in the job (rank 0 of 1 when not distributed) and the collectives over it."""

    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that writes metrics, checkpoints, adapters, plots and tracking."""
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def shard(self, items: Sequence[T]) -> tuple[int, list[T]]:
        """This rank's contiguous share of `items` and the index of its first item in the whole list."""
        if len(items) % self.world_size:
            raise ValueError(f"{len(items)} prompts per step do not split over {self.world_size} processes: "
                             "make rollout.prompts_per_step a multiple of the process count")
        size = len(items) // self.world_size
        return self.rank * size, list(items[self.rank * size:(self.rank + 1) * size])

    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum over ranks (float64, so counts stay exact)."""
        return self._reduce(values, dist.ReduceOp.SUM)

    def max(self, values: Sequence[float]) -> list[float]:
        return self._reduce(values, dist.ReduceOp.MAX)

    def gather(self, values: Sequence[Any]) -> list[Any]:
        """Every rank's `values`, concatenated in rank order (the one-process order of the step's rows)."""
        if not self.active:
            return list(values)
        parts: list[Any] = [None] * self.world_size
        with _collective("all_gather"):
            dist.all_gather_object(parts, list(values))
        return [v for part in parts for v in part]

    def sum_gradients(self, params: Sequence[torch.Tensor]) -> None:
        """Sum the parameters' gradients over ranks in place, as one flat buffer (one collective per step)."""
        if not self.active:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        with _collective("all_reduce(gradients)"):
            dist.all_reduce(flat)
        offset = 0
        for p, g in zip(params, grads):
            p.grad = flat[offset:offset + g.numel()].view_as(g).clone()
            offset += g.numel()

    def broadcast(self, params: Sequence[torch.Tensor]) -> None:
        """Rank 0's values into every rank's tensors: one start for all, whatever each rank's initialization."""
        if not self.active:
            return
        with _collective("broadcast"), torch.no_grad():
            for p in params:
                dist.broadcast(p.data, src=0)

    def barrier(self) -> None:
        if self.active:
            with _collective("barrier"):
                dist.barrier()

    @contextmanager
    def failing_together(self, peer_failed: Callable[[str], Exception]) -> Iterator[None]:
        """A phase that fails on every rank if it fails on one: its error raises on its own rank, and on the others
        `peer_failed("rank R: <its one line>")`. Without this a rank whose phase raised leaves the step while the
        others wait for it in the step's next collective (gloo: a lost-peer error naming nothing; NCCL: a hang until
        `train.collective_timeout_s`). Costs one small all-reduce per phase when nothing failed."""
        if not self.active:
            yield
            return
        try:
            yield
        except Exception as exc:
            self._share_failure(exc)
            raise
        failure = self._share_failure(None)
        if failure is not None:
            raise peer_failed(failure)

    def _share_failure(self, error: Exception | None) -> str | None:
        """Every rank's `error` of one phase (None: it succeeded) made known to all: the first failing rank's message,
        `rank R: ...`, or None when every rank succeeded."""
        if not self.max([float(error is not None)])[0]:
            return None
        failures = self.gather([None if error is None else f"rank {self.rank}: {one_line(error)}"])
        return next(f for f in failures if f is not None)

    def _reduce(self, values: Sequence[float], op) -> list[float]:
        if not self.active:
            return [float(v) for v in values]
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=_collective_device())
        with _collective("all_reduce"):
            dist.all_reduce(t, op=op)
        return t.tolist()


def current() -> Group:
    """The group of the running process group, or the one-process group when none is initialized."""
    if dist.is_available() and dist.is_initialized():
        return Group(dist.get_rank(), dist.get_world_size())
    return Group()


@contextmanager
def process_group(timeout_s: float) -> Iterator[Group]:
    """Join the job torchrun describes in the environment (WORLD_SIZE, RANK, MASTER_ADDR...), leave it on exit.

    NCCL on CUDA (each rank on GPU LOCAL_RANK), gloo on the CPU. `timeout_s` bounds every collective: a rank that
    died or hangs fails the others within it instead of blocking them forever. Outside torchrun (WORLD_SIZE unset
    or 1) this yields the one-process group and touches nothing.
    """
    if int(variable("WORLD_SIZE") or "1") <= 1 or dist.is_initialized():
        yield current()
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(variable("LOCAL_RANK") or "0"))  # "cuda" then means this rank's GPU
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    try:
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError) as exc:
        raise DistributedError(f"could not join the {backend} process group: {_first_line(exc)}") from exc
    try:
        yield current()
    finally:
        dist.destroy_process_group()


def _collective_device() -> torch.device:
    # NCCL only moves CUDA tensors; gloo only CPU ones.
    return torch.device("cuda") if dist.get_backend() == "nccl" else torch.device("cpu")


@contextmanager
def _collective(name: str) -> Iterator[None]:
    try:
        yield
    except (RuntimeError, ValueError) as exc:  # DistBackendError is a RuntimeError
        raise DistributedError(f"rank {dist.get_rank()}: {name} failed, another rank died or timed out: "
                               f"{_first_line(exc)}") from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
