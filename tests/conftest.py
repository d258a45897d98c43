"""What the session starts once its tests are collected: the example batch (the runs of
the selected tests that name one with ``tests.support.examples.batched`` share its
launches, tests/support/examples.py) and the runs a fixture starts early
(tests/support/background.py)."""


def pytest_collection_finish(session) -> None:
    from tests.support import background, examples

    examples.plan_session(session.items)
    if not session.config.option.collectonly:
        background.plan_session(session.items)


def pytest_sessionfinish(session, exitstatus) -> None:
    from tests.support import background

    background.stop_all()
