"""Sphinx configuration: MyST markdown pages and an API reference from the docstrings.

Build (what .ci/run runs): ``python -m sphinx -W --keep-going -b html docs <out dir>``.
"""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))  # the checkout, so the docs describe its code

project = "scv-jax"
author = "scv-jax authors"
copyright = "2026, scv-jax authors"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
autodoc_default_options = {"exclude-members": "__init__, __new__"}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True

html_theme = "alabaster"
html_title = "scv-jax"


def _join_shared_attributes(app, what, name, obj, options, lines):
    """``a, b: text`` in an Attributes section documents both names; napoleon makes it ``:ivar a, b:``,
    which Sphinx would read as the type ``a,`` of ``b``: write the names as one (``a,b``)."""
    for i, line in enumerate(lines):
        head, sep, rest = line.partition(":ivar ")
        if sep and ", " in rest.split(":", 1)[0]:
            names, colon, text = rest.partition(":")
            lines[i] = f"{head}:ivar {names.replace(', ', ',')}{colon}{text}"


def setup(app):
    app.connect("autodoc-process-docstring", _join_shared_attributes, priority=600)  # after napoleon (500)
