"""A plan cache on disk: one JSON file per (graph, budget, device model, solver and options).

A compiled module plans each new input signature on its first call, and every new process plans it
again. With ``compile(..., plan_cache=DIR)`` (or ``plan_model(..., plan_cache=DIR)``, the CLI's
``plan --plan-cache DIR``) a plan is looked up under its key before solving and stored after::

    key  = cache_key(cg, budget_bytes, cost_model, strategy, options)
    plan = cache.load(key, cg, budget_bytes)        # None: absent, or detected bad and reported
    if plan is None:
        plan = solve(...); cache.store(key, plan)

The key (:func:`cache_key`) covers everything that changes the plan: the graph fingerprint (the
graph, shapes, dtypes, whether outputs are held), the budget in bytes, the cost model's rates (the
device model the runtime estimate and so the objective come from), the solver's name and the options
it takes that change its answer (not ``progress``, ``memo`` or ``deadline``, which do not change the
plan's meaning), the forced and forbidden saves a policy resolved to, and this module's and the plan's
schema versions.

A file is never trusted: it must parse, carry this cache's schema version and its own key, hold a
plan whose digest matches its content (:meth:`Plan.from_json`), made for this graph (fingerprint)
and this budget, which :func:`remat_compiler.check.check_plan` accepts. Anything else is reported
with a :class:`PlanCacheWarning` and re-planned; the new plan replaces the file. Files are written
atomically (:mod:`remat_compiler.passes.files`: a temporary file in ``DIR``, then a rename), so concurrent
writers of one key each leave a whole, valid file, and a reader sees one of them.

>>> m = remat_compiler.compile(model, "1GiB", plan_cache="~/.cache/remat")   # doctest: +SKIP
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import warnings
from types import MappingProxyType
from typing import Mapping

from remat_compiler.errors import PlanCheckError, PlanMismatchError
from remat_compiler.passes.files import atomic_write_text
from remat_compiler.passes.costs import COSTING_VERSION
from remat_compiler.graph import CostGraph
from remat_compiler.plan import SCHEMA_VERSION as PLAN_SCHEMA_VERSION, Plan

__all__ = ["PlanCache", "PlanCacheWarning", "cache_key", "key_fields", "key_of", "serves", "CACHE_SCHEMA_VERSION",
           "UNKEYED_OPTIONS"]

#: The version of the cache file's wrapper (the plan inside has its own).
CACHE_SCHEMA_VERSION = 1

#: Solver options left out of the key: those that do not change the plan, and ``tolerance``, which
#: only lets the search stop sooner (a cached plan serves a request whose tolerance is at least the
#: one it was made with, :func:`serves`: ``plan_model``'s proven plan serves ``compile``'s request).
UNKEYED_OPTIONS = frozenset({"progress", "memo", "deadline", "tolerance"})


def serves(plan: Plan, options: Mapping) -> bool:
    """Whether a cached ``plan`` answers a request with these solver ``options``: it was searched
    at least as far (made with no larger a ``tolerance``)."""
    return plan.extras.get("tolerance", 0.0) <= options.get("tolerance", 0.0)


class PlanCacheWarning(UserWarning):
    """A cache file was unreadable, corrupt or for another graph or budget: it was re-planned."""


def _strategy_name(strategy) -> str:
    """A solver's name in the key: the registry's name, or where a caller's own callable lives."""
    from remat_compiler.solvers import SOLVERS

    if SOLVERS.get(strategy.name) is strategy:
        return strategy.name
    fn = strategy.solve
    return f"{strategy.name}@{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def key_fields(cg: CostGraph, budget_bytes: int | None, cost_model, strategy, options: Mapping) -> dict:
    """What :func:`cache_key` hashes, as a JSON-able dict (also written into the file, for people)."""
    opts = {}
    for k, v in sorted(options.items()):
        if k in UNKEYED_OPTIONS:
            continue
        opts[k] = sorted(v) if isinstance(v, (set, frozenset, list, tuple)) else v
    rates = dataclasses.asdict(cost_model) if dataclasses.is_dataclass(cost_model) else repr(cost_model)
    return {
        "fingerprint": cg.fingerprint,
        "budget_bytes": budget_bytes,
        "cost_model": {"type": type(cost_model).__name__, "rates": rates},
        "solver": _strategy_name(strategy),
        "options": json.loads(json.dumps(opts, sort_keys=True, default=repr)),
        "plan_schema_version": PLAN_SCHEMA_VERSION,
        "cache_schema_version": CACHE_SCHEMA_VERSION,
        "costing_version": COSTING_VERSION,  # plans cached under an older costing are not served
    }


def cache_key(cg: CostGraph, budget_bytes: int | None, cost_model, strategy, options: Mapping) -> str:
    """The cache key of a plan request: a hash of :func:`key_fields`.

    Parameters
    ----------
    cg : CostGraph
        The annotated graph (its fingerprint).
    budget_bytes : int | None
        The budget resolved to bytes (a fraction resolved on this graph), None for no limit.
    cost_model : passes.CostModel
        The device model (its rates are part of the key).
    strategy : remat_compiler.solvers.Strategy
    options : mapping
        The solver's options as it is called with them (a policy's ``forced_saved`` and
        ``forbidden_saved`` included); :data:`UNKEYED_OPTIONS` are left out.

    Returns
    -------
    str
        32 hex digits.
    """
    return key_of(key_fields(cg, budget_bytes, cost_model, strategy, options))


