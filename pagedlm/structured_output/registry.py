"""The structured-output backends by name: imported by the manager and by the sandbox's child
process alike, so that neither imports the other."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedlm.structured_output.backend import StructuredOutputBackend

SUPPORTED_BACKENDS = ("xgrammar",)


def check_backend(name: str) -> None:
    """ValueError unless `name` is a backend, without importing it."""
    if name not in SUPPORTED_BACKENDS:
        raise ValueError(f"structured_outputs_backend must be one of "
                         f"{list(SUPPORTED_BACKENDS)}, got {name!r}.")


def backend_class(name: str) -> type[StructuredOutputBackend]:
    check_backend(name)
    # Imported on first use: xgrammar takes about 1 s to import, which a server with no
    # structured-output request never needs (nor its start-up).
    from pagedlm.structured_output.xgrammar_backend import XGrammarBackend
    return XGrammarBackend
