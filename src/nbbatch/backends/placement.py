"""Where a node launcher is in its gang, by the variables each backend's cluster sets: the backends' placement hooks.

``nbbatch run-one`` reads a node's place through the hook of its backend, found through the registry
(:func:`nbbatch.backends.node_placement_hook`: a function the backend registers, importable without its SDK, else
its class's :meth:`~nbbatch.backends.base.Backend.node_placement`).
"""

from __future__ import annotations

import functools

from nbbatch.backends import node_placement_hook
from nbbatch.execute.placement import PlacementReader
from nbbatch.store.share import Share


def placement_reader(backend: str, share: Share | None = None) -> PlacementReader | None:
    """The placement hook of the backend called ``backend`` (None: it has none beyond nbbatch's own variables).

    With ``share``, the hook gets it: nodes may exchange their addresses through it (Slurm's do)."""
    hook = node_placement_hook(backend)
    if hook is None or share is None:
        return hook
    return functools.partial(hook, share=share)


__all__ = ["placement_reader"]
