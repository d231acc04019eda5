"""The implementation table: which implementation of an op runs for a ``backend=`` choice.

Every op registers its implementations here, in order of preference, and each says whether it
supports the op's static inputs (shapes, dtypes, layouts) and why not. Every public op takes
``backend=`` with one of:
  * ``"auto"``      the first implementation that can run here and supports the inputs: the Pallas
                    kernel on a CUDA GPU where it supports them, else the XLA reference;
  * ``"pallas"``    the Pallas (Mosaic GPU) kernel; an error naming the reason where no CUDA GPU is
                    present or the kernel does not support the inputs;
  * ``"xla"``       the pure-JAX reference, compiled by XLA for any platform;
  * ``"interpret"`` the Pallas kernel in Mosaic GPU interpret mode (a CPU simulator; tests only).

Kernel modules are imported only when a kernel may run, so ``backend="xla"`` (and ``"auto"`` off a
GPU) never loads Pallas.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax

BACKENDS: tuple[str, ...] = ("auto", "pallas", "xla", "interpret")


@functools.cache
def cuda_available() -> bool:
    """True when JAX's default backend is an NVIDIA GPU."""
    try:
        device = jax.devices()[0]
    except RuntimeError:
        return False
    return device.platform == "gpu" and "cuda" in device.client.platform_version.lower()


def _always_supported(**_: Any) -> str:
    return ""


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One way to run an op.

    Attributes:
      name: "pallas" (a Mosaic GPU kernel) or "xla" (the pure-JAX reference).
      run: the function; a kernel's also takes ``interpret: bool``.
      unsupported: ``(**static facts) -> str``: "" when the inputs are supported, else why not.
    """

    name: str
    run: Callable[..., Any]
    unsupported: Callable[..., str] = _always_supported

    @property
    def is_kernel(self) -> bool:
        return self.name == "pallas"


class Selected(NamedTuple):
    """The implementation chosen for one call (hashable: usable as a static jit argument)."""

    op: str
    implementation: Implementation
    interpret: bool

    @property
    def name(self) -> str:
        """"pallas", "interpret" or "xla": what runs."""
        return "interpret" if self.interpret else self.implementation.name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.implementation.is_kernel:
            kwargs["interpret"] = self.interpret
        return self.implementation.run(*args, **kwargs)


IMPLEMENTATIONS: dict[str, tuple[Implementation, ...]] = {}


def register(op: str, *implementations: Implementation) -> None:
    """Registers ``op``'s implementations, most preferred first; one of them must be "xla"."""
    names = [impl.name for impl in implementations]
    if "xla" not in names or len(set(names)) != len(names) or not set(names) <= {"pallas", "xla"}:
        raise ValueError(f"register({op!r}): need distinct 'pallas'/'xla' implementations including "
                         f"'xla', got {names}")
    IMPLEMENTATIONS[op] = tuple(implementations)


def select(op: str, backend: str, **facts: Any) -> Selected:
    """The implementation of ``op`` that ``backend`` asks for, given the inputs' static ``facts``.

    Raises ValueError naming the op and the reason when the choice cannot run these inputs here.
    """
    if backend not in BACKENDS:
        raise ValueError(f"{op}: backend must be one of {BACKENDS}, got {backend!r}")
    implementations = IMPLEMENTATIONS[op]
    if backend == "auto":
        for impl in implementations:
            if impl.is_kernel and not cuda_available():
                continue
            if not impl.unsupported(**facts):
                return Selected(op, impl, False)
        raise AssertionError(f"{op}: the XLA reference must support every input")  # pragma: no cover
    wanted = "xla" if backend == "xla" else "pallas"
    impl = next((i for i in implementations if i.name == wanted), None)
    if impl is None:
        raise ValueError(f"{op}: has no Pallas kernel; use backend='xla' or 'auto'")
    why = impl.unsupported(**facts)
    if why:
        raise ValueError(f"{op}: the Pallas kernel does not support these inputs: {why}; "
                         "use backend='xla' or 'auto'")
    if backend == "pallas" and not cuda_available():
        raise ValueError(f"{op}: backend='pallas' needs a CUDA GPU (JAX's default backend is "
                         f"{jax.default_backend()!r}); use 'auto', 'xla', or 'interpret' on CPU")
    return Selected(op, impl, backend == "interpret")


def describe() -> list[tuple[str, str]]:
    """(op, implementations in order of preference) for every registered op."""
    return [(op, " > ".join(i.name for i in impls)) for op, impls in IMPLEMENTATIONS.items()]


def implementation(op: str, name: str) -> Implementation:
    """``op``'s implementation called ``name`` ("pallas" or "xla"), e.g. to lower the kernel on CPU."""
    for impl in IMPLEMENTATIONS[op]:
        if impl.name == name:
            return impl
    raise ValueError(f"{op}: no {name!r} implementation (has {[i.name for i in IMPLEMENTATIONS[op]]})")
