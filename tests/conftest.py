"""Shared test settings: hypothesis profiles (CI keeps examples modest on 2 cores)."""

import os
import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, settings

# Stage properties run real tensor math; 30 examples per property keep the suite
# within CI's budget on a 2-core machine while still drawing shapes widely.
settings.register_profile(
    "ci", max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "thorough", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("WCACHE_HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def sock_dir():
    """A fresh 0700 socket dir with a short path (sun_path holds 107 bytes)."""
    d = tempfile.mkdtemp(prefix="wcs-")
    os.chmod(d, 0o700)
    yield d
    shutil.rmtree(d, ignore_errors=True)
