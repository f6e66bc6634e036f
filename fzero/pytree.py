"""Registration of fzero's immutable states as pytree nodes.

Every state class is a frozen dataclass whose fields are split into *data*
fields (tensors, or containers of tensors: the pytree children) and *meta*
fields (hashable static configuration that lives in the tree structure).
The class is registered twice:

* with ``optree`` under the namespace :data:`NAMESPACE` (``"fzero"``), the
  public pytree library of the project: ``optree.tree_map(f, state,
  namespace=fzero.NAMESPACE)``;
* with ``torch.utils._pytree``, so that dynamo, ``torch.export`` and
  ``torch.distributed.checkpoint`` see through the states as well.

Flattening and unflattening keep every meta field: a round trip returns an
equal state (jmp's ``DynamicLossScale`` loses ``min_loss_scale`` this way).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, TypeVar

import optree
import torch.utils._pytree as torch_pytree

__all__ = ["NAMESPACE", "static_field", "pytree_dataclass", "replace", "tree_map"]

NAMESPACE = "fzero"

T = TypeVar("T")


def _split_fields(cls: type) -> tuple[tuple[str, ...], tuple[str, ...]]:
    data, meta = [], []
    for f in dataclasses.fields(cls):
        (meta if f.metadata.get("static", False) else data).append(f.name)
    return tuple(data), tuple(meta)


def static_field(**kwargs: Any) -> Any:
    """A dataclass field kept in the tree structure, not among the leaves."""
    return dataclasses.field(metadata={"static": True}, **kwargs)


def pytree_dataclass(cls: type[T]) -> type[T]:
    """Make ``cls`` a frozen dataclass and register it as a pytree node.

    Fields declared with :func:`static_field` are metadata; all others are
    children. Children come first in flattening order, in declaration order.
    ``obj.replace(**changes)``: a copy with fields changed (as flax's states).
    """
    cls.replace = replace  # type: ignore[attr-defined]
    cls = dataclasses.dataclass(frozen=True)(cls)
    data, meta = _split_fields(cls)

    def flatten(obj: Any) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[str, ...]]:
        return (
            tuple(getattr(obj, n) for n in data),
            tuple(getattr(obj, n) for n in meta),
            data,
        )

    def unflatten(metadata: tuple[Any, ...], children: Any) -> Any:
        kwargs = dict(zip(data, children))
        kwargs.update(zip(meta, metadata))
        return cls(**kwargs)

    optree.register_pytree_node(cls, flatten, unflatten, namespace=NAMESPACE)

    def torch_flatten(obj: Any) -> tuple[list[Any], Any]:
        children, metadata, _ = flatten(obj)
        return list(children), metadata

    def torch_flatten_with_keys(obj: Any) -> tuple[list[tuple[Any, Any]], Any]:
        children, metadata, _ = flatten(obj)
        return [(torch_pytree.GetAttrKey(n), c) for n, c in zip(data, children)], metadata

    def to_dumpable(metadata: tuple[Any, ...]) -> str:
        # Static fields that JSON can hold (numbers, None, bools) serialise; a state whose
        # metadata holds richer objects (a Layout) raises here, at save time.
        return json.dumps(list(metadata))

    torch_pytree.register_pytree_node(
        cls,
        torch_flatten,
        lambda children, metadata: unflatten(metadata, children),
        serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
        flatten_with_keys_fn=torch_flatten_with_keys,
        to_dumpable_context=to_dumpable,
        from_dumpable_context=lambda text: tuple(json.loads(text)),
    )
    return cls


def replace(obj: T, **changes: Any) -> T:
    """``dataclasses.replace`` for fzero states (kept here so call sites read as state updates)."""
    return dataclasses.replace(obj, **changes)  # type: ignore[type-var]


def tree_map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """``optree.tree_map`` in the fzero namespace."""
    return optree.tree_map(fn, tree, *rest, namespace=NAMESPACE)