def key_of(fields: Mapping) -> str:
    """The cache key of :func:`key_fields`' fields: 32 hex digits of their hash."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]


class PlanCache:
    """Plans on disk under ``directory``, one file ``<key>.plan.json`` per key.

    Parameters
    ----------
    directory : str or PathLike
        Created (with parents) on the first store if missing; ``~`` is expanded.
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = os.path.abspath(os.path.expanduser(os.fspath(directory)))

    def __repr__(self) -> str:
        return f"PlanCache({self.directory!r})"

    def path(self, key: str) -> str:
        """The file of a key."""
        return os.path.join(self.directory, f"{key}.plan.json")

    def load(self, key: str, cg: CostGraph, budget_bytes: int | None,
             options: Mapping = MappingProxyType({})) -> Plan | None:
        """The cached plan of ``key``, checked against ``cg`` and ``budget_bytes``, if it :func:`serves`
        a request with these solver ``options``; None if there is none, if it was searched less far
        than asked (the caller plans again, and its store replaces the file), or if the file is not
        a valid plan for them (then a :class:`PlanCacheWarning` says why, and the caller re-plans).

        Raises
        ------
        OSError
            If the file exists but cannot be read (a permission error is not a cache miss).
        """
        path = self.path(key)
        text = _read_or_none(path)
        if text is None:
            return None
        try:
            plan = self._verified(text, key, cg, budget_bytes)
        except (ValueError, PlanMismatchError, PlanCheckError) as exc:
            warnings.warn(f"plan cache file {path} is not a valid plan for this step, re-planning: {exc}",
                          PlanCacheWarning, stacklevel=3)
            return None
        return plan if serves(plan, options) else None

    def recorded_combines(self, key: str, segments) -> dict[str, str] | None:
        """The MoE combine per segment that the plan under ``key`` records
        (``plan.extras["moe_combine"]``): which graph to verify it against (:meth:`load`) when the
        combines were chosen in the solve.

        The file is read as :meth:`load` reads it (its schema version, its key, the plan's digest),
        and it must record a combine mode (:data:`~remat_compiler.moe.layer.COMBINE_MODES`) for
        exactly ``segments``. None if there is no file, or if it is not such a plan: then a
        :class:`PlanCacheWarning` says why, and the caller re-plans (its store replaces the file).

        Raises
        ------
        OSError
            If the file exists but cannot be read.
        """
        from remat_compiler.moe.layer import COMBINE_MODES

        path = self.path(key)
        text = _read_or_none(path)
        if text is None:
            return None
        try:
            modes = _recorded_modes(text, key)
            if set(modes) != set(segments) or not all(isinstance(m, str) and m in COMBINE_MODES
                                                      for m in modes.values()):
                raise ValueError(f"it records the combines {modes!r}, not one of {COMBINE_MODES} for each "
                                 f"of the segments {sorted(segments)}")
        except ValueError as exc:
            warnings.warn(f"plan cache file {path} is not a valid plan for this step, re-planning: {exc}",
                          PlanCacheWarning, stacklevel=3)
            return None
        return modes

    @staticmethod
    def _verified(text: str, key: str, cg: CostGraph, budget_bytes: int | None) -> Plan:
        """The plan in a cache file's text, or ValueError / PlanMismatchError / PlanCheckError."""
        from remat_compiler.check import check_plan

        try:
            doc = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"invalid JSON ({exc})") from exc
        if not isinstance(doc, dict) or doc.get("cache_schema_version") != CACHE_SCHEMA_VERSION:
            version = doc.get("cache_schema_version") if isinstance(doc, dict) else None
            raise ValueError(f"cache schema version {version!r}, expected {CACHE_SCHEMA_VERSION}")
        if doc.get("key") != key:
            raise ValueError(f"the file holds key {doc.get('key')!r}, not {key!r}")
        plan = Plan.from_json(doc.get("plan"))
        plan.check_applies_to(cg)
        if plan.budget_bytes != budget_bytes:
            raise ValueError(f"the plan was made for budget {plan.budget_bytes} bytes, not {budget_bytes}")
        check_plan(cg, plan)
        return plan

    def store(self, key: str, plan: Plan, fields: Mapping | None = None) -> str:
        """Write ``plan`` under ``key`` atomically (replacing any file there); returns its path.

        ``fields`` (:func:`key_fields`) is written beside the plan for people reading the folder.

        Raises
        ------
        OSError
            If the folder cannot be created or written.
        """
        os.makedirs(self.directory, exist_ok=True)
        doc = {"cache_schema_version": CACHE_SCHEMA_VERSION, "key": key, "key_fields": dict(fields or {}),
               "plan": plan.to_json()}
        path = self.path(key)
        atomic_write_text(path, json.dumps(doc, indent=1, sort_keys=True))
        return path


def _read_or_none(path: str) -> str | None:
    """A cache file's text, or None if there is no such file (any other OSError propagates)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        return None


def _recorded_modes(text: str, key: str) -> dict:
    """``{segment: mode}`` as a cache file's verified plan records them, or ValueError."""
    try:
        doc = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"invalid JSON ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("cache_schema_version") != CACHE_SCHEMA_VERSION or doc.get("key") != key:
        raise ValueError("not a cache file of this schema version and key")
    combine = Plan.from_json(doc.get("plan")).extras.get("moe_combine")
    if not isinstance(combine, dict) or not all(isinstance(c, dict) for c in combine.values()):
        raise ValueError(f"it records no MoE combine per segment: {combine!r}")
    return {seg: c.get("mode") for seg, c in combine.items()}
