"""The one way nbbatch reads YAML that people write: experiment files, ``framework.yaml``, ``nbbatch run -y/-f``.

PyYAML resolves plain scalars by YAML 1.1, where a float needs a dot: ``1e-4`` and ``1e4`` would be strings, so
``loguniform: [1e-4, 1e-1]`` would be refused and a parameter would get ``'1e-4'``; ``010`` would be 8 (octal),
``1:20`` 80 (base 60), and ``yes``, ``on``, ``NO`` booleans. :class:`YamlLoader` is PyYAML's safe loader with the
scalars of YAML 1.2's core schema: ``1e-4`` and ``-.5`` are floats, ``010`` is 10 (``0o10`` is octal, ``0x10``
hexadecimal), only ``true``/``false`` are booleans, and ``1:20`` or ``NO`` are text. Digits may be grouped with
``_`` (``1_000``), as in Python. A quoted scalar is always a string.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from nbbatch.errors import SpecError

__all__ = ["YamlLoader", "load_yaml"]

_FLOAT_TAG = "tag:yaml.org,2002:float"
_STR_TAG = "tag:yaml.org,2002:str"
_NULL_TAG = "tag:yaml.org,2002:null"
_INT_TAG = "tag:yaml.org,2002:int"
_BOOL_TAG = "tag:yaml.org,2002:bool"
_FLOAT = re.compile(r"""^(?:
      [-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?     # 1.5, 1., 1.0e-4, 1.5e+3
    | [-+]?[0-9][0-9_]*[eE][-+]?[0-9]+                   # 1e-4, 1e4: YAML 1.2 (a string for YAML 1.1)
    | [-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?                 # .5, -.5
    | [-+]?\.(?:inf|Inf|INF)
    | \.(?:nan|NaN|NAN))$""", re.X)
_INT = re.compile(r"^(?:[-+]?[0-9][0-9_]*|0o[0-7_]+|0x[0-9a-fA-F_]+)$")  # 010 is ten; 0o10 eight, 0x10 sixteen
_BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")  # not YAML 1.1's yes/no/on/off


class YamlLoader(yaml.SafeLoader):
    """PyYAML's ``SafeLoader`` with YAML 1.2's core scalars: ``1e-4`` is the number 0.0001, ``010`` is 10, ``yes``
    is text; ``'1e-4'`` is a string."""

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        """A YAML 1.2 integer: decimal even with a leading zero, ``0o`` octal, ``0x`` hexadecimal."""
        text = str(self.construct_scalar(node)).replace("_", "")
        if text[:2] in ("0o", "0x"):
            return int(text[2:], 8 if text[1] == "o" else 16)
        return int(text, 10)


# PyYAML's YAML 1.1 resolvers of booleans, integers and floats swapped for YAML 1.2's
YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers if tag not in (_FLOAT_TAG, _INT_TAG, _BOOL_TAG)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
YamlLoader.add_implicit_resolver(_BOOL_TAG, _BOOL, list("tTfF"))
YamlLoader.add_implicit_resolver(_INT_TAG, _INT, list("-+0123456789"))
YamlLoader.add_implicit_resolver(_FLOAT_TAG, _FLOAT, list("-+0123456789."))
YamlLoader.add_constructor(_INT_TAG, YamlLoader.construct_yaml_int)


def load_yaml(text: str, as_written: Iterable[tuple[str, ...]] = ()) -> Any:
    """``text`` read with :class:`YamlLoader` (raises ``yaml.YAMLError``).

    ``as_written``: key paths of mappings (``("env",)``) whose plain keys and values are text, kept as the user wrote
    them: ``1e-4`` stays ``"1e-4"``, ``true`` stays ``"true"``, a key ``OFF`` is not ``False``. A null, a list or a
    mapping there is left as it is, for validation to refuse."""
    loader = YamlLoader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return None
        for path in as_written:
            _keep_as_written(root, path)
        return loader.construct_document(root)
    finally:
        loader.dispose()


def _keep_as_written(root: yaml.Node, path: tuple[str, ...]) -> None:
    node: yaml.Node | None = root
    for key in path:
        node = next((value for name, value in reversed(node.value) if isinstance(name, yaml.ScalarNode)
                     and name.value == key), None) if isinstance(node, yaml.MappingNode) else None
    if isinstance(node, yaml.MappingNode):
        node.value = [(_as_text(name), _as_text(value)) for name, value in node.value]


def _as_text(node: yaml.Node) -> yaml.Node:
    """A plain value as the string written (``OFF``, ``1e-4``): a new node, not a retagged one, so an anchored value
    (``LR: &lr 1e-4`` … ``env: {LR: *lr}``) stays a number elsewhere. A null or a collection is left as it is."""
    if not isinstance(node, yaml.ScalarNode) or node.tag == _NULL_TAG:
        return node
    return yaml.ScalarNode(_STR_TAG, node.value, node.start_mark, node.end_mark, node.style)


# environment variables are text, kept as written (also the backend's, e.g. Ray's env and env_vars)
SPEC_AS_WRITTEN = (("env",), ("backend", "env"), ("backend", "runtime_env", "env_vars"))


def read_spec_file(path: Path, what: str) -> Any:
    """The YAML of an experiment or pipeline file (``what``: ``experiment`` or ``pipeline``, for the messages), its
    ``env:`` values as written; a file that does not exist or cannot be read is one :class:`~nbbatch.errors.SpecError`."""
    if not path.exists():
        raise SpecError(f"{what} file {path} does not exist")
    try:
        return load_yaml(path.read_text(), as_written=SPEC_AS_WRITTEN)
    except yaml.YAMLError as exc:
        raise SpecError(f"{path} is not valid YAML: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise SpecError(f"{path} is not a text file: {exc}") from exc
    except (ValueError, RecursionError) as exc:  # e.g. an integer too long to read, nesting too deep
        raise SpecError(f"{path} cannot be read as a{'n' if what[0] in 'aeiou' else ''} {what}: "
                        f"{type(exc).__name__}: {str(exc)[:200]}") from exc
    except OSError as exc:  # a folder, no permission
        raise SpecError(f"cannot read the {what} file {path}: {exc.strerror or exc}") from exc
