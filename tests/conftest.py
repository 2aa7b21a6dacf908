import pytest

from ranks import shutdown_pools


@pytest.fixture(scope="session", autouse=True)
def _rank_pools():
    """Worker pools of tests/ranks.py live for the session and are stopped at its end."""
    yield
    shutdown_pools()
