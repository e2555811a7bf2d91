import pytest

from tests.integration.harness import Procs


@pytest.fixture
def procs(tmp_path):
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.cleanup()
