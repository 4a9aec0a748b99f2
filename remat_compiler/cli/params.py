"""The CLI's parameter types and checks: each bad argument is a usage error (exit 2) before anything runs."""
from __future__ import annotations

import os
import tempfile
from typing import Any

import click

from remat_compiler.budget import parse_budget
from remat_compiler.solvers import get_solver
from remat_compiler.workload import FactoryError, parse_factory_args

__all__ = ["BudgetType", "BUDGET", "check_solver", "check_solver_list", "check_budget_list", "factory_args",
           "writable"]


class BudgetType(click.ParamType):
    """A memory budget as :func:`remat_compiler.parse_budget` accepts it; the string is kept as given."""

    name = "BUDGET"

    def convert(self, value: Any, param, ctx) -> str:
        try:
            parse_budget(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)
        return str(value).strip()


BUDGET = BudgetType()


def check_solver(ctx, param, value: str | None) -> str | None:
    if value is not None:
        try:
            get_solver(value)
        except ValueError as exc:
            raise click.BadParameter(str(exc), ctx=ctx, param=param) from exc
    return value


def check_solver_list(ctx, param, value: str | None) -> list[str] | None:
    if value is None:
        return None
    names = [v.strip() for v in value.split(",") if v.strip()]
    if not names:
        raise click.BadParameter("give at least one name", ctx=ctx, param=param)
    for name in names:
        check_solver(ctx, param, name)
    return names


def check_budget_list(ctx, param, value: str | None) -> list[str] | None:
    if value is None:  # an optional list left out
        return None
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise click.BadParameter("give at least one budget", ctx=ctx, param=param)
    return [BUDGET.convert(v, param, ctx) for v in items]


def factory_args(ctx, param, value) -> dict:
    try:
        return parse_factory_args(value)
    except FactoryError as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from exc


def writable(_ctx, param, value: str | None) -> str | None:
    """Check at parse time, before any tracing or solving, that a file can be written at ``value``
    (its folder exists and takes a new file), naming the path given."""
    if value is None:
        return None
    folder = os.path.dirname(os.path.abspath(value)) or "."
    try:
        fd, probe = tempfile.mkstemp(prefix=".tmp-probe-", dir=folder)
    except OSError as exc:
        raise click.BadParameter(f"cannot write {value}: {exc.strerror} ({folder})", param=param) from exc
    os.close(fd)
    os.unlink(probe)
    return value
