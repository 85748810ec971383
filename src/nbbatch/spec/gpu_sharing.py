"""What a run that shares a GPU is given, whatever its notebook: the sharing variables every such run gets
(``gpu_sharing.yaml``), and the framework a notebook given by path is recognised as, whose own settings
(``shared_gpu_env``, ``gpu_memory_mb``, ``preload``) then apply to it too.

A notebook is recognised by its kernel (``nbbatch-<framework>``), else by its imports: the framework whose
``imports`` it all imports, the one naming most modules when several do (Lightning's ``[torch,
pytorch_lightning]`` over PyTorch's ``[torch]``); a tie recognises none.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from functools import lru_cache
from pathlib import Path

from nbbatch.spec.frameworks import Framework
from nbbatch.spec.yaml_loader import load_yaml

SHARING_FILE = Path(__file__).with_name("gpu_sharing.yaml")


@lru_cache(maxsize=1)
def sharing_defaults() -> dict[str, str]:
    """The variables every run that shares a GPU gets (before its framework's own)."""
    data = load_yaml(SHARING_FILE.read_text(), as_written=[()]) or {}
    return {str(name): str(value) for name, value in data.items()}


def shared_gpu_env(framework: Framework | None) -> dict[str, str]:
    """The variables a run of ``framework`` (None: not known) gets while it shares a GPU."""
    return {**sharing_defaults(), **(framework.shared_gpu_env if framework else {})}


def recognise(kernel: str | None, imports: Iterable[str], frameworks: Mapping[str, Framework]) -> Framework | None:
    """The framework a notebook with ``kernel`` and ``imports`` (module names, dotted ones with their parents)
    belongs to, or None when none (or more than one equally) fits."""
    for framework in frameworks.values():
        if framework.kernel_name == kernel:
            return framework
    imported = set(imports)
    fits = [fw for fw in frameworks.values() if fw.imports and imported.issuperset(fw.imports)]
    most = max((len(fw.imports) for fw in fits), default=0)
    best = [fw for fw in fits if len(fw.imports) == most]
    return best[0] if len(best) == 1 else None
