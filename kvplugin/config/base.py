"""What every config model shares: strict models, the error type, problems at key paths."""

from __future__ import annotations

import typing
from typing import Any, NoReturn

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

Loc = tuple[str | int, ...]


class ConfigError(ValueError):
    """An invalid configuration: names the source, the key path and the reason."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _raise(title: str, problems: list[tuple[Loc, str]]) -> NoReturn:
    """Raise every problem at its own key path (pydantic prefixes the caller's location), so
    a rule that spans fields still names the exact key."""
    raise ValidationError.from_exception_data(title, [
        InitErrorDetails(type=PydanticCustomError("config", "{reason}", {"reason": why}),
                         loc=loc, input=None) for loc, why in problems])


def _fail(title: str, problems: list[tuple[Loc, str]]) -> None:
    if problems:
        _raise(title, problems)


def _surface(title: str, loc: Loc, build: typing.Callable[[], Any]) -> Any:
    """Run a runtime constructor; its ValueError becomes a config error at ``loc``."""
    try:
        return build()
    except ValueError as e:
        _raise(title, [(loc, str(e))])
