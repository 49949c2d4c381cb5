"""The structured-output backends by name: imported by the manager and by the sandbox's child
process alike, so that neither imports the other."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedlm.structured_output.backend import StructuredOutputBackend

SUPPORTED_BACKENDS = ("xgrammar",)


def backend_class(name: str) -> type[StructuredOutputBackend]:
    if name == "xgrammar":
        # Imported on first use: xgrammar loads torch and transformers, which a server with no
        # structured-output request never needs.
        from pagedlm.structured_output.xgrammar_backend import XGrammarBackend
        return XGrammarBackend
    raise ValueError(f"structured_outputs_backend must be one of {list(SUPPORTED_BACKENDS)}, "
                     f"got {name!r}.")
