"""A real mosquitto for the IoT unit tests (the same helper as the e2e tests)."""

from __future__ import annotations

import pytest

from tests.e2e.mosquitto import Mosquitto, mosquitto_binary


@pytest.fixture(scope="module")
def mosquitto(tmp_path_factory):
    if mosquitto_binary() is None:
        pytest.skip("mosquitto is not installed (make setup installs it as root with apt-get)")
    m = Mosquitto(tmp_path_factory.mktemp("mosquitto")).start()
    yield m
    m.stop()
