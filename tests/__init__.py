import pytest


# The helpers that test modules share assert as the tests do: pytest rewrites their asserts too (its failure messages)
pytest.register_assert_rewrite("tests.helpers")
