import pytest

from flowkit.dsl import Model


@pytest.fixture
def actor() -> Model:
    return Model(name="actor", build="pkg.models:build_gpt", stages=2, tags=("train",))
