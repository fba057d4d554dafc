"""Mutation testing: hand-written mutants (:mod:`tests.mutation.mutants`, run by :mod:`tests.mutation.run`)
and the mutmut pass configured in pyproject.toml ([tool.mutmut]); README "Test" says how to run both."""
