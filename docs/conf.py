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
