"""One cases module made of parts, so that no file grows too long.

A test file launches one module name (``case_tests(globals(), "tests.fsdp1.cases_fsdp1",
...)``); that module's ``registry`` is ``combined(...)`` of its parts, each a cases
module with its own ``registry``. The cases keep the parts' order, so test ids and
their order do not depend on how a module is split.

Example::

    from tests.fsdp1 import cases_fsdp1_any_start, cases_fsdp1_parity
    from tests.support.case_parts import combined

    registry = combined(cases_fsdp1_parity, cases_fsdp1_any_start)
"""

from __future__ import annotations

import itertools
from types import ModuleType

from tests.support.harness import Registry


def combined(*parts: ModuleType) -> Registry:
    """A registry with every case of ``parts``, in order; a name used twice raises."""
    registry = Registry()
    for part in parts:
        for case in part.registry.cases.values():
            registry.add(case.name, case.fn, world_sizes=case.world_sizes)
    return registry


def covering(factors: dict[str, tuple], strength: int = 3) -> list[dict]:
    """Rows of the product of ``factors`` such that every ``strength`` factors meet in
    every combination of their values (a covering array): what a parity grid needs to
    catch an interaction of up to ``strength`` options, in a fraction of the product
    (7 two-valued factors: 16 rows at strength 3 against 128). Greedy and deterministic:
    each row is the product's first that covers the most combinations not yet covered.

    Example::

        for row in covering({"passes": (2, 3), "keep": (True, False), "sync": ("every", "last")}, 2):
            registry.add(name(**row), case(**row))
    """
    names = list(factors)
    groups = list(itertools.combinations(range(len(names)), min(strength, len(names))))
    product = list(itertools.product(*(factors[n] for n in names)))
    missing = {(g, tuple(row[i] for i in g)) for g in groups for row in product}
    rows = []
    while missing:
        best = max(product, key=lambda row: sum((g, tuple(row[i] for i in g)) in missing
                                                 for g in groups))
        missing -= {(g, tuple(best[i] for i in g)) for g in groups}
        rows.append(dict(zip(names, best)))
    return rows
