"""The session's example batch: the runs of the selected tests that name one with
``tests.support.examples.batched`` share its launches (tests/support/examples.py)."""


def pytest_collection_finish(session) -> None:
    from tests.support import examples

    examples.plan_session(session.items)
