"""Imported first by the command line: keeps jsonschema from loading its IRI grammar, about 1 s of every command.

nbbatch's experiment schema and nbformat import jsonschema, which registers format checkers for whatever optional
packages are installed; ``rfc3987_syntax`` (pulled in by JupyterLab's jupyter-events) builds a Lark grammar when
imported. Nothing nbbatch validates uses IRI formats, so a command process goes without it. This runs on import,
before :mod:`nbbatch.ui.cli` imports the modules that import jsonschema; a process that already has jsonschema
is left as it is.
"""

from __future__ import annotations

import sys

if "jsonschema" not in sys.modules:
    sys.modules.setdefault("rfc3987_syntax", None)  # type: ignore[arg-type]  # an import of it raises ImportError
