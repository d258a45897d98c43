"""One cases module made of parts, so that no file grows too long.

A test file launches one module name (``case_tests(globals(), "tests.cases_fsdp1",
...)``); that module's ``registry`` is ``combined(...)`` of its parts, each a cases
module with its own ``registry``. The cases keep the parts' order, so test ids and
their order do not depend on how a module is split.

Example::

    from tests import cases_fsdp1_any_start, cases_fsdp1_parity
    from tests.case_parts import combined

    registry = combined(cases_fsdp1_parity, cases_fsdp1_any_start)
"""

from __future__ import annotations

from types import ModuleType

from tests.harness import Registry


def combined(*parts: ModuleType) -> Registry:
    """A registry with every case of ``parts``, in order; a name used twice raises."""
    registry = Registry()
    for part in parts:
        for case in part.registry.cases.values():
            registry.add(case.name, case.fn, world_sizes=case.world_sizes)
    return registry
