"""``python -m scv_jax``: the ``scv-jax`` command."""

import sys

from scv_jax.cli import main

sys.exit(main())
