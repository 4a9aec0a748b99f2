"""A block's menus by how it meets its neighbours where a boundary can be *pulled* (module docstring of
:mod:`..blockbound`, 4): one menu per variant ``(pulled, pulls)``, whether the next block's
recomputation takes this block's boundary, and whether this block's takes the previous one's
(:class:`_Menus`). Every block plan has one variant and is dominated by a point of that variant's
menu, so the least total over consistent choices (block ``m``'s ``pulled`` is block ``m + 1``'s
``pulls``) is still a bound, and a consistent choice of plans composes into the plan the blocks
claim: an inconsistent one recomputes what no block counted (on a bfloat16 Mistral-7B stack, the
residual sum a block left unsaved because no one read it, and with it the block's MLP)."""
from __future__ import annotations

from remat_compiler.clock import Deadline
from remat_compiler.solvers.cpsat.blockbound.menu import _Menu, _MenuPoint

__all__ = ["VARIANTS", "_Menus"]

#: ``(pulled, pulls)`` of a pulled boundary's layout; None where boundaries are read by backward
VARIANTS = ((0, 0), (0, 1), (1, 0), (1, 1))


class _Menus:
    """Menus tagged with their variant (None: the one menu of a layout without pulled boundaries).
    Options are theirs concatenated, each point's ``variant`` set; a stand-in is ``(menu, item)``."""

    def __init__(self, menus: list[tuple[tuple[int, int] | None, _Menu]]):
        self.menus = menus
        self.tail: list[tuple[int, int]] | None = None  # the head's menu (:mod:`.tail`), once made

    @property
    def solves(self) -> int:
        return sum(menu.solves for _, menu in self.menus)

    def options(self) -> tuple[list[_MenuPoint], list]:
        options, stand = [], []
        for mi, (variant, menu) in enumerate(self.menus):
            points, items = menu.options()
            for o in points:
                o.variant = variant
            options.extend(points)
            stand.extend(None if item is None else (mi, item) for item in items)
        return options, stand

    def neighbours(self, todo: set) -> set:
        """The bands next to those to refine, not yet refined: the next choice often moves there."""
        more = set()
        for mi, item in todo:
            if isinstance(item, tuple):
                continue
            menu = self.menus[mi][1]
            more |= {(mi, item + d) for d in (-1, 1)
                     if 0 <= item + d < len(menu.edges) - 1 and item + d not in menu.bands}
        return more

    def refine(self, todo: set, deadline: Deadline) -> bool:
        for mi, (_variant, menu) in enumerate(self.menus):
            items = {item for m, item in todo if m == mi}
            if items and not menu.refine(items, deadline):
                return False
        return True
