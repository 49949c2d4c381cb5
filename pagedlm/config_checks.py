"""The configs' shared checks of a user's setting: a ValueError naming it."""
from __future__ import annotations


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_positive_int(name: str, value: object, allow_none: bool = False,
                       maximum: int | None = None) -> None:
    if value is None and allow_none:
        return
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be at most {maximum}, got {value}.")


def check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}.")
