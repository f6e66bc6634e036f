"""ZeRO stage 3: parameters stay sharded between steps and are gathered on demand.

The model is a :class:`Chain` of links, ``h_{i+1} = link_i(params_i, h_i)``,
then ``loss(h_L, target)``. Each link's parameters form one *bucket* of the
layout: their own flat groups, sharded over the ranks. A step:

* forward, link by link: ``all_gather`` the link's bucket (compute dtype),
  run it without autograd, drop the gathered parameters; only the
  activations at link boundaries are kept;
* backward, links in reverse: ``all_gather`` the bucket again, recompute the
  link with ``torch.func.vjp`` and pull the gradient through it, then
  ``reduce_scatter`` the link's parameter gradients at once.

No collective is inside a differentiated function (``torch.func`` cannot
differentiate through torch's collectives), so the step is pure and traces
with ``torch.compile(fullgraph=True)`` on the simulated world and on
``torch.distributed`` alike. At most one link's gathered parameters are alive
at a time (the next one is gathered after the previous is dropped), full
gradients never exist, and each link is recomputed once in backward (the price
of not keeping its gathered parameters and inner activations).

Communication per step and rank (Ψ padded elements): two all-gathers and one
reduce-scatter of every bucket, 3Ψ(W−1)/W with a native reduce-scatter.

Imports: ``fzero.layout``, ``fzero.sharding``, ``fzero.comm``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch.func import functional_call, grad as func_grad, vjp

from .comm import Communicator
from .layout import Layout, flatten_one, group_views
from .sharding import ShardState, average_flat_grads, check_world, stack_rows

__all__ = ["Link", "Chain", "chain_from_sequential", "chain_loss_fn", "gather_bucket", "stage3_grads"]

LinkFn = Callable[[Mapping[str, torch.Tensor], Any], Any]


@dataclasses.dataclass(frozen=True)
class Link:
    """One gather unit: the parameters whose path is one of ``prefixes`` or lies below
    one, and ``fn(params, h) -> h`` with ``params`` keyed by full path."""

    prefixes: tuple[str, ...]
    fn: LinkFn

    def owns(self, path: str) -> bool:
        return any(path == p or path.startswith(p + ".") for p in self.prefixes)


@dataclasses.dataclass(frozen=True)
class Chain:
    """A model as a chain of links and a loss ``loss(output, target) -> 0-d``.

    A batch is ``(inputs, target)``; ``inputs`` is ``h_0``.
    """

    links: tuple[Link, ...]
    loss: Callable[[Any, Any], torch.Tensor]

    def bucket_of(self, path: str) -> int:
        """The link owning ``path`` (its bucket in the layout)."""
        for i, link in enumerate(self.links):
            if link.owns(path):
                return i
        raise ValueError(f"parameter {path!r} belongs to no link of the chain")


def _run_children(children: Sequence[tuple[str, torch.nn.Module]]) -> LinkFn:
    def fn(params: Mapping[str, torch.Tensor], h: Any) -> Any:
        for name, child in children:
            own = {k[len(name) + 1 :]: v for k, v in params.items() if k.startswith(name + ".")}
            h = functional_call(child, own, (h,)) if own else child(h)
        return h

    return fn


def chain_from_sequential(
    module: torch.nn.Sequential,
    criterion: Callable[[Any, Any], torch.Tensor],
    *,
    bucket_numel: Optional[int] = None,
) -> Chain:
    """A :class:`Chain` for an ``nn.Sequential`` (the default ZeRO-3 grouping).

    Grouping: one link per child that has parameters (children without
    parameters join the link before them); with ``bucket_numel``, consecutive
    children are merged until a link holds at least that many elements.
    As :func:`fzero.module_loss`, floating inputs are cast to the compute dtype
    and a 16-bit output is upcast to fp32 before ``criterion``.
    """
    if not isinstance(module, torch.nn.Sequential):
        raise TypeError(
            f"chain_from_sequential needs an nn.Sequential, got {type(module).__name__}; build a "
            "fzero.zero3.Chain of links for other architectures"
        )
    groups: list[list[tuple[str, torch.nn.Module]]] = []
    sizes: list[int] = []
    for name, child in module.named_children():
        n = sum(p.numel() for p in child.parameters())
        if groups and (n == 0 or (bucket_numel is not None and sizes[-1] < bucket_numel)):
            groups[-1].append((name, child))
            sizes[-1] += n
        else:
            groups.append([(name, child)])
            sizes.append(n)
    links = tuple(Link(tuple(name for name, _ in g), _run_children(g)) for g in groups)

    def loss(out: Any, target: Any) -> torch.Tensor:
        if out.dtype in (torch.float16, torch.bfloat16):
            out = out.float()
        return criterion(out, target)

    return Chain(links, loss)


def chain_loss_fn(chain: Chain) -> Callable[[Mapping[str, torch.Tensor], Any], torch.Tensor]:
    """The chain as an ordinary ``loss_fn(params, (inputs, target))`` (for stages 1-2).

    ``params`` maps paths to tensors (a module's named parameters). Floating
    inputs are cast to the parameters' dtype, as in stage 3.
    """
    def loss_fn(params: Mapping[str, torch.Tensor], batch: Any) -> torch.Tensor:
        h, target = batch
        dtype = next(iter(params.values())).dtype
        if torch.is_tensor(h) and h.is_floating_point():
            h = h.to(dtype)
        for link in chain.links:
            h = link.fn({k: v for k, v in params.items() if link.owns(k)}, h)
        return chain.loss(h, target)

    return loss_fn


def gather_bucket(
    shard: ShardState, comm: Communicator, bucket: int, dtype: Optional[torch.dtype]
) -> dict[int, torch.Tensor]:
    """``{flat group index: [R, padded_numel]}`` for one bucket, in ``dtype``.

    One ``all_gather`` per flat group of the bucket (of the master cast first).
    """
    return {
        g.index: comm.all_gather(shard.master[g.index].to(dtype or g.dtype))
        for g in shard.layout.groups
        if g.bucket == bucket
    }


def _link_params(
    layout: Layout,
    flat: Mapping[int, torch.Tensor],
    frozen: Mapping[str, torch.Tensor],
    link: Link,
    row: int,
    dtype: Optional[torch.dtype],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(trainable views of row ``row``, frozen tensors) of one link, keyed by path."""
    train = {}
    for gi, buf in flat.items():
        g = layout.groups[gi]
        for i, v in zip(g.slots, group_views(layout, g, buf[row])):
            train[layout.slots[i].path] = v
    fixed = {p: (t.to(dtype) if dtype is not None else t) for p, t in frozen.items() if link.owns(p)}
    return train, fixed


def stage3_grads(
    chain: Chain,
    shard: ShardState,
    comm: Communicator,
    batch: Any,
    scale_loss: Callable[[torch.Tensor], torch.Tensor],
    *,
    param_dtype: Optional[torch.dtype],
    reduce_dtype: Optional[torch.dtype],
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Averaged (still scaled) gradient shards per flat group and the per-rank losses ``[R]``.

    ``batch = (inputs, target)``, leaves ``[R, ...]``. ``scale_loss`` maps an fp32
    loss to the scaled loss that is differentiated. Collectives: per bucket,
    two ``all_gather`` and one ``reduce_scatter`` per flat group.
    """
    check_world(shard, comm)
    lay = shard.layout
    rows = comm.local_ranks
    frozen = dict(zip((s.path for s in lay.frozen_slots), shard.frozen))
    inputs, target = batch

    def cast(x: Any) -> Any:
        return x.to(param_dtype) if param_dtype is not None and torch.is_tensor(x) and x.is_floating_point() else x

    acts: list[list[Any]] = [[cast(inputs[r])] for r in range(rows)]
    with torch.no_grad():
        for i, link in enumerate(chain.links):
            flat = gather_bucket(shard, comm, i, param_dtype)
            for r in range(rows):
                train, fixed = _link_params(lay, flat, frozen, link, r, param_dtype)
                acts[r].append(link.fn({**train, **fixed}, acts[r][-1]))
            del flat  # released before the next link is gathered

    cotangents, losses = [], []
    for r in range(rows):
        def scaled(out: torch.Tensor, r: int = r) -> tuple[torch.Tensor, torch.Tensor]:
            loss = chain.loss(out, target[r])
            if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
                raise ValueError(f"the chain's loss must return a 0-d tensor, got {loss!r:.80}")
            loss = loss.float()
            return scale_loss(loss), loss.detach()

        d_out, loss = func_grad(scaled, has_aux=True)(acts[r][-1])
        cotangents.append(d_out)
        losses.append(loss)

    shards: list[Optional[torch.Tensor]] = [None] * len(lay.groups)
    for i in reversed(range(len(chain.links))):
        link = chain.links[i]
        flat = gather_bucket(shard, comm, i, param_dtype)
        per_group: dict[int, list[torch.Tensor]] = {gi: [] for gi in flat}
        for r in range(rows):
            train, fixed = _link_params(lay, flat, frozen, link, r, param_dtype)
            h = acts[r][i]
            if torch.is_tensor(h) and h.is_floating_point():
                _, pull = vjp(lambda p, x: link.fn({**p, **fixed}, x), train, h)
                d_train, cotangents[r] = pull(cotangents[r])
            else:  # integer inputs (token ids): nothing flows further back
                _, pull = vjp(lambda p: link.fn({**p, **fixed}, h), train)
                (d_train,) = pull(cotangents[r])
            leaves = [d_train.get(s.path) for s in lay.slots]
            for gi in flat:
                per_group[gi].append(flatten_one(lay, lay.groups[gi], leaves))
        del flat
        for gi, parts in per_group.items():
            g = lay.groups[gi]
            shards[gi] = average_flat_grads(stack_rows(parts), comm, reduce_dtype or g.master_dtype, g.master_dtype)
    return tuple(shards), torch.stack(losses)  # type: ignore[arg-type]
