"""Models and decoders shared by the decoder tests, built once per session (per xdist worker: the modules
that take them do not build and compile them again). Never mutate them."""

from __future__ import annotations

import pytest

from scv_jax import SpeculativeDecoder
from tests.decoding.common import SMALL
from tests.models.fixtures import TINY, perturbed_copy, tiny_model


@pytest.fixture(scope="session")
def target():
    return tiny_model(TINY, seed=0)


@pytest.fixture(scope="session")
def partial_draft(target):
    """Agrees with the target on roughly half of the tokens: every acceptance pattern shows up."""
    return perturbed_copy(target, noise=0.6)


@pytest.fixture(scope="session")
def autoregressive(target):
    return SpeculativeDecoder(target, None, config=SMALL)
