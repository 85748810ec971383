"""papermill's parameter options (``-p``, ``-r``, ``-y``, ``-f``) of ``nbbatch run``, ``submit`` and ``plan``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

from nbbatch.errors import NbbatchError
from nbbatch.spec.schema import parameter_name_problem
from nbbatch.spec.yaml_loader import load_yaml


def typed_value(value: str) -> Any:
    """papermill's ``-p`` typing (papermill.cli._resolve_type), exactly: ``True``, ``False`` and ``None`` as
    spelled, then whatever int() and then float() accept (``1_000``, ``1e-4``, ``nan``, ``-inf``), else the string."""
    if value in ("True", "False", "None"):
        return {"True": True, "False": False, "None": None}[value]
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def parameters_of(args: argparse.Namespace) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for path in args.parameters_file or []:
        try:
            loaded = load_yaml(Path(path).read_text())
        except (OSError, ValueError, yaml.YAMLError) as exc:  # ValueError: not UTF-8 text
            raise NbbatchError(f"cannot read parameters file {path}: {exc}") from exc
        if not isinstance(loaded, dict):
            raise NbbatchError(f"parameters file {path} must be a YAML mapping of names to values")
        params.update(loaded)
    for text in args.parameters_yaml or []:
        try:
            loaded = load_yaml(text)
        except yaml.YAMLError as exc:
            raise NbbatchError(f"-y {text!r} is not valid YAML: {exc}") from exc
        if not isinstance(loaded, dict):
            raise NbbatchError(f"-y takes a YAML mapping, e.g. -y 'lr: 0.1' (got {text!r})")
        params.update(loaded)
    for name, value in args.parameters or []:
        params[name] = typed_value(value)
    for name, value in args.parameters_raw or []:
        params[name] = value
    for name in params:  # papermill sets each as a Python variable: `class = 1` would fail in the notebook
        problem = parameter_name_problem(name)
        if problem is not None:
            raise NbbatchError(f"parameter {name!r}: {problem}")
    return params


def add_parameter_options(parser: argparse.ArgumentParser, whose: str) -> None:
    """papermill's parameter options; ``whose`` says what they set, in their group's title."""
    group = parser.add_argument_group(f"parameters ({whose})")
    group.add_argument("-p", "--parameters", nargs=2, action="append", metavar=("NAME", "VALUE"),
                       help="a parameter, typed like papermill: True, False, None, else an int or float (1e-4, "
                            "-inf, nan) where Python reads one, else the string")
    group.add_argument("-r", "--parameters-raw", nargs=2, action="append", metavar=("NAME", "VALUE"),
                       help="a parameter kept as a string")
    group.add_argument("-y", "--parameters-yaml", action="append", metavar="YAML", help="parameters as YAML")
    group.add_argument("-f", "--parameters-file", action="append", metavar="FILE", help="parameters from a YAML file")

    class NegativeNumber:
        """What argparse reads as a value, not an option: every negative number int() or float() reads, as papermill
        does (`-p lr -inf`, `-p lr -1e-4`); argparse's own pattern knows only the likes of -1 and -1.5."""

        @staticmethod
        def match(text: str) -> bool:
            return text.startswith("-") and not isinstance(typed_value(text), str)

    parser._negative_number_matcher = NegativeNumber()  # type: ignore[assignment]  # no option of nbbatch is a number
