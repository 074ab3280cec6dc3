"""Where the tests run the model: SEGSERVE_TEST_DEVICE=cpu (the default, and CI's) or cuda (on a GPU machine).

tests/conftest.py refuses other values, and cuda where torch sees no GPU."""

import os

TEST_DEVICE = os.environ.get("SEGSERVE_TEST_DEVICE", "cpu")
