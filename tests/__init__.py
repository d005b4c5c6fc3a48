import pytest

# the checks harness.answers holds (same_answer) report their failures as a test's own asserts do
pytest.register_assert_rewrite("harness.answers")
