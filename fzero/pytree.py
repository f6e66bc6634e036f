"""Registration of fzero's immutable states as pytree nodes: frozen dataclasses whose *data* fields (tensors, or
containers of them) are the children and whose *meta* fields (hashable static configuration) live in the structure,
registered with ``optree`` under :data:`NAMESPACE` and with ``torch.utils._pytree`` (dynamo, ``torch.export``, DCP).

Imports: none of fzero.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any, TypeVar

import optree
import torch.utils._pytree as torch_pytree

__all__ = ["NAMESPACE", "static_field", "pytree_dataclass", "replace", "tree_map"]

NAMESPACE = "fzero"

T = TypeVar("T")


def static_field(**kwargs: Any) -> Any:
    """A dataclass field kept in the tree structure, not among the leaves."""
    return dataclasses.field(metadata={"static": True}, **kwargs)


def pytree_dataclass(cls: type[T]) -> type[T]:
    """Make ``cls`` a frozen dataclass registered as a pytree node: :func:`static_field` fields are metadata, the others
    children, in declaration order. ``obj.replace(**changes)``: a copy with fields changed (as flax's)."""
    cls.replace = replace  # type: ignore[attr-defined]
    cls = dataclasses.dataclass(frozen=True)(cls)
    fields = dataclasses.fields(cls)
    data = tuple(f.name for f in fields if not f.metadata.get("static", False))
    meta = tuple(f.name for f in fields if f.metadata.get("static", False))

    def flatten(obj: Any) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[str, ...]]:
        return tuple(getattr(obj, n) for n in data), tuple(getattr(obj, n) for n in meta), data

    def unflatten(metadata: tuple[Any, ...], children: Any) -> Any:
        return cls(**dict(zip(data, children)), **dict(zip(meta, metadata)))

    optree.register_pytree_node(cls, flatten, unflatten, namespace=NAMESPACE)

    def torch_flatten(obj: Any) -> tuple[list[Any], Any]:
        children, metadata, _ = flatten(obj)
        return list(children), metadata

    def torch_flatten_with_keys(obj: Any) -> tuple[list[tuple[Any, Any]], Any]:
        children, metadata, _ = flatten(obj)
        return [(torch_pytree.GetAttrKey(n), c) for n, c in zip(data, children)], metadata

    torch_pytree.register_pytree_node(
        cls, torch_flatten, lambda children, metadata: unflatten(metadata, children),
        serialized_type_name=f"{cls.__module__}.{cls.__qualname__}", flatten_with_keys_fn=torch_flatten_with_keys,
        # metadata JSON can hold serialises; richer metadata (a Layout) raises here, at save time
        to_dumpable_context=lambda metadata: json.dumps(list(metadata)),
        from_dumpable_context=lambda text: tuple(json.loads(text)))
    return cls


def replace(obj: T, **changes: Any) -> T:
    """``dataclasses.replace`` for fzero states (kept here so call sites read as state updates)."""
    return dataclasses.replace(obj, **changes)  # type: ignore[type-var]


def tree_map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """``optree.tree_map`` in the fzero namespace."""
    return optree.tree_map(fn, tree, *rest, namespace=NAMESPACE)
